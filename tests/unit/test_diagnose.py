"""The diagnosis of hangs in one process: the ring's round trip, the verdicts, the straggler figures, stall
detection on a fake clock, call sites and stacks. The same machinery across real ranks and launchers is
in tests/e2e/test_stall_report.py.
"""

import os
import threading
import time

import pytest

from phalanx.diagnose import recorder, stacks, straggler
from phalanx.diagnose import watch as watch_module
from phalanx.diagnose.callsite import CallSites
from phalanx.diagnose.record import CAPACITY, H_EXITED, H_PID, KIND, PHASE, STARTED, Entry, Ring, Snapshot, read_ring
from phalanx.diagnose.verdict import find_desync, judge
from phalanx.diagnose.watch import CHECKPOINT_GRACE, StallWatch, stall_timeout
from phalanx.errors import WorldConfigError

THIS = os.path.relpath(__file__)


def entry(seq, kind="bucket", bucket=0, numel=100, state="done", step=1, entered=0, site="train.py:10 in main"):
    return Entry(seq, kind, bucket, numel, "float32", state, entered, entered, 0, site, step)


def snap(rank, entries, phase="backward", step=1, pid=100, since=0, data_ns=0):
    return Snapshot(rank, pid + rank, 2, rank, step, phase, since, since, 1, 0, 0, data_ns, False, entries)


class TestRing:
    def test_entries_phases_and_sites_come_back_as_written(self, tmp_path):
        ring = Ring(str(tmp_path / "rank-1.ring"), rank=1, world_size=2, local_rank=1)
        site = ring.add_site("train.py:42 in main")
        ring.next_step()
        first = ring.begin(KIND["bucket"], 3, 1234, 1, site, STARTED)
        ring.done(first)
        ring.begin(KIND["barrier"], -1, 0, 0, 0, STARTED)
        ring.phase(PHASE["data"])
        seen = read_ring(str(tmp_path / "rank-1.ring"))
        assert (seen.rank, seen.world_size, seen.pid, seen.step, seen.phase) == (1, 2, os.getpid(), 1, "data")
        assert [(e.seq, e.kind, e.bucket, e.numel, e.dtype, e.state, e.site, e.step) for e in seen.entries] == [
            (0, "bucket", 3, 1234, "float32", "done", "train.py:42 in main", 1),
            (1, "barrier", -1, 0, "?", "started", "?", 1)]
        assert seen.entries[0].done_ns >= seen.entries[0].entered_ns > 0

    def test_the_ring_keeps_the_latest_entries(self, tmp_path):
        ring = Ring(str(tmp_path / "rank-0.ring"), rank=0, world_size=1, local_rank=0)
        for _ in range(CAPACITY + 5):
            ring.done(ring.begin(KIND["bucket"], 0, 1, 1, 0, STARTED))
        seqs = [e.seq for e in read_ring(str(tmp_path / "rank-0.ring")).entries]
        assert seqs == list(range(5, CAPACITY + 5))

    def test_data_wait_counts_from_the_second_step(self, tmp_path, monkeypatch):
        clock = iter(range(0, 10**12, 10**6))  # each reading 1 ms later
        monkeypatch.setattr("phalanx.diagnose.record.time.monotonic_ns", lambda: next(clock))
        ring = Ring(str(tmp_path / "rank-0.ring"), rank=0, world_size=1, local_rank=0)
        ring.phase(PHASE["data"])
        ring.next_step()  # the startup's data time is not a step's
        ring.phase(PHASE["data"])
        ring.next_step()
        assert read_ring(str(tmp_path / "rank-0.ring")).data_ns == 10**6

    def test_a_file_that_is_not_a_ring_reads_as_none(self, tmp_path):
        (tmp_path / "rank-0.ring").write_bytes(b"\0" * 100)
        assert read_ring(str(tmp_path / "rank-0.ring")) is None
        assert read_ring(str(tmp_path / "missing.ring")) is None


