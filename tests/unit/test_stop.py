"""Stop requests in one process: the worker's signal handling, Checkpointer.step() in a world of one, the
progress record the launcher reads, the launcher's report of a stop, and the run summary (goodput)."""

import json
import signal
import time

import pytest
import torch

import phalanx as px
from phalanx.checkpoint.agreement import next_every
from phalanx.diagnose import progress
from phalanx.diagnose.progress import Progress
from phalanx.launch import goodput
from phalanx.launch.stop import StopRequest, stop_report
from phalanx.world import stop


@pytest.fixture
def fresh_stop():
    """The stop module as a new process has it, and the signal handlers as they were, afterwards."""
    handlers = {signum: signal.getsignal(signum) for signum in stop.SIGNALS}
    saved = {name: getattr(stop, name) for name in ("_owner", "_previous", "_listening", "_teardown")}
    stop._owner, stop._previous, stop._listening, stop._teardown = 0, {}, False, None
    stop.reset()
    yield stop
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for name, value in saved.items():
        setattr(stop, name, value)
    stop.reset()


@pytest.fixture
def record(tmp_path):
    progress.start(str(tmp_path), 0)
    yield tmp_path
    progress._record = None


class TestWorkerSignals:
    def test_not_listening_the_signal_does_what_it_did_before(self, fresh_stop):
        seen = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
        fresh_stop.install()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and fresh_stop.requested() is None

    def test_listening_the_signal_only_sets_the_flag(self, fresh_stop):
        seen = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
        fresh_stop.install()
        assert not px.stop_requested()  # asking is listening
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [] and fresh_stop.requested() == "SIGUSR1" and px.stop_requested()

    def test_a_second_ctrl_c_interrupts(self, fresh_stop):
        fresh_stop.install()
        fresh_stop.listen()
        signal.raise_signal(signal.SIGINT)
        assert fresh_stop.requested() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)

    def test_a_teardown_by_the_launcher_is_not_a_request(self, fresh_stop):
        seen = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
        fresh_stop.install(teardown=lambda: True)
        fresh_stop.listen()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and fresh_stop.requested() is None

    def test_requests_travel_as_signal_numbers(self):
        assert stop.code_of(None) == 0 and stop.code_of("SIGTERM") == signal.SIGTERM and stop.code_of("x") == 1
        assert stop.reason_of(int(signal.SIGUSR1)) == "SIGUSR1" and stop.reason_of(1) == "requested"

    def test_agreements_come_about_an_interval_apart(self):
        assert next_every(0.013, 0.5) == 38 and next_every(2.0, 0.5) == 1 and next_every(0.013, 0.0) == 1


def _train(model, optimizer, steps):
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


class TestCheckpointerStep:
    """A world of one: step() saves every N steps, continues its count after a restore, and ends the process
    after saving when a stop is requested."""

    def test_every_must_be_a_positive_number_of_steps(self, tmp_path):
        with pytest.raises(ValueError, match="every must be a positive number of steps"):
            px.Checkpointer(tmp_path, every=0)

    def test_saves_every_n_steps_and_the_last(self, tmp_path, fresh_stop):
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        checkpointer = px.Checkpointer(tmp_path, keep=10, every=3)
        saved = []
        for step in range(1, 8):
            _train(model, optimizer, 1)
            if checkpointer.step({"model": model}, last=step == 7) is not None:
                saved.append(step)
        assert saved == [3, 6, 7]
        again = px.Checkpointer(tmp_path, every=3)
        assert again.restore({"model": model}) and again.steps == 7

    def test_a_stop_request_saves_then_ends_the_process_with_75(self, tmp_path, fresh_stop, record):
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        checkpointer = px.Checkpointer(tmp_path / "ckpt", every=100)
        for _ in range(4):
            _train(model, optimizer, 1)
            state["step"] += 1
            checkpointer.step(state)
        fresh_stop.request("SIGTERM")
        _train(model, optimizer, 1)
        state["step"] += 1
        with pytest.raises(px.RunStopped) as stopped:
            checkpointer.step(state)
        assert stopped.value.code == px.STOP_EXIT_CODE == 75 and stopped.value.step == 5
        assert "stopped at step 5 on request (SIGTERM)" in str(stopped.value)
        (mine,) = progress.read(str(record)).values()
        assert (mine.stop_step, mine.saved_step, mine.step, mine.state) == (5, 5, 5, "stopped")
        assert mine.last("stopped")["reason"] == "SIGTERM"
        state["step"] = 0
        assert px.Checkpointer(tmp_path / "ckpt").restore(state) and state["step"] == 5


