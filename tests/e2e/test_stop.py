"""A stop request becomes one agreed checkpoint, and the same command resumes: world size 2, end to end.

tests/e2e/jobs/stop_job.py (80 steps, a checkpoint every 3, an evaluation every 4) is stopped by a
SIGTERM to `phalanx run` at chosen moments: inside a step, inside backward while buckets are exchanged,
inside a checkpoint write, inside a restore, inside an evaluation, inside the workers' rendezvous. Each
stopped run must end within the grace period with exit code 75 and say at which step it saved; the
same command, run again, resumes there. Every step is trained exactly once across the runs, with the
parameters after each step equal to an uninterrupted run's, bitwise (a CRC-32 per step), and so are the
final parameters. The same under torchrun (SIGTERM to the workers, as SLURM sends it), at
shard="parameters", on two hosts (network namespaces), and under DiLoCo on two emulated hosts (a stop
mid-period, each host's parameters checked). PHALANX_STOP_INTERVAL=0 makes the ranks
agree at every step, so each stop lands within two steps and a chain of twenty fits in the 80.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.diagnose import stacks
from phalanx.diagnose.recorder import pid_alive
from phalanx.observe.outputs import read_records
from tests.conftest import ROOT
from tests.e2e.test_launch import clean_env, two_hosts  # noqa: F401 - two_hosts is a fixture

JOB = Path(__file__).resolve().parent / "jobs" / "stop_job.py"
GRACE = 30.0  # phalanx run's default --grace-period
HANG_GUARD = 120
SEED = int(os.environ.get("PHALANX_TEST_SEED", "24"))
KINDS = ("step", "exchange", "save", "restore", "eval")


def job_env(**extra) -> dict:
    return clean_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PHALANX_STOP_INTERVAL="0", **extra)


def phalanx_run(run_dir: Path, *job_args, flags=(), env=None) -> tuple[int, str, float]:
    """Run the job under `phalanx run --nproc-per-node 2`; (exit code, output, time it ended)."""
    command = [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", *flags, str(JOB), str(run_dir),
               *job_args]
    done = subprocess.run(command, env=env or job_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_GUARD)
    return done.returncode, done.stdout + done.stderr, time.time()


def steps_log(run_dir: Path) -> list[tuple[int, str]]:
    return [tuple(line.split()) for line in (run_dir / "steps.log").read_text().split("\n") if line]


def final(run_dir: Path) -> dict:
    return torch.load(run_dir / "final.pt", weights_only=True)


def asked_at(run_dir: Path) -> float:
    return float((run_dir / "asked.log").read_text().split()[-1])


def stop_step(output: str) -> int | None:
    found = re.findall(r"phalanx run: stopped at step (\d+) on request \(SIGTERM", output)
    return int(found[-1]) if found else None


def resumed_step(output: str) -> int | None:
    found = re.findall(r"resumed from \S+ \(saved by 2 rank\(s\), now 2\): .*'step': (\d+)", output)
    return int(found[-1]) if found else None


def check_stopped(code: int, output: str, run_dir: Path, ended: float, moment: str) -> int | None:
    """One stopped run: exit code 75, the launcher's sentence, within the grace period. Its stop step."""
    assert code == 75, f"{moment}: exit code {code}, expected 75\n{output}"
    took = ended - asked_at(run_dir)
    assert took < GRACE, f"{moment}: {took:.1f}s from the request to the exit\n{output}"
    if moment.startswith("rendezvous"):
        assert "while the workers were starting" in output, output
        return None
    step = stop_step(output)
    assert step is not None and "run the same command to resume" in output, f"{moment}:\n{output}"
    return step


