"""The generation this process trains in, and the meeting on the next one.

Generation 0 is the world `init()` made. A `Generation` is its number, its members (global ranks, in order) and the
process group they share; its keys are under `generation/<g>/` in phalanx's namespace of the store, where each rank
says who it is (liveness.py: host, pid, start time, beacon), so that a peer can tell it is gone: at once on the same
host or when its beacon refuses, after the heartbeat window when its host is silent.

Each generation's process groups are made by name from its members (joining.make_group), by every member alike,
joiners included, whose own default group is not the others'. What every member counts in a generation (its steps
committed, its admissions) starts at 0 in each.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ...errors import MembershipError, explain
from .. import group as world
from .. import joining
from ..liveness import identity
from ..process import gloo_loops
from ..watch import GenerationWatch, side_store
from . import release
from .commit import StepCommit
from .settings import CONNECT_LOOK_EVERY, REGROUP_CONNECT_SECONDS, live_recovery, membership_timeout


@dataclass(frozen=True)
class Generation(StepCommit):
    """One generation: its number, its members (global ranks, in order) and the process group they share."""

    number: int
    members: tuple[int, ...]
    group: object  # a ProcessGroup; dist.group.WORLD for generation 0
    _watching: dict = field(default_factory=dict, compare=False, repr=False)  # "watch": this rank's (watch.py)

    @property
    def rank(self) -> int:
        """This process's rank in the generation's group."""
        return self.members.index(dist.get_rank())

    @property
    def world_size(self) -> int:
        return len(self.members)

    def _key(self, *parts) -> str:
        return "/".join(("generation", str(self.number), *map(str, parts)))

    # -- who is gone --------------------------------------------------------------------------------

    def watch(self, store) -> GenerationWatch:
        """This rank's watch in the generation (watch.py): one peer on another host, the pids of its own host, the
        verdicts the others spread. Set up (in a thread) once this rank said who it is."""
        if "watch" not in self._watching:
            self._watching["watch"] = GenerationWatch(self._key, self.members, dist.get_rank(), store,
                                                      self.in_flight)
        return self._watching["watch"]

    def gone(self, store) -> set[int]:
        """Members known gone (watch.py): a process on this host that no longer runs; on another host, one whose
        watcher's kept connection ended, or found it silent for the heartbeat window."""
        return self.watch(store).gone()

    def close_watch(self) -> None:
        """The generation is over: its watch closed, its commit tree's connections and listener closed."""
        self._watching.pop("tree", None)
        links = self._watching.pop("links", None)
        if links is not None:
            links.close()
        if "watch" in self._watching:
            self._watching["watch"].close()

    def in_flight(self) -> list[str]:
        """The done keys of the steps a member may be waiting on now (a member is at most one step ahead of another):
        what a watcher that found a member gone sets, so that no wait for a commit outlives the generation."""
        return [self._done(n) for n in range(max(0, _commits - 1), _commits + 2)]


_current: Generation | None = None
_commits = 0  # steps committed (or failed) in the current generation: every member counts the same
_admissions = 0  # admit_joiners() calls in the current generation: every member counts the same


def current() -> Generation:
    """The generation this process trains in (generation 0, the whole world, until a loss)."""
    global _current
    if _current is None:
        _current = Generation(0, tuple(range(world.launch_world_size())), dist.group.WORLD)
    return _current


def commit_step() -> bool:
    """Collective over the current generation, after a step's exchange: True when every member may apply the
    step, False when it failed somewhere (a peer lost): then the step is redone at the next generation."""
    global _commits
    number, _commits = _commits, _commits + 1
    return current().commit(world.store(), number)


def fail_step() -> None:
    """This rank's exchange of the step failed: no member applies it (see commit_step)."""
    global _commits
    number, _commits = _commits, _commits + 1
    current().fail_step(world.store(), number)


def next_admission() -> int:
    """The number of this admit_joiners() call in the current generation (admissions.py), counted."""
    global _admissions
    number, _admissions = _admissions, _admissions + 1
    return number


def announce() -> None:
    """Say which process this rank is, for the survivors of a loss to tell at once that it is gone."""
    generation = current()
    world.store().set(generation._key("who", dist.get_rank()), identity())
    generation.watch(world.store())


class GroupsNotFormed(MembershipError):
    """A new generation's groups were not made on every member (one lost while they were made): the members agree
    again without it (agreement.next_generation); past its attempts, a MembershipError as any other."""


def meet(number: int, members: tuple[int, ...], who: str, abandoned: bool = False, attempt: int = 0,
         formed=None) -> None:
    """Collective over `members`: make generation `number`'s process groups (by name: joiners take part, whose
    default group is not the others', joining.py) and make it the current generation. The groups before are
    released after the regroup (release.py). `abandoned`: after a loss (a collective on them may still
    wait on the lost rank: shutdown() then leaves the groups not yet freed to the process's exit). `formed(made)`:
    whether every member made the groups, this one too (`made`), the same answer on each (agreement.groups_formed);
    when not, the groups made are set aside and GroupsNotFormed raised, the generation before still current (its
    watch open): `attempt` names the groups of each try apart."""
    global _current, _commits, _admissions
    name = f"phalanx/{world.attempt()}/generation{number}" + (f"-{attempt}" if attempt else "")
    made, failure, store = [], None, side_store(joining.default_store())
    try:
        made.append(generation_group(members, f"{name}/main", who=who, store=store))
        made.append(generation_group(members, f"{name}/control", backend="gloo", who=who, store=store))
    except MembershipError as exc:
        if formed is None:
            raise
        failure = exc
    if formed is not None and not formed(failure is None):
        release.set_aside(made, True)
        raise GroupsNotFormed(explain(
            f"generation {number}'s process groups were not made on every member", rank=dist.get_rank(),
            seen=str(failure).splitlines()[0] if failure else "another member could not make them",
            expected=f"every member of {list(members)} connected",
            fix="A member was lost while the others made them: the ranks left agree again without it.")) from failure
    group, control = made
    before = current()  # generation 0 registered its end-of-run reset
    release.set_aside((before.group, world.control_group()), abandoned)
    before.close_watch()
    _current, _commits, _admissions = Generation(number, tuple(members), group), 0, 0
    world.set_live(_current.number, _current.members, group, control, abandoned)
    world.store().set(_current._key("who", dist.get_rank()), identity())
    _current.watch(world.store())