class TestProgressRecord:
    def test_what_the_launcher_reads(self, record):
        progress.ready()
        progress.checkpointer(str(record / "ckpt"))
        progress.restored(10, "ckpt-1.pt", time.monotonic() - 0.5, time.monotonic())
        for count in (11, 12, 13):
            progress.step(count)
        before = progress.saving()
        progress.saved(13, "ckpt-2.pt", time.monotonic() - 0.25, time.monotonic(), before)
        progress.step(14)
        (mine,) = progress.read(str(record)).values()
        assert (mine.first_step, mine.step, mine.saved_step, mine.steps_unsaved, mine.saves) == (10, 14, 13, 1, 1)
        assert mine.restore_seconds == pytest.approx(0.5, abs=0.05) and mine.state == "training"
        assert [e["event"] for e in mine.events] == ["checkpointer", "restored", "saved"]
        assert not progress.teardown_requested()
        progress.mark_teardown(str(record))
        assert progress.teardown_requested()


def _progress(**fields) -> Progress:
    values = dict(rank=0, pid=1, state="exited", created=0.0, ready=1.0, loop_start=2.0, last_step_at=0.0, step=0,
                  first_step=0, loop_seconds=0.0, saved_step=-1, loop_at_save=0.0, save_seconds=0.0, saves=0,
                  restore_seconds=0.0, restores=0, stop_step=-1, exited_at=0.0, listening=True)
    values.update(fields)
    return Progress(**values)


class TestStopReport:
    def _stop(self):
        request = StopRequest(30.0, 0)
        request.signal, request.since = signal.SIGTERM, time.monotonic()
        return request

    def test_every_worker_saved(self):
        records = {r: _progress(rank=r, step=290, stop_step=290, saved_step=290, events=[
            {"event": "stopped", "path": "runs/ckpt-7.pt", "seconds": 0.4, "reason": "SIGTERM"}]) for r in (0, 1)}
        code, (line,) = stop_report(self._stop(), records, {})
        assert code == 75
        assert line.startswith("stopped at step 290 on request (SIGTERM)") and "runs/ckpt-7.pt saved in 0.4 s" in line

    def test_workers_still_starting_lose_nothing(self):
        code, (line,) = stop_report(self._stop(), {0: _progress(ready=0.0, loop_start=0.0)}, {0: -15})
        assert code == 75 and "while the workers were starting" in line

    def test_a_loop_without_step_loses_its_unsaved_steps(self):
        records = {0: _progress(step=290, saved_step=200, first_step=0)}
        code, (line,) = stop_report(self._stop(), records, {0: -15})
        assert code == 128 + signal.SIGTERM
        assert "the newest checkpoint is at step 200: the 90 step(s) after it are lost" in line
        assert "checkpointer.step(state)" in line

    def test_the_grace_period_over(self):
        request = self._stop()
        request.kill_now = True
        code, (line,) = stop_report(request, {0: _progress(step=12, saved_step=9)}, {})
        assert code == 143 and "did not stop within --grace-period 30 s" in line and "3 step(s)" in line


