"""torch's local elastic agent as `phalanx run` drives it: failures named, stalls watched, stops asked for.

On top of LocalElasticAgent: say which rank failed before a restart; sweep the process groups of
workers that died; watch the workers' rings for stalls and stragglers (diagnosis.py); pass a stop
request on to the workers and wait for them to save (stop.py) instead of letting torch's handler kill
them; never restart a group that was asked to stop; under `--nnodes MIN:MAX`, regroup when a node is lost
or joins, without counting it as a failure (regroup.py); and tell the run summary (goodput.py) when each
attempt starts and ends; on a terminal, keep the live status line (live_status.py) up to date.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException

from ..diagnose import progress
from ..diagnose.recorder import pid_alive
from ..errors import RendezvousTimeoutError, RunEndedError, StoreLostError, explain
from ..world.meeting.membership import KEEP_ALIVE_INTERVAL, KEEP_ALIVE_MISSES
from ..world.stop import STOP_EXIT_CODE
from .diagnosis import RunDiagnosis
from .failures import describe_failure, root_cause, sweep_process_groups
from .forkserver.elastic_handler import workers_from
from .forkserver.server import WorkerServer
from .goodput import RunSummary
from .live_status import LiveStatus
from .regroup import KeptSurvivors, Regroup
from .stop import StopRequest

# LocalElasticAgent._shutdown takes a `timeout` in torch 2.13 and not in 2.11 (whose agent closes its
# workers with a default of 30 s): the installed torch is asked once, so that both work.
_SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


def _stop_tailers(pcontext) -> None:
    tails = getattr(pcontext, "_tail_logs", None)  # torch 2.13; older ones keep one per stream
    if tails is None:
        tails = [getattr(pcontext, name, None) for name in ("_stdout_tail", "_stderr_tail")]
    for tail in tails:
        if tail is not None and not tail.stopped():
            tail.stop()


class Agent(LocalElasticAgent):
    """See the module docstring. `ended_by_stop`: the last attempt's workers stopped on request."""

    def __init__(self, *args, diagnosis: RunDiagnosis, stop: StopRequest, summary: RunSummary,
                 regroup: Regroup | None = None, live: LiveStatus | None = None,
                 server: WorkerServer | None = None, survivors: KeptSurvivors | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.server = server  # the node's fork server (forkserver/), or None: each worker a fresh interpreter
        self.live = live  # the status line on a terminal (live_status.py), or None
        self.group_pids: set[int] = set()
        self.diagnosis, self.stop, self.summary, self.regroup = diagnosis, stop, summary, regroup
        self.survivors = survivors  # --min-world-size: ranks lost while the others go on (regroup.py)
        self.ended_by_stop = False
        self._attempt_failed = False
        self._starts = 0  # worker groups started: restarts after failures, and regroupings
        self._contexts: list = []  # every group's torch process context, closed or not (stop_log_tailers)

    def _rendezvous(self, worker_group) -> None:
        try:
            super()._rendezvous(worker_group)
        except DistError as exc:  # torch's wait for the other nodes' ranks (a C++ message)
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise RendezvousTimeoutError(explain(
                "the nodes met but did not all register their workers", seen=first_line,
                expected="every node's `phalanx run` registering within --rdzv-timeout",
                fix="A node was lost in the middle of the rendezvous, or its launcher is stuck: run the same "
                    "command on the nodes again (training resumes from the newest checkpoint).")) from None

    def _exit_barrier(self):
        """torch's wait for every node's launcher at the end; with live recovery (--min-world-size), for the nodes
        not lost only: a node killed whole never comes, and the others may finish before its heartbeats expire."""
        if self.survivors is None:
            return super()._exit_barrier()
        self._in_exit_barrier = True
        try:
            self._meet_the_nodes_left()
        except SignalException:
            raise
        except Exception as exc:  # as torch's: the run's outcome is the workers', not this wait's
            _say(f"the launchers of the nodes left did not all meet at the end ({exc}).")
        finally:
            self._in_exit_barrier = False

    def _meet_the_nodes_left(self) -> None:
        """Two rounds in the store: every launcher left arrives, then every one says it saw the others arrive.
        Nodes see a loss at different moments (each by its own heartbeat reads), so one may still be waiting
        for the lost node after another is done: the second round keeps the store's node (the master's) up
        until the last launcher has read what it waits for."""
        records = self._records()  # the workers are done: their regroups are all recorded
        self.survivors.tell_the_regroups(records)
        # A fixed --nnodes N has no heartbeats: the workers' last regroup says which nodes were left behind.
        left_behind = records if self.regroup is None else None
        self._wait_for_the_nodes_left("arrived", self._exit_barrier_timeout, left_behind)
        try:  # the others are here: at most a heartbeat window more for the last of them to see the loss too
            self._wait_for_the_nodes_left("departed", KEEP_ALIVE_INTERVAL * (KEEP_ALIVE_MISSES + 2), left_behind)
        except Exception:  # the store's node may leave once the others have all departed: nothing left to wait for
            pass

    def _wait_for_the_nodes_left(self, what: str, seconds: float, records: dict | None) -> None:
        nodes, key = self._worker_group.group_world_size, f"phalanx/exit-barrier/{what}"
        deadline = time.monotonic() + seconds
        count = self._store.add(key, 1)
        while count < (expected := self.survivors.exit_barrier_size(nodes, records)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} of {expected} launchers {what} after {seconds:g} s")
            time.sleep(0.1)
            if self.regroup is not None:  # a node killed whole: lost once its heartbeats expire
                for node in self.regroup.rendezvous.lost():
                    self.survivors.node_lost(node, self.regroup.world, None)
            count = self._store.add(key, 0)

    def _start_workers(self, worker_group):
        attempt = self._starts
        self._starts += 1
        os.environ["PHALANX_ATTEMPT"] = str(attempt)  # the workers' folder for their records (diagnose/)
        if self.regroup is not None:
            self.regroup.starting(worker_group)
        self.stop.starting = True
        try:
            with workers_from(self.server):
                pids = super()._start_workers(worker_group)
        except BaseException:
            self.stop.starting = False
            raise
        self.stop.install()  # torch's start may have put its own handlers (they kill) back in place
        self._mark_teardown_before_close()
        self.group_pids = set(pids.values())
        if self.survivors is not None:
            self.survivors.new_attempt()
            self.survivors.local_world_size = worker_group.spec.local_world_size
        self.diagnosis.attempt_started(attempt, {worker_group.workers[local].global_rank: pid
                                                 for local, pid in pids.items()})
        self.summary.attempt_started()
        self._attempt_failed = False
        # Elastic: the look for other nodes' stop requests fails within seconds when the store's host is cut off.
        store = self.regroup.rendezvous.quick_store() if self.regroup is not None else worker_group.store
        self.stop.workers_started(pids.values(), store, worker_group.group_rank)
        return pids

    def _mark_teardown_before_close(self) -> None:
        """Whenever torch terminates the group (a worker failed, a restart, the end), the workers are told
        first that this SIGTERM is a teardown: one that listens for stop requests would otherwise wait."""
        pcontext = self._pcontext
        self._contexts.append(pcontext)
        close = pcontext.close

        def close_after_marking(death_sig=None, timeout: int = 30):
            try:
                progress.mark_teardown(self.diagnosis.directory)
                return close(death_sig, timeout)
            finally:  # a stop request raised inside torch's close would skip its own stop of the tailers
                _stop_tailers(pcontext)

        pcontext.close = close_after_marking

    def stop_log_tailers(self) -> None:
        """The launcher's last act: no group's log tailer may outlive it. Each is a thread that reads a
        worker's log until told to stop; one left running holds the launcher at exit forever."""
        for pcontext in self._contexts:
            _stop_tailers(pcontext)

    def _stop_workers(self, worker_group, *args, **kwargs):
        self.end_attempt("failed" if self._attempt_failed else "stopped" if self.ended_by_stop else "finished")
        self.stop.workers_stopped()
        super()._stop_workers(worker_group, *args, **kwargs)
        # torch signals only the workers still running; children of a worker that already died
        # (its DataLoader workers, say) live on in that worker's process group.
        sweep_process_groups(self.group_pids)
        self.group_pids = set()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self.stop.workers_stopped()
        if self.stop.kill_now:  # the grace period is over, or a second Ctrl-C: no more waiting
            death_sig = signal.SIGKILL
        if _SHUTDOWN_TAKES_TIMEOUT:
            super()._shutdown(death_sig, timeout)
        else:
            super()._shutdown(death_sig)

    def end_attempt(self, outcome: str) -> None:
        """The attempt's workers are done: its time goes into the run summary (once per attempt)."""
        records = progress.read(self.diagnosis.directory)
        if self.survivors is not None:  # the ranks that went on tell the attempt's steps, not one lost on the way
            records = {rank: r for rank, r in records.items() if rank not in self.survivors.lost} or records
        self.summary.attempt_ended(records, outcome)

    def _records(self) -> dict:
        return progress.read(self.diagnosis.directory)

    def _regroup_now(self, why: str) -> RunResult:
        """A node was lost, or the workers saved for one that joins: torch restarts the group (a new
        rendezvous), and the restart it takes off --max-restarts is given back."""
        self._remaining_restarts += 1
        self._attempt_failed = why == "lost"  # the steps after the last save are redone
        if why == "lost":  # a worker blocked in a collective with the lost node would not see a SIGTERM
            sweep_process_groups(self.group_pids)
        return RunResult(state=WorkerState.FAILED)

    def _take_in(self, worker_group) -> RunResult:
        """Node(s) join the workers in progress (world/joining.py): meet them in a new round as torch's agent would,
        its collective assignment of ranks included, but keep this node's workers and their ranks: they take the
        joiners in at their next step boundary."""
        try:
            info = worker_group.spec.rdzv_handler.next_rendezvous()
        except RunEndedError:  # another node's workers finished the run as the join was decided: so do this one's
            _say("the run ended before the node(s) waiting could be taken in: this node's workers finish too.")
            self.regroup.run_ended = True
            return RunResult(state=WorkerState.HEALTHY)
        self._assign_worker_ranks(info.store, info.rank, info.world_size, worker_group.spec)  # the round's collective
        worker_group.store = self._store = info.store
        worker_group.group_rank, worker_group.group_world_size = info.rank, info.world_size
        self.stop.moved(self.regroup.rendezvous.quick_store(), info.rank)
        self.regroup.taken_in(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    def _monitor_workers(self, worker_group):
        try:
            return self._monitor(worker_group)
        except StoreLostError:
            self.stop.kill_now = True  # the workers may be blocked in a collective with the lost node: no grace
            raise

    def _monitor(self, worker_group):
        if self.regroup is not None:
            self.regroup.check_store()  # before the stop's look into the store, which could block on a lost host
        self.stop.tick()  # passes a request on; raises GraceExpired when the grace period is over
        if self.live is not None:
            self.live.update(self.diagnosis.directory)
        if self.survivors is not None and not self.stop.active:
            verdict = self.survivors.monitor(self._pcontext, worker_group, self._records())
            if verdict is not None:
                return verdict
        elastic = self.regroup is not None and not self.stop.active
        if elastic:
            verdict = self.regroup.poll(self.group_pids, self._records)
            if verdict == "join":
                return self._take_in(worker_group)
            if verdict is not None:
                return self._regroup_now(verdict)
            if self.regroup.growing_since is not None:
                return RunResult(state=WorkerState.HEALTHY)  # the workers are saving at the agreed step
        if self._some_stopped_others_running():
            return RunResult(state=WorkerState.HEALTHY)
        result = super()._monitor_workers(worker_group)
        if elastic and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self.regroup.failed():
            return self._regroup_now("lost")
        spec = worker_group.spec
        attempt = spec.max_restarts - self._remaining_restarts + 1
        if result.state == WorkerState.FAILED and self._stopped_on_request(result.failures):
            self.stop.adopt()
            self._remaining_restarts = 0  # a stopped run ends here: its next start is the user's
            self.ended_by_stop = True
            return result
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._attempt_failed = True
            if self.stop.active:
                self._remaining_restarts = 0  # stopping: a failure on the way out ends the run, no restart
        if result.state == WorkerState.HEALTHY and self.diagnosis.poll():
            result = RunResult(state=WorkerState.FAILED)  # no worker failed: the group stalled
            self._attempt_failed = True
            if self._remaining_restarts > 0:
                _say(f"the stall ends attempt {attempt} of {spec.max_restarts + 1}; restarting the worker group "
                     f"(attempt {attempt + 1} of {spec.max_restarts + 1}).")
        elif result.state == WorkerState.FAILED and self._remaining_restarts > 0:
            rank, failure = root_cause(result.failures)
            _say(f"{describe_failure(rank, failure)} on attempt {attempt} of {spec.max_restarts + 1}; "
                 f"restarting the worker group (attempt {attempt + 1} of {spec.max_restarts + 1}).")
            self.diagnosis.on_failure(result.failures)
        return result

    def _some_stopped_others_running(self) -> bool:
        """Some workers left after the agreed save while others are still on their way out: wait for them,
        so that torch does not take the first exit code 75 for a failure and terminate the rest."""
        alive = [pid for pid in self.group_pids if pid_alive(pid)]
        if not alive or len(alive) == len(self.group_pids):
            return False
        records = progress.read(self.diagnosis.directory)
        if not any(r.stop_step >= 0 for r in records.values()):
            return False
        self.stop.adopt()  # the grace period bounds this wait
        return True

    def _stopped_on_request(self, failures: dict) -> bool:
        """Every worker that ended saved at the agreed step (its record says so; or it exited with 75 while
        this launcher was stopping: a script's own exit code 75 alone is not a stop)."""
        records = progress.read(self.diagnosis.directory)
        return bool(failures) and all(
            (rank in records and records[rank].stop_step >= 0) or (f.exitcode == STOP_EXIT_CODE and self.stop.active)
            for rank, f in failures.items())
