"""Every example and `phalanx demo` run end to end at a small size, so none of them rots.

Each test starts the real script in a subprocess (under `phalanx run --nproc-per-node 2` when it is a
DDP job; world size 2, CPU only so the test means the same on every machine) and checks what users
would look at: the accuracy it prints, the loss against the unigram entropy, the files it writes. The
examples/trainers/ ones (Accelerate, Lightning) are marked `trainers`: they need the trainers extra.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from phalanx.testing import free_port
from tests.conftest import ROOT, checkout_on_pythonpath, run_command
from tests.helpers.forked_python import run_python
from tests.helpers.trainers import require

EXAMPLES = ROOT / "examples"
PHALANX = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]


def _run(command: list, *, cwd: Path, timeout: float = 150, env: dict | None = None) -> str:
    return run_command(command, cwd, env=env, timeout=timeout)


def _launch(script: Path, *args, cwd: Path, timeout: float = 150) -> str:
    return _run([*PHALANX, "run", "--nproc-per-node", "2", script, *args], cwd=cwd, timeout=timeout)


def _accuracy(output: str) -> float:
    found = re.findall(r"held-out accuracy: (\d\.\d\d)", output)
    assert len(found) == 1, f"expected one 'held-out accuracy' line (rank 0 only); output:\n{output}"
    return float(found[0])


def _epoch_lines(output: str) -> dict[int, str]:
    """{epoch: 'loss ... accuracy ... held-out ...'} from the per-epoch lines rank 0 prints."""
    return {int(n): rest for n, rest in re.findall(r"epoch\s+(\d+)/\d+\s+(loss .*)$", output, flags=re.MULTILINE)}


def test_demo_learns_writes_a_plot_and_resumes_exactly(tmp_path):
    """World size 2 (phalanx.spawn). A 20-epoch run, a second run that resumes it to 30 epochs, and a
    --fresh 30-epoch run: the resumed epochs print the same metrics as the uninterrupted run's."""
    out = tmp_path / "demo"
    first = _run([*PHALANX, "demo", "--epochs", "20", "--out", out], cwd=tmp_path)
    assert "on 2 process(es)" in first
    assert list(_epoch_lines(first)) == list(range(1, 21))
    assert _accuracy(first) >= 0.90
    plot = out / "loss.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000

    resumed = _run([*PHALANX, "demo", "--epochs", "30", "--out", out], cwd=tmp_path)
    assert "resuming from the checkpoint" in resumed and "20 of 30 epochs done" in resumed
    assert list(_epoch_lines(resumed)) == list(range(21, 31)), resumed
    assert _accuracy(resumed) >= 0.90

    fresh = _run([*PHALANX, "demo", "--epochs", "30", "--fresh", "--out", out], cwd=tmp_path)
    assert "--fresh: starting a new run" in fresh
    uninterrupted = _epoch_lines(fresh)
    assert list(uninterrupted) == list(range(1, 31))
    assert {epoch: uninterrupted[epoch] for epoch in range(21, 31)} == _epoch_lines(resumed)
    assert {epoch: uninterrupted[epoch] for epoch in range(1, 21)} == _epoch_lines(first)
    # The StepLog: a record per epoch's last step, started over by --fresh; `phalanx report` draws it.
    records = [json.loads(line) for line in (out / "log" / "steps.jsonl").read_text().splitlines()]
    per_epoch = records[0]["step"]
    assert [r["step"] for r in records] == [per_epoch * (e + 1) for e in range(30)], records
    assert all(r["world_size"] == 2 and r["slowest_rank"] in (0, 1) for r in records)
    _run([*PHALANX, "report", out], cwd=tmp_path)
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wine_example_reaches_the_accuracy_of_the_demo(tmp_path):
    """World size 2 under `phalanx run`: the script form of the demo."""
    output = _launch(EXAMPLES / "wine.py", "--epochs", "20", "--out", tmp_path / "wine", cwd=tmp_path)
    assert "on 2 process(es)" in output
    assert _accuracy(output) >= 0.90
    assert (tmp_path / "wine" / "checkpoints").is_dir()


def test_toy_example_trains_and_round_trips_its_checkpoint(tmp_path):
    """World size 2: identical replicas after DDP steps; rank 0 saves, every rank loads the same weights."""
    output = _launch(EXAMPLES / "toy.py", "--checkpoint", tmp_path / "toy.pt", cwd=tmp_path)
    assert "replicas identical on all 2 ranks: True" in output
    assert "rank 0: loaded toy.pt" in output and "rank 1: loaded toy.pt" in output
    assert "checkpoint round trip exact: True" in output
    assert (tmp_path / "toy.pt").exists()