class TestRunSummary:
    def test_an_attempt_is_cut_into_what_counted_and_what_was_lost(self, tmp_path):
        summary = goodput.RunSummary(None, writes_job_file=False)
        summary.attempt_started()
        # As if the launcher had started 10 s ago and its workers 9 s ago:
        summary.attempt_began = began = time.monotonic() - 9.0
        summary.now.times.startup = 1.0
        record = _progress(ready=began + 1, loop_start=began + 3, restore_seconds=1.0, loop_seconds=4.0,
                           loop_at_save=3.0, save_seconds=0.5, saves=2, step=40, first_step=10, saved_step=30)
        summary.attempt_ended({0: record}, "failed")
        times = summary.now.times
        assert times.startup == pytest.approx(1.0 + 2.0, abs=0.05)  # the launcher's second, then 3 - 1 s restore
        assert (times.restore, times.save, times.counted, times.redone) == (1.0, 0.5, 3.0, 1.0)
        assert times.restart == pytest.approx(9.0 - 2.0 - 1.0 - 0.5 - 4.0, abs=0.05)
        assert summary.now.steps_redone == 10 and summary.now.last_step == 30

    def test_the_whole_job_adds_up_across_runs(self, tmp_path, capsys):
        for outcome in ("stopped", "finished"):
            summary = goodput.RunSummary(str(tmp_path / "logs"), writes_job_file=True)
            summary.attempt_started()
            record = _progress(ready=time.monotonic(), loop_start=time.monotonic(), loop_seconds=0.01,
                               events=[{"event": "checkpointer", "directory": str(tmp_path)}])
            summary.attempt_ended({0: record}, outcome)
            summary.finish(outcome)
        job = json.loads((tmp_path / "run-summary.json").read_text())
        assert [i["outcome"] for i in job["invocations"]] == ["stopped", "finished"]
        assert job["total"]["invocations"] == 2 and 0 < job["total"]["goodput"] <= 1
        assert (tmp_path / "logs" / "run-summary.json").exists()
        assert "the whole job, 2 runs" in capsys.readouterr().err


def test_the_run_summary_lists_each_node_lost_or_joined():
    """An elastic run's summary: one line per membership change, with the world sizes, the step and the time."""
    from phalanx.launch.goodput import Invocation, summary_lines

    now = Invocation(outcome="finished", attempts=3, first_step=0, last_step=36, changes=[
        {"change": "node 1 (10.0.0.2) left", "world": [2, 1], "step": 6, "seconds": 5.04},
        {"change": "node 1 (10.0.0.2) joined", "world": [1, 2], "step": 16, "seconds": None}])
    lines = summary_lines(now, [{}], None)
    assert "  node 1 (10.0.0.2) left: world size 2 -> 1, resumed from step 6, 5.0 s to the first step there" in lines
    assert "  node 1 (10.0.0.2) joined: world size 1 -> 2, resumed from step 16" in lines


def test_the_run_summary_splits_checkpoint_time_into_blocking_and_background():
    """Background saves: what the saves held the training (and waited for the previous write), and what the
    writers spent beside it, which is not part of the wall time's split."""
    summary = goodput.RunSummary(None, writes_job_file=False)
    summary.attempt_started()
    record = _progress(ready=time.monotonic(), loop_start=time.monotonic(), loop_seconds=8.0, save_seconds=0.6,
                       saves=4, step=80, save_waited=0.25, save_background=7.9)
    summary.attempt_ended({0: record}, "finished")
    assert summary.now.times.save == 0.6 and summary.now.save_background == 7.9
    lines = goodput.summary_lines(summary.now, [{}], None)
    assert ("  checkpoints: 4 save(s) held the training 0.6 s (of which 0.2 s waiting for a write in flight), "
            "written in the background in 7.9 s") in lines, lines


