"""Fault injection under `phalanx run`: the report names the stuck rank, its phase and the collective.

Multi-process tests, world size 2 on one node (3 for the rendezvous case). Each case starts
tests/e2e/jobs/fault_job.py with one fault on rank 1 and a stall timeout of STALL seconds, then
reads the printed verdict and the JSON report, and checks that the report came within STALL + 10 s
of the fault (the job prints when the fault starts; the report file's time is when it was written).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e.test_launch import clean_env

# tests/suite.py: the time goes to stall timeouts; each report must come within a bound
pytestmark = pytest.mark.waiting

JOB = str(Path(__file__).resolve().parent / "jobs" / "fault_job.py")
STALL = 3  # seconds: --stall-timeout of these runs
STALL_EXIT_CODE = 86
HANG_GUARD = 120


def run_fault(tmp_path, fault: str, *, nproc: int = 2, env: dict | None = None, extra=()) -> tuple:
    """(completed process, report JSON or None, seconds from the fault to the report)."""
    logs = tmp_path / "logs"
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", str(nproc), "--stall-timeout", str(STALL),
         "--log-dir", str(logs), *extra, JOB, "--fault", fault],
        env=clean_env(OMP_NUM_THREADS="1", **(env or {})), cwd=ROOT, capture_output=True, text=True,
        timeout=HANG_GUARD)
    reports = [p for p in (logs / "stall-report.json", logs / "failure-report.json") if p.exists()]
    report = json.loads(reports[0].read_text()) if reports else None
    fault = re.search(r"FAULT \S+ at ([\d.]+)", result.stdout)
    delay = reports[0].stat().st_mtime - float(fault.group(1)) if reports and fault else None
    return result, report, delay


def verdict_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("verdict: ")]
    assert lines, stderr
    return lines[0]


class TestStall:
    """World size 2: one rank stops making progress; the launcher reports within the stall timeout + 10 s."""

    def test_a_rank_sleeping_in_its_data_loading_is_named_with_its_line(self, tmp_path):
        """World size 2: rank 1 sleeps in its dataset's __getitem__ at step 5."""
        result, report, delay = run_fault(tmp_path, "data-sleep")
        assert result.returncode == STALL_EXIT_CODE, result.stderr
        line = verdict_line(result.stderr)
        assert re.search(r"rank 1 never entered collective #\d+ gradient exchange of bucket \d", line), line
        assert "phase data (before step 5) at tests/e2e/jobs/fault_job.py:" in line and "in __getitem__" in line
        assert "rank(s) 0 wait for it" in line
        assert report["kind"] == "stall"
        assert report["culprits"][0]["rank"] == 1 and report["culprits"][0]["phase"] == "data"
        assert report["collective"]["kind"] == "bucket" and report["waiting"][0]["rank"] == 0
        assert report["waiting"][0]["seq"] == report["collective"]["seq"]
        assert "--- main thread of rank 1" in result.stderr and "in __getitem__" in report["ranks"]["1"]["stack"]
        assert delay is not None and delay < STALL + 10, delay

    def test_a_rank_spinning_in_c_holding_the_gil_still_gives_its_stack(self, tmp_path):
        """World size 2: rank 1 runs a regular expression that backtracks (C code, GIL held) at step 5."""
        result, report, delay = run_fault(tmp_path, "gil-spin")
        assert result.returncode == STALL_EXIT_CODE, result.stderr
        line = verdict_line(result.stderr)
        assert "rank 1 never entered collective" in line and "fault_job.py:" in line, line
        assert report["culprits"][0]["rank"] == 1
        stack = report["ranks"]["1"]["stack"]
        assert "in match" in stack and "fault_job.py" in stack, stack  # faulthandler answered from C
        assert delay is not None and delay < STALL + 10, delay

    def test_a_rank_that_never_reaches_init_is_named(self, tmp_path):
        """World size 3: rank 1 sleeps before phalanx.init(); ranks 0 and 2 wait at the rendezvous."""
        result, report, delay = run_fault(tmp_path, "no-init", nproc=3)
        assert result.returncode == STALL_EXIT_CODE, result.stderr
        line = verdict_line(result.stderr)
        assert "rank 1 never reached phalanx.init() at tests/e2e/jobs/fault_job.py:" in line, line
        assert report["culprits"][0] == {"rank": 1, "phase": "startup", "why": "never reached phalanx.init()",
                                         "location": report["culprits"][0]["location"]}
        assert {w["rank"] for w in report["waiting"]} == {0, 2}
        assert report["collective"]["kind"] == "rendezvous"
        assert delay is not None and delay < STALL + 10, delay


