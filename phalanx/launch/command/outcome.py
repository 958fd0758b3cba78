"""How a `phalanx run` ended: finished, stopped on request, killed, or failed; its exit code, the run summary's
word for it, and the lines that say so, printed after the summary, a failure's traceback last of all (the
failing rank's own, so the error a user reads first is at the bottom of the console).
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException

from ...diagnose import progress
from ...world.stop import STOP_EXIT_CODE
from ..agent import Agent
from ..diagnosis import STALL_EXIT_CODE, RunDiagnosis
from ..failures import describe_failure, failure_traceback, root_cause
from ..stop import GraceExpired, StoppedBeforeStart, StopRequest, stop_lost, stop_report


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


class Ended:
    """How a run ended: the exit code, the run summary's word for it, and the lines that say so (printed
    after the summary; a failure's traceback comes last of all)."""

    def __init__(self, code: int, outcome: str, lines=(), failures: dict | None = None, max_restarts: int = 0):
        self.code, self.outcome, self.lines = code, outcome, list(lines)
        self.failures, self.max_restarts = failures, max_restarts

    def report(self) -> None:
        for line in self.lines:
            _say(line)
        if self.failures:
            _report_failure(self.failures, self.max_restarts)


def conclude(agent: Agent, result, diagnosis: RunDiagnosis, stop: StopRequest, max_restarts: int) -> Ended:
    failed = result is not None and result.is_failed()
    failures = result.failures if failed else {}
    genuine = {rank: f for rank, f in failures.items() if f.exitcode != STOP_EXIT_CODE and f.exitcode > 0}
    if agent.ended_by_stop or (stop.active and failed and not genuine):
        others = {rank: f.exitcode for rank, f in failures.items() if f.exitcode != STOP_EXIT_CODE}
        code, lines = stop_report(stop, progress.read(diagnosis.directory), others)
        outcome = "stopped" if code == STOP_EXIT_CODE else "killed"
        agent.end_attempt(outcome)
        return Ended(code, outcome, lines)
    agent.end_attempt("failed" if failed else "finished")
    if not failed:
        return Ended(0, "finished")
    if diagnosis.stalled:
        return Ended(STALL_EXIT_CODE, "failed", ["the workers were stopped after the stall reported above."])
    diagnosis.on_failure(failures)
    rank, failure = root_cause(failures)
    return Ended(failure.exitcode if failure.exitcode > 0 else 1, "failed", failures=failures,
                 max_restarts=max_restarts)


def stopped_by_signal(agent: Agent | None, exc: SignalException, diagnosis: RunDiagnosis,
                      stop: StopRequest) -> Ended:
    """The run ended in the middle: a stop before any worker ran, the grace period over, a second Ctrl-C,
    or SIGHUP / SIGQUIT (torch's handler)."""
    if agent is not None:
        agent.end_attempt("killed")
    records = progress.read(diagnosis.directory)
    if isinstance(exc, StoppedBeforeStart):
        when = ("while the workers were being restarted after a failure" if agent is not None
                and agent.summary.now.attempts else "during the rendezvous, before any worker started")
        return Ended(STOP_EXIT_CODE, "stopped", [f"stopped on request ({exc.sigval.name}) {when}: nothing to save; "
                                                 f"run the same command to resume."])
    if isinstance(exc, GraceExpired) or stop.active:
        code, lines = stop_report(stop, records, {})
        if not isinstance(exc, GraceExpired) and code != STOP_EXIT_CODE:  # the second Ctrl-C
            code, lines = 128 + int(exc.sigval), [f"stopped at once by a second Ctrl-C; the workers were killed"
                                                  f"{stop_lost(records)}."]
        return Ended(code, "stopped" if code == STOP_EXIT_CODE else "killed", lines)
    return Ended(128 + int(exc.sigval), "killed", [f"stopped by {exc.sigval.name}; the workers were stopped too."])


def _report_failure(failures: dict, max_restarts: int) -> int:
    rank, failure = root_cause(failures)
    attempt = f" on the last attempt ({max_restarts + 1} of {max_restarts + 1})" if max_restarts else ""
    _say(f"{describe_failure(rank, failure)}{attempt}.")
    for other in sorted(r for r in failures if r != rank):
        _say(f"  then {describe_failure(other, failures[other])}")
    traceback_text = failure_traceback(failure)
    if traceback_text:
        _say(f"traceback of rank {rank}, the first to fail:")
        sys.stderr.write(traceback_text if traceback_text.endswith("\n") else traceback_text + "\n")
        sys.stderr.flush()
    return failure.exitcode if failure.exitcode > 0 else 1