class TestStopWhileWorkersStart:
    """A signal that reaches the launcher while torch elastic is still starting the group (forked workers can
    ask for a stop before the start has returned their pids) is kept and passed on to them, never dropped, and
    never ends the launcher as if no worker ran (which left torch's log tailers running: a hang at exit)."""

    def test_the_request_is_kept_and_told_to_the_workers_once_known(self, monkeypatch):
        told = []
        monkeypatch.setattr("phalanx.launch.stop.os.kill", lambda pid, sig: told.append((pid, sig)))
        request = StopRequest(30.0, 0)
        request.starting = True
        request._on_signal(signal.SIGTERM, None)  # no StoppedBeforeStart: the workers are on their way
        assert request.active and told == []
        request.workers_started([101, 102], store=None, node_rank=0)
        assert not request.starting and sorted(told) == [(101, signal.SIGTERM), (102, signal.SIGTERM)]

    def test_before_any_start_it_still_ends_the_launcher(self):
        from phalanx.launch.stop import StoppedBeforeStart

        with pytest.raises(StoppedBeforeStart):
            StopRequest(30.0, 0)._on_signal(signal.SIGTERM, None)


class TestLogTailersNeverOutliveTheLauncher:
    """torch's log tailers are threads that read a worker's log until told to stop; one left running holds
    the launcher at interpreter exit forever (a stop request raised inside torch's close skipped its stop)."""

    @staticmethod
    def agent_with_context(tmp_path, close):
        import io
        import types

        from torch.distributed.elastic.multiprocessing.tail_log import TailLog

        from phalanx.launch.agent import Agent
        log = tmp_path / "rank-0.log"
        log.write_text("a line\n")
        tail = TailLog("worker", {0: str(log)}, io.StringIO(), interval_sec=0.01).start()
        pcontext = types.SimpleNamespace(_tail_logs=[tail], close=close)
        agent = Agent.__new__(Agent)  # only what the close wrapper reads
        agent._pcontext, agent._contexts = pcontext, []
        agent.diagnosis = types.SimpleNamespace(directory=str(tmp_path))
        return agent, pcontext, tail

    def test_a_stop_raised_inside_torchs_close_still_stops_the_tailers(self, tmp_path):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        def close_interrupted(death_sig=None, timeout=30):
            raise SignalException("stop request during the close", signal.SIGTERM)
        agent, pcontext, tail = self.agent_with_context(tmp_path, close_interrupted)
        agent._mark_teardown_before_close()
        assert not tail.stopped()
        with pytest.raises(SignalException):
            pcontext.close()
        assert tail.stopped() and all(future.done() for future in tail._futs)

    def test_the_launchers_last_act_stops_a_context_never_closed(self, tmp_path):
        agent, _, tail = self.agent_with_context(tmp_path, lambda *a: None)
        agent._mark_teardown_before_close()
        agent.stop_log_tailers()
        assert tail.stopped() and all(future.done() for future in tail._futs)
        agent.stop_log_tailers()  # once stopped, a second call is a no-op


class TestAStopAdoptedFromTheWorkers:
    """The workers' own agreement can end them before this launcher's next look in the store (every 0.5 s):
    the stop is adopted, and named by the node that asked when the store says so."""

    class Store:
        def __init__(self, value: bytes | None):
            self.value = value

        def check(self, keys):
            return self.value is not None

        def get(self, key):
            return self.value

    def test_another_nodes_request_in_the_store_is_named(self):
        request = StopRequest(grace_period=30, node_rank=0)
        request.store = self.Store(b"SIGTERM 1 123@another-host")
        request.adopt()
        assert request.signal == signal.SIGTERM and request.origin == " on node 1"

    def test_without_one_it_came_to_a_worker_or_another_node(self):
        for store in (None, self.Store(None)):
            request = StopRequest(grace_period=30, node_rank=0)
            request.store = store
            request.adopt()
            assert request.signal == signal.SIGTERM and request.origin == " to a worker or another node"

    def test_this_launchers_own_entry_is_not_another_nodes(self):
        request = StopRequest(grace_period=30, node_rank=0)
        request.store = self.Store(f"SIGUSR1 0 {request._me}".encode())
        request.adopt()
        assert request.origin == " to a worker or another node"