def check_step_log(run_dir: Path, stops=()) -> None:
    """The StepLog's steps.jsonl and TensorBoard files hold exactly one record per logged step: every 2nd step,
    and the shorter windows ended at each save (every 3rd step: a resume starts where a record ended) and written at
    the agreed stops; every step is in exactly one record; TensorBoard (its purges applied) shows the same steps."""
    records = read_records(run_dir / "log" / "steps.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"a step logged twice or out of order: {steps}"
    assert set(range(2, 81, 2)) <= set(steps), f"logged steps missing: {sorted(set(range(2, 81, 2)) - set(steps))}"
    cadence = set(range(2, 81, 2)) | set(range(3, 81, 3))
    assert set(steps) - cadence <= set(stops), f"records off the cadence: {steps}, stops {stops}"
    covered = [step for r in records for step in range(r["step"] - r["steps"] + 1, r["step"] + 1)]
    windows = [(r["step"], r["steps"]) for r in records]
    assert covered == list(range(1, 81)), f"steps not in exactly one record: {windows}"
    assert all(r["samples"] == 8 * r["steps"] and r["loss"] is not None for r in records)
    try:
        from phalanx.observe.tb_events import read_scalars
        scalars = read_scalars(run_dir / "log")
    except ImportError:  # no tensorboardX (the log extra): steps.jsonl alone
        return
    shown = scalars["train/loss"]
    assert sorted(shown) == steps, f"TensorBoard shows steps {sorted(shown)}, steps.jsonl {steps}"
    assert all(len(values) == 1 for values in shown.values()), {s: v for s, v in shown.items() if len(v) > 1}
    assert all(shown[r["step"]][0] == pytest.approx(r["loss"], rel=1e-6) for r in records)


def check_same_as_uninterrupted(run_dir: Path, reference: Path) -> None:
    steps = steps_log(run_dir)
    numbers = [int(step) for step, _ in steps]
    assert sorted(numbers) == list(range(1, 81)), f"steps trained twice or never: {numbers}"
    assert dict(steps) == dict(steps_log(reference)), "the parameters parted from the uninterrupted run's"
    ours, theirs = final(run_dir), final(reference)
    assert ours["step"] == theirs["step"] == 80
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"]))


def chain(run_dir: Path, moments: list[str], run=None, extra: tuple = ()) -> list[tuple[str, int | None]]:
    """Stop the job at each moment in turn, each run resuming where the one before saved; then let it finish."""
    run = run or phalanx_run
    stops, previous = [], None
    for moment in moments:
        code, output, ended = run(run_dir, "--moment", moment, *extra)
        step = check_stopped(code, output, run_dir, ended, moment)
        if not moment.startswith("rendezvous"):  # zero steps redone: it resumed where the last one saved
            assert resumed_step(output) == previous, f"{moment}: expected to resume at {previous}\n{output}"
        stops.append((moment, step))
        previous = step if step is not None else previous
    code, output, _ = run(run_dir, *extra)
    assert code == 0, output
    assert resumed_step(output) == previous, output
    return stops


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    code, output, _ = phalanx_run(run_dir)
    assert code == 0, output
    assert "run summary" in output and "finished" in output
    return run_dir


def twenty_moments() -> list[str]:
    """Four of each kind in a seeded random order (not a restore first: there is nothing to restore yet), and
    the workers' rendezvous somewhere in between."""
    rng = random.Random(SEED)
    kinds = list(KINDS) * 4
    rng.shuffle(kinds)
    if kinds[0] == "restore":
        first = next(i for i, kind in enumerate(kinds) if kind != "restore")
        kinds[0], kinds[first] = kinds[first], kinds[0]
    moments = [f"{kind}:{rng.randint(1, 2) if kind in ('step', 'exchange') else 1}" for kind in kinds]
    moments.insert(rng.randint(1, len(moments) - 1), "rendezvous:1")
    return moments


@pytest.mark.timeout(600)  # 21 launches, each guarded by HANG_GUARD: ~3 min alone, more beside another test
def test_twenty_stops_resume_bitwise(tmp_path, uninterrupted):
    """World size 2 under `phalanx run`: 20 stops at random moments, then the run finishes."""
    stops = chain(tmp_path / "run", twenty_moments())
    assert len([step for _, step in stops if step is not None]) == 20, f"seed {SEED}: {stops}"
    check_same_as_uninterrupted(tmp_path / "run", uninterrupted)
    check_step_log(uninterrupted)
    check_step_log(tmp_path / "run", stops=[step for _, step in stops if step is not None])
    summary = (tmp_path / "run" / "checkpoints" / "run-summary.json").read_text()
    assert summary.count('"outcome": "stopped"') == 20 and '"outcome": "finished"' in summary


def torchrun(run_dir: Path, *job_args) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(JOB), str(run_dir),
               *job_args, *(["--to-workers"] if job_args else [])]
    done = subprocess.run(command, env=job_env(), cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD)
    output = done.stdout + done.stderr
    if job_args:  # torchrun reports its workers' exit code 75 as a failure: phalanx's line says what it was
        assert "exitcode  : 75" in output, output
        stopped = re.findall(r"INFO stopped at step (\d+) on request \(SIGTERM\)", output)
        output += f"\nphalanx run: stopped at step {stopped[-1]} on request (SIGTERM): run the same command to resume"
        return 75, output, time.time()
    return done.returncode, output, time.time()


