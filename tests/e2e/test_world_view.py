"""One world view: the features used together agree on who trains and at which step, through a loss, a join, a stop
and a resume.

Three hosts (network namespaces on a bridge), one rank each, under `phalanx run --nnodes 2:3` (live recovery on):
the loop of tests/e2e/jobs/world_view_job.py with a global batch, a background Checkpointer saving every 4 steps, a
StepLog that is not in the checkpoint's state, and shard="optimizer". Host 2 is SIGKILLed whole (its launcher and
worker), and the other two go on in-process; host 2's command is run again, and its worker joins in-process; then
host 0's launcher gets SIGTERM and every rank saves at one agreed step and stops (exit 75); the same commands resume
the run from that checkpoint to its end. After it all:
- at every step, `px.rank()` and `px.world_size()` describe the ranks that applied it (dense ranks 0..n-1, in their
  launch order) and exactly one of them is `px.is_main()`;
- every step is in exactly one StepLog record, under its own number;
- every sample weighs in once per epoch, and the final parameters equal one process's on whole global batches;
- the state each rank restored is bitwise the state it had when the checkpoint was taken.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx.testing import free_port
from phalanx.world.stop import STOP_EXIT_CODE
from tests.conftest import ROOT
from tests.e2e.test_elastic import HANG_GUARD, job_env, kill_node, wait_until
from tests.helpers.global_batch_cases import reference_run
from tests.helpers.namespaces import bridged_hosts_or_skip

JOB = str(Path(__file__).resolve().parent / "jobs" / "world_view_job.py")
EPOCHS = 14  # 4 steps each: 56 steps of 0.2 s, with room for the loss, the join and the stop before the end
HIDDEN = 64


@pytest.fixture
def three_hosts():
    """Three network namespaces on a bridge: [{"ns", "addr", ...}] for hosts 0, 1, 2."""
    with bridged_hosts_or_skip("pwv", 217, 3) as hosts:
        yield hosts


def _launch(run_dir: Path, hosts: list, host: int, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", hosts[host]["ns"], sys.executable, "-m", "phalanx", "run", "--nnodes", "2:3",
         "--nproc-per-node", "1", "--master-addr", hosts[0]["addr"], "--master-port", str(port), "--rdzv-timeout",
         "60", "--rdzv-last-call", "30", JOB, str(run_dir), "--host", str(host), "--epochs", str(EPOCHS)],
        env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(run_dir: Path, name: str) -> list[list]:
    """Every process's rows of RUN_DIR/<name>-<pid>.jsonl, each with its pid appended."""
    rows = []
    for path in sorted(run_dir.glob(f"{name}-*.jsonl")):
        pid = int(path.stem.split("-")[1])
        rows += [[*json.loads(line), pid] for line in path.read_text().splitlines() if line.endswith("]")]
    return rows


def _steps_applied(run_dir: Path, host: int, world_size: int | None = None) -> int:
    """How many steps host `host`'s processes applied (at that world size, if given)."""
    return sum(1 for row in _rows(run_dir, "views") if row[5] == host and world_size in (None, row[2]))


def _joiner_steps(run_dir: Path) -> int:
    return sum(1 for row in _rows(run_dir, "views") if row[4] >= 3)  # a joiner's launch rank: one the run never used


def _finish(launchers: list, expected: list[int], what: str) -> list[str]:
    """The launchers' outputs once they end with the `expected` exit codes; every output in the failure otherwise."""
    try:
        outputs = [launcher.communicate(timeout=HANG_GUARD)[0] for launcher in launchers]
    except subprocess.TimeoutExpired:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_node(launcher)
        outputs = [launcher.communicate()[0] for launcher in launchers]
    codes = [launcher.returncode for launcher in launchers]
    texts = "\n".join(f"== launcher {i} (exit {code}):\n{text[-4000:]}" for i, (code, text) in
                      enumerate(zip(codes, outputs)))
    assert codes == expected, f"{what}: exit codes {codes}, expected {expected}\n{texts}"
    return outputs