def generation_group(members, name: str, backend: str | None = None, who: str = "the generation's members",
                     store=None):
    """A process group of a generation's `members` (global ranks, ascending), made by `name` (joining.make_group).
    Connected with a short timeout (every member agreed moments ago, so all are making it now), then given the
    membership timeout for its collectives: a member lost while it is made (a second loss within the regroup) would
    otherwise hold the others in Gloo's connection set-up, which cannot be watched, for that long.

    A Gloo group is made lazy (joining.gloo_lazy): a full mesh would cost the regroup O(members^2) store reads, where
    each rank connects here only the peers of a ring all-reduce and of a broadcast from rank 0 (at most 2 + log2
    members, joining.connect_lazy), the collectives phalanx runs on a generation's groups; any other pair connects
    at its first use. Either failing is a MembershipError (`who`: the ranks making it, for its message).

    Its members meet on `store`, by default a store client of its own (watch.side_store; meet gives a
    generation's groups one): a client serves one call at a time, and a pair's connect that waits for a lost
    member's address (in a thread nothing can stop, up to the connect time) would hold the rank's client, and so its
    regroup, that long."""
    lazy = (backend or dist.get_backend()) == "gloo"
    loops = gloo_loops.loop_threads()  # a lazy group's loop thread starts with its first pair: in _connect
    try:
        group = joining.make_group(members, name, _connect_time(), backend, lazy=lazy,
                                   store=store if store is not None else side_store(joining.default_store()))
    except RuntimeError as exc:
        raise _not_connected(name, members, who, _first_line(exc)) from exc
    if lazy:
        _connect(group, members, name, who)
    gloo_loops.note(group, loops)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=membership_timeout()), group)
    return group


def _connect(group, members, name: str, who: str) -> None:
    """Connect a lazy group's pairs now (joining.connect_lazy, in a thread), within the connect time: a member lost
    before then fails the regroup here, named as soon as it is known gone, rather than a first step's collective
    (whose set-up of a pair waits for a lost peer five times the connect time: Gloo retries a refused connection)."""
    connected = concurrent.futures.Future()

    def connect():
        try:
            joining.connect_lazy(group)
            connected.set_result(None)
        except RuntimeError as exc:  # a peer's address never came, or its connection was refused
            connected.set_exception(exc)

    threading.Thread(target=connect, name="phalanx-connect", daemon=True).start()  # left to Gloo's timeout if lost
    deadline, seen = time.monotonic() + _connect_time().total_seconds(), None
    while seen is None:
        try:
            connected.result(timeout=min(CONNECT_LOOK_EVERY, max(0.0, deadline - time.monotonic())))
            return
        except concurrent.futures.TimeoutError:
            gone = lost_among(members)
            if gone or time.monotonic() >= deadline:
                seen = f"member(s) {sorted(gone)} gone" if gone else f"members {list(members)} not all connected"
        except RuntimeError as exc:
            seen = _first_line(exc)
    raise _not_connected(name, members, who, seen)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _not_connected(name: str, members, who: str, seen: str) -> MembershipError:
    return MembershipError(explain(
        f"could not connect the process group {name}", rank=dist.get_rank(), seen=f"{seen} ({who})",
        expected=f"every member of {list(members)} connected within {_connect_time().total_seconds():g} s",
        fix="A member was lost while the others regrouped: the run falls back to a restart from its newest "
            "checkpoint."))


def _connect_time() -> timedelta:
    return timedelta(seconds=min(membership_timeout(), REGROUP_CONNECT_SECONDS))


def start_solo() -> None:
    """A joiner, before it is taken in: a generation of its own (its model and loader are built as in a world of
    one), on groups of its own."""
    global _current
    me = dist.get_rank()
    timeout = timedelta(seconds=REGROUP_CONNECT_SECONDS)
    group = joining.make_group([me], f"phalanx/{world.attempt()}/join{me}/main", timeout)
    control = joining.make_group([me], f"phalanx/{world.attempt()}/join{me}/control", timeout, backend="gloo")
    current()
    _current = Generation(joining.SOLO, (me,), group)
    world.set_live(joining.SOLO, (me,), group, control)


def lost_since(members) -> set[int]:
    """Which of `members` (the ranks of this generation or of an earlier one) are lost: no longer among the ranks
    that train, or known gone. Empty without live recovery."""
    if not live_recovery():
        return set()
    return (set(members) - set(current().members)) | lost_among(members)


def lost_among(ranks) -> set[int]:
    """Which of `ranks` are known gone, with live recovery on (world.barrier asks)."""
    return current().gone(world.store()) & set(ranks) if live_recovery() else set()


def forget() -> None:
    """At shutdown, after the last collectives: the next init() starts at generation 0 again."""
    global _current, _commits
    if _current is not None:
        _current.close_watch()
    _current, _commits = None, 0