def test_torchrun_with_sigterm_sent_to_the_workers(tmp_path, uninterrupted):
    """World size 2 under torchrun: SIGTERM to both workers mid-exchange, as a scheduler sends it, then the resume.
    One stop (each torchrun launch starts its workers fresh: ~20 s of CPU): a signal between steps is what the
    twenty stops above and SLURM's `scontrol requeue` (test_slurm.py, SIGTERM to every process) send."""
    stops = chain(tmp_path / "run", ["exchange:1"], run=torchrun)
    check_same_as_uninterrupted(tmp_path / "run", uninterrupted)
    check_step_log(tmp_path / "run", stops=[step for _, step in stops])  # the StepLog under torchrun


def test_sharded_parameters_level(tmp_path):
    """World size 2, shard="parameters" (FSDP2, a part file per rank): stops mid-exchange, mid-save, mid-restore."""
    reference = tmp_path / "uninterrupted"
    code, output, _ = phalanx_run(reference, "--shard", "parameters")
    assert code == 0, output
    chain(tmp_path / "run", ["exchange:1", "save:1", "restore:1"], extra=("--shard", "parameters"))
    numbers = [int(step) for step, _ in steps_log(tmp_path / "run")]
    assert sorted(numbers) == list(range(1, 81))
    assert all(torch.equal(a, b) for a, b in zip(final(tmp_path / "run")["params"], final(reference)["params"]))