class TestVerdict:
    def test_the_rank_that_never_entered_the_collective_is_named_with_its_line(self):
        stack = ('Current thread 0x0000000000000001 (most recent call first):\n'
                 f'  File "{threading.__file__}", line 320 in wait\n'
                 '  File "train.py", line 22 in __getitem__\n  File "train.py", line 40 in main\n')
        rings = {0: snap(0, [entry(4), entry(5, state="started", entered=10**9)]),
                 1: snap(1, [entry(4)], phase="data", step=1)}
        verdict = judge(rings, [0, 1], {1: stack}, now_ns=6 * 10**9)
        assert verdict.kind == "stall"
        assert verdict.headline.startswith("rank 1 never entered collective #5 gradient exchange of bucket 0")
        assert "phase data (before step 2) at train.py:22 in __getitem__; rank(s) 0 wait for it" in verdict.headline
        assert verdict.waiting == [{"rank": 0, "seq": 5, "since_s": 5.0, "state": "started",
                                    "site": "train.py:10 in main"}]
        assert verdict.as_json()["culprits"][0]["rank"] == 1

    def test_a_rank_without_a_ring_never_reached_init(self):
        rings = {0: snap(0, [entry(0, kind="rendezvous", state="started")], phase="init")}
        verdict = judge(rings, [0, 1], {}, now_ns=0)
        assert verdict.headline.startswith("rank 1 never reached phalanx.init()")

    def test_every_rank_in_the_same_collective_blames_the_transport_or_another_host(self):
        rings = {0: snap(0, [entry(3, state="started")]), 1: snap(1, [entry(3, state="started")])}
        assert "the transport itself is stuck" in judge(rings, [0, 1], {}, now_ns=0).headline
        assert "another host (ranks 2..3)" in judge(rings, [0, 1], {}, now_ns=0, elsewhere=[2, 3]).headline

    def test_a_size_mismatch_is_a_desync_naming_the_minority_and_both_call_sites(self):
        rings = {r: snap(r, [entry(7, numel=100, site="a.py:1 in f")]) for r in (0, 2)}
        rings[1] = snap(1, [entry(7, numel=60, site="a.py:9 in g")])
        verdict = judge(rings, [0, 1, 2], {}, now_ns=0, dead={1: "was killed by SIGABRT"})
        assert verdict.kind == "desync" and verdict.desync["odd"] == [1]
        assert any("a.py:9 in g" in line for line in verdict.lines) and any("a.py:1 in f" in line
                                                                          for line in verdict.lines)
        assert verdict.lines[-1] == "then rank 1 was killed by SIGABRT."

    def test_the_same_exchange_from_a_later_step_is_a_skipped_backward(self):
        rings = {0: snap(0, [entry(9, step=5, state="started")]), 1: snap(1, [entry(9, step=6, state="started")])}
        found = find_desync(rings)
        assert found["odd"] == [1] and found["reason"] == "the same collective from different steps"

    def test_join_shadow_exchanges_pair_with_the_others_buckets(self):
        rings = {0: snap(0, [entry(9, step=5)]), 1: snap(1, [entry(9, kind="shadow", step=3)])}
        assert find_desync(rings) is None

    def test_a_dead_rank_is_named_with_its_last_record(self):
        rings = {r: snap(r, [entry(3, state="started", step=5)], step=5) for r in (0, 1)}
        verdict = judge(rings, [0, 1], {}, now_ns=0, dead={1: "was killed by SIGKILL"})
        assert verdict.kind == "dead"
        assert verdict.headline == ("rank 1 (pid 101) was killed by SIGKILL; its last record: #3 gradient exchange "
                                    "of bucket 0 (100 x float32) started, issued at train.py:10 in main, in phase "
                                    "backward of step 5")


class TestStraggler:
    def test_lateness_is_arrival_minus_the_first_arrival(self):
        ms = 10**6
        rings = {0: snap(0, [entry(s, entered=s * 100 * ms) for s in range(10)], step=11),
                 1: snap(1, [entry(s, entered=s * 100 * ms + 20 * ms) for s in range(10)], step=11,
                         data_ns=45 * ms * 10)}
        skews = straggler.skew(rings)
        assert (skews[1].late_ms, skews[1].last_fraction, skews[1].exchanges) == (20.0, 1.0, 10)
        assert skews[1].data_wait_ms_per_step == 45.0 and skews[0].late_ms == 0.0
        assert straggler.straggler(skews).rank == 1
        assert straggler.summary(skews[1]) == ("rank 1 arrives 20.0 ms late at 100% of 10 gradient exchanges; its "
                                               "data wait is 45.0 ms/step")

    def test_ranks_that_take_turns_are_no_straggler(self):
        rings = {0: snap(0, [entry(s, entered=s % 2 * 10**7) for s in range(10)]),
                 1: snap(1, [entry(s, entered=(s + 1) % 2 * 10**7) for s in range(10)])}
        assert straggler.straggler(straggler.skew(rings)) is None