def test_global_batch_example_resumes_at_another_world_size_on_the_uninterrupted_weights(tmp_path):
    """World size 2, stopped after step 22 (mid-epoch), resumed at world size 3; against one process (plain
    python) from start to end: the same final weights, and each run names its split of the global batch."""
    script, checkpoints = EXAMPLES / "global_batch.py", tmp_path / "checkpoints"
    first = _run([*PHALANX, "run", "--nproc-per-node", "2", script, "--checkpoints", checkpoints,
                  "--max-steps", "22", "--epochs", "2"], cwd=tmp_path)
    assert "global batch 64 = 2 ranks x 2 micro-batches x 16" in first and "left after step 22" in first
    second = _run([*PHALANX, "run", "--nproc-per-node", "3", script, "--checkpoints", checkpoints,
                   "--out", tmp_path / "resumed.pt", "--epochs", "2"], cwd=tmp_path)
    assert "global batch 64 = 3 ranks x 2 micro-batches of at most 11" in second
    assert "from step 6 of epoch 1" in second  # 16 steps per epoch: step 22 is the 6th of the second
    done = run_python([script, "--checkpoints", tmp_path / "alone", "--out", tmp_path / "alone.pt", "--epochs", "2"],
                      cwd=tmp_path, timeout=150, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                                                      "PYTHONPATH": checkout_on_pythonpath()})
    alone = done.stdout + done.stderr
    assert done.returncode == 0, alone
    assert "global batch 64 = 1 rank x 4 micro-batches x 16" in alone
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for name, value in torch.load(tmp_path / "alone.pt", weights_only=True).items():
        torch.testing.assert_close(resumed[name], value, atol=1e-5, rtol=0)


def test_ema_example_keeps_an_average_through_a_deep_copy_of_the_ddp_model(tmp_path):
    """World size 2: AveragedModel deep-copies the phalanx DDP model; the EMA evaluates and is no worse."""
    output = _launch(EXAMPLES / "ema.py", "--steps", "200", cwd=tmp_path)
    found = re.findall(r"held-out loss: live model (\d+\.\d+), EMA (\d+\.\d+)", output)
    assert len(found) == 1, output
    live, ema = map(float, found[0])
    assert ema < 0.5 and ema <= live * 1.05, output  # the noise floor is 0.25; an untrained model is far above


def test_model_parallel_example_keeps_both_halves_on_the_cpu(tmp_path):
    """World size 2, no GPUs: each rank says where its halves are; replicas stay identical."""
    output = _launch(EXAMPLES / "model_parallel.py", cwd=tmp_path)
    assert output.count("no GPUs: both halves stay on the CPU") == 2
    assert "replicas identical: True" in output


def test_gpt_example_learns_below_the_unigram_entropy_and_resumes(tmp_path):
    """World size 2, a tiny GPT for a short run: the validation loss ends well below the unigram
    entropy (it learned to use context), and a second run resumes from the checkpoint."""
    tiny = ["--n-layer", "1", "--n-head", "2", "--d-model", "48", "--block-size", "32", "--batch-size", "16",
            "--grad-accum", "2", "--lr", "1e-2", "--log-every", "20", "--checkpoint-every", "40",
            "--sample-chars", "80", "--out", tmp_path / "gpt"]
    first = _launch(EXAMPLES / "gpt" / "train.py", "--max-steps", "120", *tiny, cwd=tmp_path)
    entropy = float(re.search(r"unigram entropy of the text: (\d+\.\d+) nats/char", first).group(1))
    validation = float(re.search(r"validation loss: (\d+\.\d+) nats/char", first).group(1))
    assert validation < 0.85 * entropy, first
    assert "sample:" in first

    second = _launch(EXAMPLES / "gpt" / "train.py", "--max-steps", "140", *tiny, cwd=tmp_path)
    assert "resuming at step 120 of 140" in second, second
    assert re.search(r"step 140 \| loss", second) and not re.search(r"step 20 \| loss", second), second
    steps = [json.loads(line)["step"] for line in (tmp_path / "gpt" / "log" / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(20, 141, 20)), steps  # the StepLog: one record per 20 steps across the two runs


def test_gpt_example_trains_with_fsdp2_and_resumes_at_another_shard_level(tmp_path):
    """World size 2: --shard parameters (torch's FSDP2) trains, exports its whole weights and samples
    from them; the same checkpoints then resume under --shard gradients."""
    tiny = ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "32", "--batch-size", "8",
            "--grad-accum", "1", "--lr", "1e-2", "--log-every", "10", "--checkpoint-every", "20",
            "--sample-chars", "40", "--out", tmp_path / "gpt"]
    first = _launch(EXAMPLES / "gpt" / "train.py", "--max-steps", "40", "--shard", "parameters", *tiny, cwd=tmp_path)
    assert "shard=parameters" in first and "exported the whole weights to" in first and "sample:" in first, first
    assert (tmp_path / "gpt" / "weights.safetensors").exists()
    second = _launch(EXAMPLES / "gpt" / "train.py", "--max-steps", "50", "--shard", "gradients", *tiny, cwd=tmp_path)
    assert "resuming at step 40 of 50" in second and "shard=gradients" in second, second
    assert re.search(r"step 50 \| loss", second), second