def two_hosts_run(hosts, run_dir: Path, *job_args, port: int) -> list[tuple[int, str]]:
    """The job on 2 hosts x 1 worker, one `phalanx run` per host; (exit code, output) per host. `hosts`: network
    namespaces (the two_hosts fixture), or None for two launchers on this machine that the node rank tells apart."""
    nodes = []
    try:
        for node_rank in range(2):
            # No GLOO_SOCKET_IFNAME: phalanx finds the interface that reaches the master.
            inside = ["ip", "netns", "exec", hosts[node_rank]["ns"]] if hosts else []
            master = hosts[0]["addr"] if hosts else "127.0.0.1"
            command = [*inside, sys.executable, "-m", "phalanx", "run", "--nnodes", "2", "--node-rank", str(node_rank),
                       "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(port),
                       "--rdzv-timeout", "60", str(JOB), str(run_dir), *job_args]
            nodes.append(subprocess.Popen(command, env=job_env(), cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [node.communicate(timeout=HANG_GUARD)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    return [(node.returncode, output) for node, output in zip(nodes, outputs)]


def test_diloco_stop_mid_period_resumes_bitwise(tmp_path):
    """across_hosts=DiLoCo(every=4, fragments=2, delay=1, int8) on 2 emulated hosts x 1 worker: a SIGTERM to host 1's
    launcher before its 6th step agrees a stop mid-period, with a fragment's average on its way (fragment 1 leaves
    after step 6 and merges after step 7); the save holds it as it is, and the resumed run trains every step once,
    each host's parameters after every step bitwise those of an uninterrupted run."""
    reference = tmp_path / "uninterrupted"
    assert [code for code, _ in two_hosts_run(None, reference, "--diloco", port=29564)] == [0, 0]
    run_dir = tmp_path / "run"
    stopped = two_hosts_run(None, run_dir, "--diloco", "--moment", "step:6", port=29565)
    for code, output in stopped:
        assert code == 75, output
    steps = {stop_step(output) for _, output in stopped}
    assert len(steps) == 1, [output for _, output in stopped]
    step = steps.pop()
    assert step is not None and step % 4 != 0, f"stopped at step {step}: not mid-period"
    finished = two_hosts_run(None, run_dir, "--diloco", port=29566)
    assert [code for code, _ in finished] == [0, 0], finished
    assert resumed_step(finished[0][1]) == step
    check_same_as_uninterrupted(run_dir, reference)
    host_1 = [tuple(line.split()) for line in (run_dir / "steps-1.log").read_text().split("\n") if line]
    assert sorted(int(s) for s, _ in host_1) == list(range(1, 81)), "host 1 trained a step twice or never"
    assert dict(host_1) == dict(tuple(line.split()) for line in (reference / "steps-1.log").read_text().split("\n")
                                if line), "host 1's parameters parted from the uninterrupted run's"
    assert dict(host_1)["78"] != dict(steps_log(run_dir))["78"], "the hosts were equal mid-period: no DiLoCo"


def test_two_hosts_stop_on_one_reaches_both(tmp_path, two_hosts):  # noqa: F811 - the fixture
    """World size 2: 2 hosts x 1 worker (network namespaces); SIGTERM to host 1's launcher only, mid-step."""
    reference = tmp_path / "uninterrupted"
    assert [code for code, _ in two_hosts_run(two_hosts, reference, port=29561)] == [0, 0]
    run_dir = tmp_path / "run"
    stopped = two_hosts_run(two_hosts, run_dir, "--moment", "step:3", port=29562)
    ended = time.time()
    for code, output in stopped:
        assert code == 75, output
    steps = {stop_step(output) for _, output in stopped}
    assert len(steps) == 1 and None not in steps, [output for _, output in stopped]
    assert "SIGTERM on node 1" in stopped[0][1], stopped[0][1]  # host 0 heard it through the store
    assert ended - asked_at(run_dir) < GRACE
    finished = two_hosts_run(two_hosts, run_dir, port=29563)
    assert [code for code, _ in finished] == [0, 0], finished
    assert resumed_step(finished[0][1]) == steps.pop()
    check_same_as_uninterrupted(run_dir, reference)


def start_launcher(run_dir: Path, *job_args, flags=()) -> subprocess.Popen:
    command = [sys.executable, "-m", "phalanx", "run", *flags, str(JOB), str(run_dir), *job_args]
    return subprocess.Popen(command, env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for_training(launcher: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not (run_dir / "steps.log").exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launcher.poll() is None, launcher.communicate()[0]


def finish(launcher: subprocess.Popen) -> tuple[int, str, float]:
    try:
        output, _ = launcher.communicate(timeout=HANG_GUARD)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    return launcher.returncode, output, time.monotonic()


def all_gone(run_dir: Path) -> list[int]:
    """The workers (pids the job wrote) still running a few seconds after the launcher ended."""
    pids = [int(path.read_text()) for path in run_dir.glob("pid-*")]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if pid_alive(pid)]


# tests/suite.py: these check that a stop ends within seconds
@pytest.mark.waiting
class TestLauncherEdges:
    """World size 2 (and a lone node 1): the stops that cannot wait for an agreed step."""

    def test_a_stop_during_the_launchers_rendezvous_ends_it_at_once(self, tmp_path):
        """Node 1 of 2 waits for a node 0 that never comes; SIGTERM: nothing ran, nothing to save."""
        from phalanx.testing import free_port

        launcher = start_launcher(tmp_path, flags=("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
                                                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                                                   "--rdzv-timeout", "60"))
        # Past its imports (seconds on a busy machine, when a SIGTERM still ends it as any process): the
        # launcher has taken SIGTERM over just before it dials node 0; then a moment into that wait.
        deadline = time.monotonic() + HANG_GUARD
        while not stacks.catches(launcher.pid, signal.SIGTERM):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
            time.sleep(0.05)
        time.sleep(1)
        asked = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        code, output, ended = finish(launcher)
        assert code == 75, output
        assert "during the rendezvous, before any worker started: nothing to save" in output
        assert ended - asked < 5, output

    @pytest.mark.waiting(seconds=10)
    def test_a_second_ctrl_c_kills_at_once(self, tmp_path):
        """World size 2, steps of 3 s: Ctrl-C asks, a second Ctrl-C kills before the agreed step."""
        launcher = start_launcher(tmp_path, "--step-seconds", "3", flags=("--nproc-per-node", "2"))
        wait_for_training(launcher, tmp_path)
        launcher.send_signal(signal.SIGINT)
        time.sleep(0.5)
        asked = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        code, output, ended = finish(launcher)
        assert code == 128 + signal.SIGINT, output
        assert "stopped at once by a second Ctrl-C; the workers were killed" in output
        assert ended - asked < 5, output
        assert all_gone(tmp_path) == []

    def test_workers_that_miss_the_grace_period_are_killed(self, tmp_path):
        """World size 2, steps of 3 s, --grace-period 1: the agreed step comes too late."""
        launcher = start_launcher(tmp_path, "--step-seconds", "3", flags=("--nproc-per-node", "2",
                                                                          "--grace-period", "1"))
        wait_for_training(launcher, tmp_path)
        launcher.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code, output, ended = finish(launcher)
        assert code == 128 + signal.SIGTERM, output
        assert "did not stop within --grace-period 1 s of the request (SIGTERM); they were killed" in output
        assert ended - asked < 6, output
        assert all_gone(tmp_path) == []