@pytest.mark.waiting(seconds=60)
def test_a_loss_a_join_a_stop_and_a_resume_keep_one_world_view(tmp_path, three_hosts):
    port = free_port()
    launchers = [_launch(tmp_path, three_hosts, host, port) for host in range(3)]
    try:
        wait_until(lambda: _steps_applied(tmp_path, 2) >= 3, "host 2's third step", launchers)
        kill_node(launchers[2])
        wait_until(lambda: _steps_applied(tmp_path, 0, world_size=2) >= 3, "3 steps of the 2 hosts left",
                   launchers[:2])
        (tmp_path / "expect-joiner").touch()  # the ranks left wait for it: the run must not end before it is in
        launchers[2] = _launch(tmp_path, three_hosts, 2, port)  # host 2 comes back: its worker joins in-process
        wait_until(lambda: _joiner_steps(tmp_path) >= 3, "the joiner's third step", launchers)
        launchers[0].send_signal(signal.SIGTERM)
        stopped = _finish(launchers, [STOP_EXIT_CODE] * 3, "the stop")
        assert "stopped at step" in stopped[0], stopped[0]
        port = free_port()
        launchers = [_launch(tmp_path, three_hosts, host, port) for host in range(3)]  # the same commands: resume
        _finish(launchers, [0, 0, 0], "the resumed run")
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_node(launcher)
    views = _rows(tmp_path, "views")
    steps = EPOCHS * 4
    _check_the_views(views, steps)
    _check_the_steplog(tmp_path, steps)
    expected_params, expected_steps = reference_run(epochs=EPOCHS, hidden=HIDDEN)
    applied: dict = {}
    for epoch, index, ids, _ in _rows(tmp_path, "ids"):
        applied.setdefault((epoch, index), []).extend(ids)
    assert {key: sorted(ids) for key, ids in applied.items()} == expected_steps, "a sample was lost or used twice"
    results = [torch.load(path, weights_only=True) for path in sorted(tmp_path.glob("result-*.pt"))]
    assert len(results) == 3, sorted(path.name for path in tmp_path.glob("result-*.pt"))
    for result in results:
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"{(ours - theirs).abs().max():.3g} off one process"
    _check_the_restores(tmp_path)


def _check_the_views(views: list, steps: int) -> None:
    """Every step was applied by a world of n dense ranks with one main; the world was 3, then 2, then 3 again."""
    by_step: dict[int, dict] = {}
    for step, rank, size, main, launched, _host, pid in views:
        by_step.setdefault(step, {})[pid] = (rank, size, main, launched)  # a step applied twice: its last
    assert sorted(by_step) == list(range(1, steps + 1)), sorted(by_step)
    short = []
    for step, seen in sorted(by_step.items()):
        sizes = {size for _, size, _, _ in seen.values()}
        assert len(sizes) == 1, f"step {step}: the ranks disagree on px.world_size(): {seen}"
        size = sizes.pop()
        by_launch = sorted((launched, rank, main) for rank, _, main, launched in seen.values())
        ranks = [rank for _, rank, _ in by_launch]
        assert ranks == sorted(set(ranks)) and set(ranks) <= set(range(size)), \
            f"step {step}: px.rank() not dense 0..{size - 1} in launch order: {by_launch}"
        assert [rank for _, rank, main in by_launch if main] == ([0] if 0 in ranks else []), \
            f"step {step}: px.is_main() not on rank 0 alone: {by_launch}"
        if len(seen) != size:
            short.append(step)  # a rank killed after the step's commit, before it said so
    assert len(short) <= 1, f"steps not seen by every rank of their world: {short}"
    sizes = [next(iter(by_step[step].values()))[1] for step in sorted(by_step)]
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    assert changes == [3, 2, 3], f"world sizes over the run: {changes}"


def _check_the_steplog(run_dir: Path, steps: int) -> None:
    """Every step in exactly one record of steps.jsonl (a record covers `steps` steps ending at `step`)."""
    assert sorted(path.name for path in (run_dir / "steplog").glob("*.jsonl")) == ["steps.jsonl"]
    records = [json.loads(line) for line in (run_dir / "steplog" / "steps.jsonl").read_text().splitlines()]
    covered = [step for record in records for step in range(record["step"] - record["steps"] + 1, record["step"] + 1)]
    assert covered == list(range(1, steps + 1)), [(record["step"], record["steps"]) for record in records]


def _check_the_restores(run_dir: Path) -> None:
    """Each rank of the resumed run restored, bitwise, the state the rank of the same number had at the save."""
    saved = {(step, rank): print_ for step, rank, print_, _ in _rows(run_dir, "saved")}
    restores = [json.loads(path.read_text()) for path in run_dir.glob("restored-*.json")]
    assert sorted(rank for _, rank, _ in restores) == [0, 1, 2], restores
    for step, rank, restored in restores:
        at_save = saved.get((step, rank), {})
        differ = [part for part in restored if at_save.get(part) != restored[part]]
        assert not differ, f"rank {rank} restored step {step} not as it was saved: {differ} differ"
