"""The survivors' agreement (world/generations/agreement.py agree_on_survivors), decided by the first survivor in rank
order on a store of this process: who goes on."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from phalanx.world.generations import agreement


class _Watch:
    def __init__(self, gone: set[int]):
        self._gone = gone

    def gone(self) -> set[int]:
        return set(self._gone)

    def probe(self, members) -> set[int]:
        return set()


class _Generation:
    """The parts of a Generation the agreement asks for: its members, its keys, its watch."""

    number, members = 3, (0, 1, 2, 3)

    def __init__(self, gone: set[int]):
        self.watched = _Watch(gone)

    def _key(self, *parts) -> str:
        return "/".join(("generation", str(self.number), *map(str, parts)))

    def say_applied(self, store) -> None:
        pass

    def watch(self, store) -> _Watch:
        return self.watched


@pytest.fixture
def as_rank_0(monkeypatch):
    monkeypatch.setattr(agreement.dist, "get_rank", lambda: 0)


def test_every_member_alive_goes_on(as_rank_0):
    store, generation = dist.HashStore(), _Generation(gone=set())
    store.append(generation._key("alive"), "2,1,3,")
    assert agreement.agree_on_survivors(generation, store) == (0, 1, 2, 3)


def test_a_member_known_gone_that_never_said_alive_is_left_out(as_rank_0):
    store, generation = dist.HashStore(), _Generation(gone={3})
    store.append(generation._key("alive"), "1,2,")
    assert agreement.agree_on_survivors(generation, store) == (0, 1, 2)


def test_a_member_that_said_alive_and_then_was_found_gone_is_left_out(as_rank_0):
    """A host's ranks killed one after another: the last of them saw the first gone, said it is alive, and died
    before the decision. Kept in, it would fail the new groups' connect on its neighbours, and the run restart."""
    store, generation = dist.HashStore(), _Generation(gone={2, 3})
    store.append(generation._key("alive"), "1,3,")
    assert agreement.agree_on_survivors(generation, store) == (0, 1)
    assert store.get(generation._key("next")) == b"0,1"