class TestStallWatch:
    def test_fires_once_after_the_timeout_without_progress_and_again_after_progress(self, tmp_path):
        ring = Ring(str(tmp_path / "rank-0.ring"), rank=0, world_size=1, local_rank=0)
        ring.next_step()  # in its steps: only the ring's counters are progress (not this process's CPU)
        watch = StallWatch(str(tmp_path), timeout=5.0, expected=[0])
        assert not watch.poll(now=100.0)
        assert not watch.poll(now=104.0)
        assert watch.poll(now=105.5)
        assert not watch.poll(now=200.0)  # one report per stall
        ring.beat()
        assert not watch.poll(now=201.0) and watch.poll(now=206.5)

    def test_a_checkpoint_gets_more_time_and_a_finished_run_none(self, tmp_path):
        ring = Ring(str(tmp_path / "rank-0.ring"), rank=0, world_size=1, local_rank=0)
        ring.next_step()
        ring.phase(PHASE["checkpoint"])
        watch = StallWatch(str(tmp_path), timeout=5.0, expected=[0])
        watch.poll(now=0.0)
        assert not watch.poll(now=6.0) and watch.poll(now=5.0 * CHECKPOINT_GRACE + 0.1)
        ring.set(H_EXITED, 1)
        ring.beat()
        watch.poll(now=100.0)
        assert not watch.poll(now=1000.0)

    def test_a_missing_ring_is_a_rank_that_makes_no_progress(self, tmp_path):
        watch = StallWatch(str(tmp_path), timeout=1.0, expected=[0, 1])
        watch.poll(now=0.0)
        assert watch.poll(now=1.5)

    def test_a_rank_starting_on_the_cpu_is_not_stalled_until_the_startup_window_ends(self, tmp_path, monkeypatch):
        """Rank 1 has no ring yet (it has not reached init()) but its process uses the CPU (importing torch on
        a busy machine): no stall; a rank without a ring whose process is idle (asleep before init()) is one."""
        ticks = iter(range(1000))
        monkeypatch.setattr(watch_module, "_cpu_ticks", lambda pid: next(ticks) if pid == 11 else 7)
        Ring(str(tmp_path / "rank-0.ring"), rank=0, world_size=2, local_rank=0)
        busy = StallWatch(str(tmp_path), timeout=1.0, expected=[0, 1], pids={0: 10, 1: 11})
        began = busy._began
        assert not any(busy.poll(now=began + t) for t in (0.0, 1.5, 3.0, 4.5))
        past = began + watch_module.STARTUP_CPU_WINDOW
        busy.poll(now=past)
        assert busy.poll(now=past + 1.5)  # past the window, CPU use alone is no progress
        idle = StallWatch(str(tmp_path), timeout=1.0, expected=[0, 1], pids={0: 10, 1: 12})
        idle.poll(now=idle._began)
        assert idle.poll(now=idle._began + 1.5)

    def test_a_rank_before_its_first_step_is_starting_while_it_uses_the_cpu(self, tmp_path, monkeypatch):
        """Rank 0 passed init() and builds its model or fetches its first batch on a busy machine (user code that
        leaves no record): its CPU time moves, so no stall. Once in its steps, CPU use alone is no progress (a
        rank spinning while holding the GIL is stuck)."""
        ticks = iter(range(1000))
        monkeypatch.setattr(watch_module, "_cpu_ticks", lambda pid: next(ticks))
        ring = Ring(str(tmp_path / "rank-0.ring"), rank=0, world_size=1, local_rank=0)
        ring.phase(PHASE["init"])  # at init()'s rendezvous: waiting, whatever CPU its polling uses
        watch = StallWatch(str(tmp_path), timeout=1.0, expected=[0])
        began = watch._began
        watch.poll(now=began)
        assert watch.poll(now=began + 1.5)
        ring.phase(PHASE["data"])  # init() done: the model is built, the first batch fetched
        assert not any(watch.poll(now=began + t) for t in (2.0, 3.5, 5.0, 6.5))
        ring.next_step()
        watch.poll(now=began + 7.0)
        assert watch.poll(now=began + 8.5)

    def test_cpu_ticks_read_the_process_own_counters(self):
        before = watch_module._cpu_ticks(os.getpid())
        deadline = time.process_time() + 0.05
        while time.process_time() < deadline:
            pass
        assert 0 <= before < watch_module._cpu_ticks(os.getpid())
        assert watch_module._cpu_ticks(None) == -1

    def test_the_timeout_setting_is_checked(self, monkeypatch):
        monkeypatch.setenv("PHALANX_STALL_TIMEOUT", "soon")
        with pytest.raises(WorldConfigError, match="PHALANX_STALL_TIMEOUT"):
            stall_timeout()
        assert stall_timeout("0") == 0.0 and stall_timeout(12) == 12.0


