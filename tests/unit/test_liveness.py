"""How a worker tells that a peer on another host is gone (world/liveness.py): refused at once, silent only
after the heartbeat window of silence that lasts."""

from __future__ import annotations

import socket

import pytest

from phalanx.world import liveness
from phalanx.world.liveness import SILENCE_GAP, SILENT_WINDOW, PeerWatch, identity, probe


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def answers(monkeypatch):
    """The probes' answers, set by the test, on a clock the test moves."""
    clock, said = _Clock(), {"answer": "alive"}
    monkeypatch.setattr(liveness.time, "monotonic", clock)
    monkeypatch.setattr(liveness, "probe", lambda address: said["answer"])
    return clock, said


OTHER_HOST = "another-boot|pid:[1]|net:[2] 4242 12345 10.0.0.9:4000"


def _probe_for(watch: PeerWatch, clock: _Clock, seconds: float, step: float) -> bool:
    """A rank waiting on its peers for `seconds`, asking every `step` seconds: whether the peer was found gone."""
    end = clock.now + seconds
    while clock.now < end:
        if watch.gone(1, OTHER_HOST):
            return True
        clock.now += step
    return False


def test_a_peer_silent_for_the_whole_window_is_gone(answers):
    clock, said = answers
    watch = PeerWatch()
    said["answer"] = "silent"
    assert not _probe_for(watch, clock, SILENT_WINDOW - 0.5, 0.1), "gone before the window of silence passed"
    assert _probe_for(watch, clock, 1.0, 0.1), "a peer silent for the whole window was not found gone"


def test_a_refused_probe_is_gone_at_once(answers):
    clock, said = answers
    said["answer"] = "gone"
    assert PeerWatch().gone(1, OTHER_HOST)


def test_silences_apart_are_not_one_long_silence(answers):
    """Two probes that went unanswered, with the rank training (not probing) for longer than the window between
    them, must not add up to a host cut off (they once did: a rank counted a live peer lost and ended)."""
    clock, said = answers
    watch = PeerWatch()
    said["answer"] = "silent"
    assert not watch.gone(1, OTHER_HOST)
    clock.now += SILENT_WINDOW + 5  # training: no waits, no probes
    assert not watch.gone(1, OTHER_HOST), "an old silence and a new one were taken for one window"
    assert not _probe_for(watch, clock, SILENT_WINDOW - 0.5, 0.1)
    assert _probe_for(watch, clock, 1.0, 0.1)


def test_an_answer_restarts_the_window(answers):
    clock, said = answers
    watch = PeerWatch()
    said["answer"] = "silent"
    assert not _probe_for(watch, clock, SILENT_WINDOW - 0.5, 0.1)
    said["answer"] = "alive"
    assert not watch.gone(1, OTHER_HOST)
    clock.now += 0.2
    said["answer"] = "silent"
    assert not _probe_for(watch, clock, SILENT_WINDOW - 0.5, 0.1), "silence before an answer was still counted"


def test_probing_resumed_after_a_short_pause_keeps_counting(answers):
    """A rank that leaves a wait and enters the next one within SILENCE_GAP still sees a host cut off in time."""
    clock, said = answers
    watch = PeerWatch()
    said["answer"] = "silent"
    assert not _probe_for(watch, clock, SILENT_WINDOW / 2, 0.1)
    clock.now += SILENCE_GAP / 2
    assert _probe_for(watch, clock, SILENT_WINDOW / 2, 0.1)


def test_a_real_beacon_answers_while_its_process_lives_and_refuses_once_closed():
    beacon = identity().split()[3]
    assert probe(beacon) == "alive"
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    host, port = spare.getsockname()
    address = f"{host}:{port}"
    spare.close()
    assert probe(address) == "gone"