class TestDesync:
    """World size 2: ranks issue different collectives under the same number."""

    def test_a_skipped_backward_is_a_desync_naming_the_rank_that_skipped(self, tmp_path):
        """World size 2: rank 1 skips loss.backward() at step 5; its next exchange pairs with rank 0's step 5."""
        result, report, delay = run_fault(tmp_path, "skip-backward")
        assert result.returncode != 0
        line = verdict_line(result.stderr)
        assert re.search(r"desync at collective #\d+: rank\(s\) 1 issued it from a later step", line), line
        assert report["kind"] == "desync" and report["desync"]["odd"] == [1]
        entries = report["desync"]["entries"]
        assert (entries["0"]["step"], entries["1"]["step"]) == (5, 6)
        assert entries["0"]["kind"] == entries["1"]["kind"] == "bucket"
        assert delay is not None and delay < STALL + 10, delay

    def test_a_bucket_of_another_size_is_a_desync_with_both_call_sites(self, tmp_path):
        """World size 2, Gloo: rank 1 wraps the model with another bucket_cap_mb, so its buckets differ."""
        result, report, delay = run_fault(tmp_path, "bucket-size", env={"PHALANX_SHM": "0"})
        assert result.returncode != 0
        line = verdict_line(result.stderr)
        assert re.search(r"desync at collective #\d+: rank\(s\) 1 issued a different collective", line), line
        entries = report["desync"]["entries"]
        assert entries["0"]["numel"] != entries["1"]["numel"]
        for rank in (0, 1):  # both call sites, in the user's code
            assert entries[str(rank)]["site"].startswith("tests/e2e/jobs/fault_job.py:")
            assert f"rank {rank} issued #{report['desync']['seq']} gradient exchange" in result.stderr
        assert delay is not None and delay < STALL + 10, delay


class TestDeadRank:
    """World size 2: rank 1 is SIGKILLed while its first bucket is being exchanged."""

    @pytest.mark.parametrize("transport", ["gloo", "shm"])
    def test_the_report_names_the_dead_rank_its_signal_and_its_last_record(self, tmp_path, transport):
        """World size 2, over Gloo and over shared memory."""
        result, report, delay = run_fault(tmp_path, "sigkill", env={"PHALANX_SHM": "0" if transport == "gloo" else "1"})
        assert result.returncode != 0
        line = verdict_line(result.stderr)
        assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL; its last record: #\d+ gradient exchange of "
                         r"bucket \d .* (started|enqueued), issued at tests/e2e/jobs/fault_job.py:\d+ in main, in "
                         r"phase backward of step 5", line), line
        assert report["kind"] == "dead" and report["culprits"][0]["rank"] == 1
        assert report["culprits"][0]["last"]["kind"] == "bucket"
        assert delay is not None and delay < 10, delay


class TestStraggler:
    """World size 2: rank 1's backward starts 20 ms late at every step."""

    def test_the_late_rank_is_named_with_its_skew_while_backward_times_look_equal(self, tmp_path):
        """World size 2: straggler_report() and the launcher's summary line name rank 1, 20 ms +- 30 %."""
        logs = tmp_path / "logs"
        result = subprocess.run(
            [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", "--straggler-every", "20",
             "--log-dir", str(logs), JOB, "--fault", "slow-backward", "--steps", "60"],
            env=clean_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD)
        assert result.returncode == 0, result.stderr
        report = json.loads(re.search(r"STRAGGLER (.*)", result.stdout).group(1))
        late = report["1"]
        assert 14.0 <= late["late_ms"] <= 26.0, report
        assert late["last_fraction"] >= 0.9 and report["0"]["late_ms"] < 2.0, report
        summary = re.search(r"phalanx run: straggler: rank 1 arrives ([\d.]+) ms late at (\d+)%", result.stderr)
        assert summary and 14.0 <= float(summary.group(1)) <= 26.0, result.stderr
        # The control: the all-reduce equalizes backward wall time, so the naive timing shows no straggler.
        backward = {int(r): float(ms) for r, ms in re.findall(r"BACKWARD rank=(\d) median_ms=([\d.]+)", result.stdout)}
        assert abs(backward[0] - backward[1]) < 0.3 * 20.0, backward


class TestWatchdogUnderTorchrun:
    """World size 2 under torchrun: the workers' own watchdog reports (no phalanx launcher)."""

    @pytest.mark.waiting(seconds=20)
    def test_the_watchdog_names_the_stuck_rank_and_the_group_exits(self, tmp_path):
        """World size 2: rank 1 sleeps in its data loading; rank 0's watchdog prints the verdict."""
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", JOB, "--fault", "data-sleep"],
            env=clean_env(OMP_NUM_THREADS="1", PHALANX_STALL_TIMEOUT=str(STALL), PHALANX_LOG_DIR=str(tmp_path)),
            cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD)
        assert result.returncode != 0
        line = verdict_line(result.stderr)
        assert "rank 1 never entered collective" in line and "in __getitem__" in line, line
        report = json.loads((tmp_path / "stall-report.json").read_text())
        assert report["culprits"][0]["rank"] == 1 and report["culprits"][0]["phase"] == "data"
        assert "exitcode  : 86" in result.stderr