class TestCallSitesAndStacks:
    def test_the_call_site_is_the_first_frame_outside_the_libraries(self):
        texts = []
        sites = CallSites(lambda text: texts.append(text) or len(texts))

        def library_like():  # depth 2 from here.here() is this test's line
            return sites.here(2)

        first, second = library_like(), library_like()
        assert first == second == 1  # interned once
        assert texts[0].startswith(f"{THIS}:") and texts[0].endswith("in test_the_call_site_is_the_first_frame_"
                                                                     "outside_the_libraries")

    def test_a_process_answers_the_stack_signal_with_its_own_stack(self, tmp_path):
        path = str(tmp_path / "rank-0.stack")
        try:
            stacks.register(path)
            assert stacks.catches(os.getpid())
            text = stacks.request({0: (os.getpid(), path)})[0]
        finally:
            stacks.unregister()
        frames = stacks.main_frames(text, threading.main_thread().ident)
        assert any(function == "test_a_process_answers_the_stack_signal_with_its_own_stack"
                   for _, _, function in frames), text
        assert stacks.user_location(frames).startswith(f"{THIS}:")
        assert not stacks.catches(os.getpid())

    def test_a_process_that_does_not_answer_is_described_from_proc(self, tmp_path):
        text = stacks.request({0: (os.getpid(), str(tmp_path / "none.stack"))})[0]
        assert text.startswith("(no Python stack: the stack signal is not handled") and "state R" in text


class TestRecorder:
    def test_off_until_started_and_a_dead_peer_is_noticed(self, tmp_path, monkeypatch):
        assert recorder.begin(recorder.BUCKET) == -1 and recorder.phase(recorder.DATA) == -1
        recorder.start(str(tmp_path), rank=0, world_size=2, local_rank=0)
        try:
            entry_slot = recorder.begin(recorder.BARRIER)
            recorder.done(entry_slot)
            peer = Ring(str(tmp_path / "rank-1.ring"), rank=1, world_size=2, local_rank=1)
            assert recorder.dead_peers([1]) == {}  # its pid (ours) is alive
            peer.set(H_PID, 4_194_000)  # a pid that does not run
            if recorder.pid_alive(4_194_000):
                pytest.skip("pid 4194000 runs on this machine")
            assert recorder.dead_peers([1]) == {1: 4_194_000}
            seen = read_ring(str(tmp_path / "rank-0.ring"))
            assert seen.entries[-1].kind == "barrier" and seen.entries[-1].state == "done"
            assert seen.entries[-1].site.startswith(f"{THIS}:")
        finally:
            recorder.stop(remove=True)
        assert not os.path.exists(tmp_path / "rank-0.ring") and recorder.begin(recorder.BUCKET) == -1



def test_the_phases_of_an_exchange_across_hosts_are_named():
    """A rank waiting in the hierarchical exchange is recorded in its host or network phase, and said so."""
    from phalanx.diagnose.record import Entry

    def entry(kind):
        return Entry(seq=7, kind=kind, bucket=2, numel=1000, dtype="float32", state="started", entered_ns=1,
                     started_ns=1, done_ns=0, site="train.py:10", step=3)

    assert entry("network-phase").describe() == ("#7 network phase (Gloo between hosts) of the gradient exchange "
                                                 "of bucket 2 (1,000 x float32)")
    assert entry("host-phase").describe().startswith("#7 host phase (shared memory between this host's ranks)")
