"""What `phalanx run` watches in its workers: stalls, the ranks that died, and stragglers.

Each attempt's workers record their collectives in rings under the run directory (PHALANX_RUN_DIR,
see diagnose/). The agent polls them between its health checks: when no rank progressed for the
stall timeout it gathers every rank's stack, prints one verdict, writes it as JSON into the log
directory, and then fails the group (restarted under --max-restarts), stops it, or leaves it alive
for a debugger (--on-stall). A failed group gets the dead rank's last record next to its exit signal.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

from ..diagnose import straggler
from ..diagnose.record import H_STEP, read_header, read_rings, ring_path
from ..diagnose.verdict import Verdict, judge
from ..diagnose.watch import StallWatch, collect
from .failures import signal_name

POLL_SECONDS = 0.5  # between reads of the rings' headers (a few hundred bytes per rank)
STALL_EXIT_CODE = 86


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


def how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal_name(exitcode)}"
    return f"exited with code {exitcode}"


class RunDiagnosis:
    """The launcher's view of one node's workers through their rings (see the module docstring)."""

    def __init__(self, root: str, timeout: float, on_stall: str, report_dir: str | None, straggler_every: int):
        self.root, self.timeout, self.on_stall = root, timeout, on_stall
        self.report_dir = report_dir
        self.straggler_every = straggler_every
        self.directory = root
        self.pids: dict[int, int] = {}
        self.watch: StallWatch | None = None
        self.stalled = False  # the last attempt ended in a stall
        self._next_poll = 0.0
        self._next_summary = straggler_every
        self._summary_seq = 0

    def attempt_started(self, attempt: int, pids: dict[int, int]) -> None:
        """A (re)started group: global rank -> pid of this node's workers."""
        self.directory = os.path.join(self.root, f"attempt-{attempt}")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self.pids = dict(pids)
        self.watch = StallWatch(self.directory, self.timeout, sorted(pids), pids=pids)
        self.stalled = False
        self._next_summary, self._summary_seq = self.straggler_every, 0

    def poll(self) -> bool:
        """Between health checks; True when the group stalled and must be failed (not with --on-stall wait)."""
        now = time.monotonic()
        if self.watch is None or now < self._next_poll:
            return False
        self._next_poll = now + POLL_SECONDS
        if self.watch.poll(now):
            self._report_stall()
            if self.on_stall != "wait":
                self.stalled = True
                return True
            _say("--on-stall wait: the workers are left running; attach a debugger (e.g. py-spy dump --pid P), "
                 "or stop the run with Ctrl-C.")
            return False
        if self.straggler_every:
            self._maybe_summarize()
        return False

    def _report_stall(self) -> None:
        _say(f"STALL: no rank made progress for {self.watch.silent_for():.0f}s (--stall-timeout {self.timeout:g}); "
             f"asking every rank for its stack.")
        verdict = collect(self.directory, sorted(self.pids), pids=self.pids)
        self._publish(verdict, "stall-report.json")

    def on_failure(self, failures: dict) -> None:
        """After a failed attempt: the dead rank's last record, or the desync that made ranks fail."""
        dead = {rank: how_it_ended(f.exitcode) for rank, f in failures.items()
                if f.exitcode < 0 and -f.exitcode != signal.SIGTERM}
        rings = read_rings(self.directory)
        if not rings:
            return
        verdict = judge(rings, sorted(self.pids), {}, time.monotonic_ns(), dead=dead or None, pids=self.pids)
        if verdict.kind in ("dead", "desync"):
            self._publish(verdict, "failure-report.json", with_stacks=False)

    def _publish(self, verdict: Verdict, name: str, with_stacks: bool = True) -> None:
        sys.stderr.write(verdict.text(with_stacks))
        try:
            if self.report_dir is None:  # no --log-dir: a folder of its own that outlives the run
                self.report_dir = tempfile.mkdtemp(prefix="phalanx-report-")
            path = os.path.join(self.report_dir, name)
            os.makedirs(self.report_dir, exist_ok=True)
            verdict.write(path)
            _say(f"report written to {path}")
        except OSError as exc:
            _say(f"could not write the {name}: {exc}")
        sys.stderr.flush()

    def _maybe_summarize(self) -> None:
        heads = [read_header(ring_path(self.directory, rank)) for rank in self.pids]
        if any(h is None for h in heads) or min(h[H_STEP] for h in heads) < self._next_summary:
            return
        self._next_summary += self.straggler_every
        rings = read_rings(self.directory)
        skews = straggler.skew(rings, since_seq=self._summary_seq)
        self._summary_seq = min((s.last.seq for s in rings.values() if s.last), default=0)
        slow = straggler.straggler(skews)
        if slow is not None:
            _say(f"straggler: {straggler.summary(slow)}")