def test_slurm_template_runs_under_a_stand_in_srun(tmp_path):
    """World size 2 through the sbatch script: a stand-in `srun` starts the tasks with SLURM's variables
    (SLURM_PROCID, SLURM_NTASKS, ...), and phalanx.init() must build the world from them alone."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(textwrap.dedent("""\
        #!/usr/bin/env python3
        # Stand-in for srun on one node: SLURM_NTASKS copies of the command, each with its task ids.
        import os, subprocess, sys
        command = sys.argv[1:]
        while command and command[0].startswith("-"):  # srun's own options
            command.pop(0)
        tasks = int(os.environ["SLURM_NTASKS"])
        workers = [subprocess.Popen(command, env={**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                                                  "SLURM_STEP_ID": "0"})
                   for i in range(tasks)]
        sys.exit(max(worker.wait() for worker in workers))
        """))
    srun.chmod(0o755)
    slurm_env = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
                 "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": str(ROOT),
                 "MASTER_PORT": str(free_port()),
                 "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])}
    output = _run(["bash", EXAMPLES / "slurm" / "train.sbatch", "--epochs", "3", "--out", tmp_path / "wine"],
                  cwd=tmp_path, env=slurm_env)
    assert "on 2 process(es)" in output
    _accuracy(output)  # printed once, by rank 0


def _held_out(output: str) -> tuple[float, float]:
    found = re.findall(r"held-out mse: (\d+\.\d+) \(predicting the mean: (\d+\.\d+)\)", output)
    assert len(found) == 1, f"expected one 'held-out mse' line (rank 0 only); output:\n{output}"
    return float(found[0][0]), float(found[0][1])


@pytest.mark.trainers
def test_accelerate_example_trains_phalanx_ddp_through_accelerate(tmp_path):
    """World size 2 under `phalanx run` (ACCELERATE_USE_CPU=1): Accelerate built phalanx's class, the replicas
    agree, the held-out error is well below predicting the mean, and save_state wrote every rank's state."""
    require("accelerate")
    output = _run([*PHALANX, "run", "--nproc-per-node", "2", EXAMPLES / "trainers" / "accelerate_train.py",
                   "--out", tmp_path / "state"], cwd=tmp_path, env={"ACCELERATE_USE_CPU": "1"})
    assert "model class: phalanx.engine.ddp.DistributedDataParallel on 2 process(es)" in output, output
    assert "replicas identical: True" in output
    mse, mean = _held_out(output)
    assert mse < 0.6 * mean, output
    assert (tmp_path / "state" / "model.safetensors").exists() and (tmp_path / "state" / "random_states_1.pkl").exists()


@pytest.mark.trainers
def test_lightning_example_trains_with_the_phalanx_ddp_strategy(tmp_path):
    """World size 2, started by Lightning itself (`python lightning_train.py`): the Trainer wrapped the model in
    phalanx's class, the held-out error is well below predicting the mean, and the checkpoint was written."""
    require("lightning")
    output = _run([sys.executable, EXAMPLES / "trainers" / "lightning_train.py", "--out", tmp_path / "runs"],
                  cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert "model class: phalanx.engine.ddp.DistributedDataParallel on 2 process(es)" in output, output
    mse, mean = _held_out(output)
    assert mse < 0.6 * mean, output
    assert list((tmp_path / "runs" / "checkpoints").glob("epoch=9-*.ckpt")), output
