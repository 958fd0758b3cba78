"""Generations of the world: the ranks that train together, renewed in-process when some are lost.

Generation 0 is the world `init()` made. When a rank is lost (its process killed, its host gone) the
survivors do not restart: they agree through the rendezvous store on who is left, and meet on a new
process group, generation g+1, with their old ranks in their old order. The old groups are never used again: a Gloo
collective on them cannot be aborted, and may still write its buffers. They are released once the followers moved
off them (_release_old_groups): unregistered at once, freed by a thread of their own when their last collective ends.

Live recovery is asked for with a minimum world size (`PHALANX_MIN_WORLD_SIZE`, or
`phalanx.spawn(..., min_world_size=)`): a loss that leaves fewer ranks ends the run as before.

Four store protocols, all under `generation/<g>/` in phalanx's namespace of the store:
- who: each rank's process (liveness.py: host, pid, start time, beacon), so that a peer can tell it is gone:
  at once on the same host or when its beacon refuses, after the heartbeat window when its host is silent.
- commit: after each step's exchange, every rank adds 1 to the step's counter; the step is applied only if
  the counter reaches the world size. A rank whose exchange failed, or that found a peer gone while waiting,
  gives the step up by setting the counter negative, with a compare-and-set from the value it read: once full the
  counter cannot be given up, once given up it cannot fill, so every rank reads the same outcome. The last rank to
  add knows at once and sets the step's `done` key; the others block on that key in the store (no polling) and read
  the counter once woken. Whatever can end a step wakes them too: a rank that gives it up sets the key, a watcher
  that finds a member gone sets the keys of the steps in flight, and a rank's own watch sets its key when a peer on
  its host ends or the membership timeout passes (watch.py). Healthy, that is three store round trips per rank and
  step (an add, the wait, a read; the last rank: an add, a set, a delete), whatever the world. The counters are reused
  every COMMIT_SLOTS steps (they add up); one given up ends the generation, never reused.
- agreement: after a loss every survivor says it is alive; once each member has either said so or is
  known gone (or the membership timeout passed), the first proposal stored is the next generation.
- joined: at a step the members agreed on (the checkpointer's stop agreement counted ranks waiting to join,
  joining.py), the first member takes the ready joiners in; the next generation is the members and them.

Each generation's process groups are made by name from its members (joining.make_group), by every member alike,
joiners included, whose own default group is not the others'.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..diagnose import progress
from ..diagnose.watch import ddp_stall_seconds
from ..errors import MembershipError, PeerDiedError, PeerFailedError, explain
from ..log import logger
from . import group as world
from . import joining
from .liveness import identity
from .watch import GenerationWatch

MIN_WORLD_ENV = "PHALANX_MIN_WORLD_SIZE"
MEMBERSHIP_TIMEOUT_ENV = "PHALANX_MEMBERSHIP_TIMEOUT"
# Timeouts nest, so that an outer one never gives up on what an inner one would still save: a collective
# waiting on a lost peer is abandoned at once (a process gone) or after the heartbeat window (a host silent);
# a rank alive but slow is waited for by the step's collectives up to PHALANX_DDP_STALL_TIMEOUT; the survivors'
# agreement waits that long and MEMBERSHIP_MARGIN more for a member that is alive but has not said so; the
# launcher's stall watch (`phalanx run`, launch/run.py) waits MEMBERSHIP_MARGIN beyond that.
MEMBERSHIP_MARGIN = 30.0
AWAITED_SAY_EVERY = 10.0  # seconds between the lines naming the members the survivors still wait for
AGREE_READ_EVERY = 0.5  # seconds between a survivor's reads of who is alive, when another one decides
ORPHAN_AFTER = 0.5  # seconds into the agreement after which the deciding survivor probes the members it still misses
WATCH_EVERY = 0.1  # seconds: how often a wait on a collective asks whether the step in flight was given up
REGROUP_CONNECT_SECONDS = 30.0  # the ranks left making a new generation's process groups wait this long for each other
WAIT_THREADS = 16  # threads that wait on collectives whose own waits cannot be bounded (waited_aside)
COMMIT_SLOTS = 4  # the per-step commit's counters, reused: step n's is slot n % 4's (a member is at most 1 step ahead)
GIVEN_UP = -(1 << 40)  # what a commit counter is set to when its step is given up: later adds leave it negative


def min_world_size() -> int | None:
    """The fewest ranks a run may go on with after a loss (None: live recovery off, a loss ends the run)."""
    value = os.environ.get(MIN_WORLD_ENV, "").strip()
    if not value:
        return None
    try:
        minimum = int(value)
    except ValueError:
        minimum = 0
    if minimum < 1:
        raise MembershipError(explain(f"{MIN_WORLD_ENV} is not a positive whole number", seen=repr(value),
                                      expected="e.g. 2", fix=f"Set {MIN_WORLD_ENV} to the fewest ranks to go on with."))
    return minimum


def live_recovery() -> bool:
    """Whether a lost rank is recovered from in-process: asked for, in a world of several ranks."""
    return min_world_size() is not None and world.is_initialized() and world.launch_world_size() > 1


def membership_timeout() -> float:
    """Seconds the survivors of a loss wait for a member that is neither alive nor known gone (PHALANX_MEMBERSHIP_
    TIMEOUT; default: the DDP stall timeout + MEMBERSHIP_MARGIN, so that a slow rank is not dropped first)."""
    value = os.environ.get(MEMBERSHIP_TIMEOUT_ENV)
    return float(value) if value else ddp_stall_seconds() + MEMBERSHIP_MARGIN


@dataclass(frozen=True)
class Generation:
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
        if "watch" in self._watching:
            self._watching["watch"].close()

    # -- the per-step commit --------------------------------------------------------------------------

    def commit(self, store, number: int) -> bool:
        """Collective over the members, through the store: True if every member is ready to apply step
        `number` of this generation, False if the step failed somewhere and is to be redone."""
        counter, full = self._counter(number)
        count = store.add(counter, 1)
        if count == full:
            store.set(self._done(number), "1")  # wakes the others
            if number > 0:  # every member added to this step: each is past the wait of the one before
                store.delete_key(self._done(number - 1))
            return True
        return count > 0 and self._await_outcome(store, number)

    def _counter(self, number: int) -> tuple[str, int]:
        """Step `number`'s counter and the value that commits it: the slot's counter adds up, every step it served
        had all members in it."""
        return self._key("commit", number % COMMIT_SLOTS), self.world_size * (number // COMMIT_SLOTS + 1)

    def _done(self, number: int) -> str:
        """The key that ends the others' wait for step `number`'s outcome (set by the last member to add, or by
        whoever gives the step up)."""
        return self._key("done", number)

    def _await_outcome(self, store, number: int) -> bool:
        # One blocking wait, which the store answers when the key is set: a large world sends it no reads. The
        # watch (watch.py) sets the key from a thread of its own if this rank finds a peer gone or waits too long.
        counter, full = self._counter(number)
        with self.watch(store).awaiting(self._done(number), membership_timeout()):
            store.wait([self._done(number)])
        count = store.add(counter, 0)
        if count == full or count < 0:
            return count == full
        return self.fail_commit(store, number)

    def in_flight(self) -> list[str]:
        """The done keys of the steps a member may be waiting on now (a member is at most one step ahead of another):
        what a watcher that found a member gone sets, so that no wait for a commit outlives the generation."""
        return [self._done(n) for n in range(max(0, _commits - 1), _commits + 2)]

    def fail_commit(self, store, number: int) -> bool:
        """Give step `number` up: this rank cannot apply it (its exchange failed), or a peer is gone while this
        rank waits. Returns whether the step is applied after all: every member was ready before it was given up
        (a peer lost after it said ready), which only a rank that said ready itself can find."""
        counter, full = self._counter(number)
        count = store.add(counter, 0)
        while 0 <= count < full:  # others may add meanwhile: then try again from what they made it
            count = int(store.compare_set(counter, str(count), str(GIVEN_UP)))
        if count != full:
            store.set(self._done(number), "0")  # the others' waits for the outcome end now
        self.watch(store).say_trouble()  # the others' waits on their peers end at their next look
        return count == full

    # -- the next generation ------------------------------------------------------------------------------

    def agree_on_survivors(self, store) -> tuple[int, ...]:
        """Collective over the survivors: the members that go on, the same tuple on each of them. Each appends its rank
        to one list; the first of them decides once every member is on it or known gone (its watcher said so, or
        after ORPHAN_AFTER its own probe: a member whose watcher is lost too), or the membership timeout passed. The
        others look for the decision, and read the list only now and then (the first of them may be lost too)."""
        me = dist.get_rank()
        decision, listed = self._key("next"), self._key("alive")
        store.append(listed, f"{me},")
        watch, timeout = self.watch(store), membership_timeout()
        started = time.monotonic()
        deadline, say_at, read_at = started + timeout, started + AWAITED_SAY_EVERY, started
        while not store.check([decision]):
            now = time.monotonic()
            if now >= read_at:
                alive = {int(rank) for rank in store.get(listed).decode().split(",") if rank}
                deciding = me == min(alive)
                read_at = now + (0.0 if deciding else AGREE_READ_EVERY)
            if deciding:
                gone = watch.gone()
                if now - started > ORPHAN_AFTER:
                    gone |= watch.probe(set(self.members) - alive - gone)
                settled = alive | gone
                if settled >= set(self.members) or now > deadline:
                    store.compare_set(decision, "", ",".join(map(str, sorted(alive))))
                    break
                if now > say_at:
                    say_at += AWAITED_SAY_EVERY
                    logger.warning("generation %d: waiting for rank(s) %s, alive but not yet regrouping (a slow "
                                   "step?), up to %.0f s (%s); then the others go on without them", self.number + 1,
                                   sorted(set(self.members) - settled), timeout, MEMBERSHIP_TIMEOUT_ENV)
            time.sleep(0.005 if deciding else 0.02)
        return tuple(int(r) for r in store.get(decision).decode().split(","))


_current: Generation | None = None
_followers: list = []  # weak methods called with each new generation: the models' and loaders' regroups
_commits = 0  # steps committed (or failed) in the current generation: every member counts the same
_undoing = False  # during recover(undone=True)
_admissions = 0  # admit_joiners() calls in the current generation: every member counts the same
_old_groups: list = []  # (group, left after a loss) of the generation before, released once the followers moved on
_freeing: queue.Queue | None = None  # groups unregistered, freed by their last holder: _free_when_last()
_wait_pool: concurrent.futures.ThreadPoolExecutor | None = None


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


def step_abandoned() -> bool:
    """Whether the step in flight cannot commit: a member gave it up (its exchange failed), or one is gone. A
    rank waiting on a collective asks this: a peer that gave up will never send what it waits for. One store read
    (watch.py: a counter that a step given up, or a member found gone, adds to)."""
    return current().watch(world.store()).troubled()


_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


def peer_gone(failure) -> bool:
    """Whether a collective's failure (an exception or its text) says a peer's connection went away: Gloo's
    words for a dead peer."""
    return any(words in str(failure).lower() for words in _PEER_GONE)


def wait_watching(ready, what: str, timeout: float) -> bool:
    """Call `ready(seconds)` (a wait of at most that long, True once done) until it says True; between waits of
    WATCH_EVERY seconds, raise PeerDiedError as soon as the step in flight was given up (a member gone, or another
    rank's exchange failed): a peer that left a Gloo collective never sends what this rank waits for, and the
    collective cannot be aborted (it is abandoned; nothing touches its buffers again). False once `timeout`
    seconds passed first."""
    deadline = time.monotonic() + timeout
    while not ready(min(WATCH_EVERY, max(0.0, deadline - time.monotonic()))):
        if step_abandoned():
            raise PeerDiedError(explain(f"{what} was given up", rank=dist.get_rank(),
                                        seen="a peer gone, or another rank's exchange failed",
                                        expected="every rank of the generation in it",
                                        fix="The ranks left regroup and redo the step (live recovery)."))
        if time.monotonic() >= deadline:
            return False
    return True


def waited_aside(work) -> concurrent.futures.Future:
    """work.wait() in a thread of a pool: for a collective whose own wait can be neither bounded nor polled. Gloo's
    reduce-scatter waits for its peers whatever the timeout given, and says it completed only once waited for;
    Gloo's point-to-point receive unbinds its buffer when a timed wait expires. The caller waits on the future, a
    bounded wait; a wait given up keeps its thread until the collective ends (a peer's failure or its timeout)."""
    global _wait_pool
    if _wait_pool is None:
        _wait_pool = concurrent.futures.ThreadPoolExecutor(max_workers=WAIT_THREADS, thread_name_prefix="phalanx-wait")
    return _wait_pool.submit(work.wait)


def timed_wait(work, aside: bool = False):
    """`wait(seconds)` for `work`: True once it completed, False when `seconds` passed first; raises what
    work.wait() raised otherwise. `aside`: waited in a thread aside (waited_aside), the bound kept here. The step
    guard's waits and watch() share it."""
    waiting = waited_aside(work) if aside else None

    def wait(seconds: float) -> bool:
        try:
            if waiting is not None:
                waiting.result(timeout=max(0.0, seconds))
            else:
                work.wait(timedelta(seconds=max(0.001, seconds)))
            return True
        except concurrent.futures.TimeoutError:
            return False
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            if not work.is_completed():
                return False
            work.wait()  # it completed as the wait gave up (seen in a fresh run): its own outcome, at once
            return True
    return wait


def watch(work, what: str, aside: bool = False) -> None:
    """work.wait() for an asynchronous collective, watched (wait_watching); a failure that says a peer's connection
    went away is PeerDiedError. `aside`: waited aside (waited_aside)."""
    wait = timed_wait(work, aside)

    def done_within(seconds: float) -> bool:
        try:
            return wait(seconds)
        except RuntimeError as exc:
            if not peer_gone(exc):
                raise
            raise PeerDiedError(explain(f"{what} lost a peer", rank=dist.get_rank(), seen=str(exc).splitlines()[0],
                                        expected="every rank of the generation",
                                        fix="The ranks left regroup and go on (live recovery).")) from None
    wait_watching(done_within, what, float("inf"))  # a Gloo collective ends at its group's timeout anyway


def wait_for(work, what: str, aside: bool = False) -> None:
    """work.wait(), watched for a lost peer when live recovery is on (watch; `aside`: see waited_aside)."""
    if live_recovery():
        watch(work, what, aside)
    else:
        work.wait()


def fail_step() -> None:
    """This rank's exchange of the step failed: no member applies it (see commit_step)."""
    global _commits
    number, _commits = _commits, _commits + 1
    current().fail_commit(world.store(), number)


def on_regroup(method) -> None:
    """Call bound method `method(generation)` on every new generation, while its object lives (in the order
    registered: the same on every rank when models and loaders are built in the same order)."""
    current()
    _followers.append(weakref.WeakMethod(method))


def recover(cause: BaseException, redoing: bool = False, undone: bool = False) -> Generation:
    """Collective over the survivors of a loss: the next generation (next_generation), then every model and
    loader that follows the generations regrouped onto it. `redoing`: the step in flight starts over (for the
    launcher's run summary). `undone`: the step whose micro-batch loop ended last was rolled back (a sharded
    optimizer's step that could not count everywhere): the loaders hand it out again (undoing())."""
    global _undoing
    started, before = time.monotonic(), current().members
    survivors = next_generation(cause)
    _undoing = undone
    try:
        regroup_followers(survivors.number, survivors.members, sorted(set(before) - set(survivors.members)),
                          started, redoing)
    finally:
        _undoing = False
    return survivors


def undoing() -> bool:
    """During recover(): whether the step last finished by the loop is to be redone (see recover's `undone`)."""
    return _undoing


def is_loss(failure: BaseException) -> bool:
    """Whether `failure` is a peer lost that the ranks left recover from (live recovery on)."""
    return live_recovery() and (isinstance(failure, PeerFailedError) or peer_gone(failure))


def again_after_loss(action, warning: str | None = None):
    """`action()`; with live recovery, when a peer is lost during it (PeerFailedError, or Gloo's words for a closed
    connection), the ranks left regroup (recover) and do it again. `warning`, formatted with `left` (how many ranks
    are left), is logged when that happens."""
    try:
        return action()
    except RuntimeError as lost:  # PeerFailedError is one
        if not is_loss(lost):
            raise
        survivors = recover(lost)
        if warning:
            logger.warning(warning.format(left=survivors.world_size))
        return action()


_mode: bool | None = None  # what say_mode() said: a loss recovered in-process (True) or by a restart (False)


def recovers_in_process() -> bool:
    """Whether this process said that a loss will be recovered in-process (say_mode): what only such a loop needs
    (a sharded optimizer's copies) is done from then on."""
    return _mode is True


def say_mode(live: bool, why: str) -> None:
    """Once per process: whether a loss will be recovered in-process or by a restart (said on the main rank,
    recorded on every rank for its launcher)."""
    global _mode
    if _mode is not None:
        return
    _mode = live
    if live and world.is_main() and current().number == 0:
        joining.count_ranks_from(world.store(), world.launch_world_size())  # before the launcher may let a node join
    progress.recovery(live)  # every rank: its launcher keeps the others after a loss only if they recover
    if not world.is_main():
        return
    if live:
        logger.info("live recovery on: a lost rank costs the step in flight while %s=%s ranks are left (%s)",
                    MIN_WORLD_ENV, min_world_size(), why)
        if membership_timeout() <= ddp_stall_seconds():
            logger.warning("%s=%g s is not above PHALANX_DDP_STALL_TIMEOUT=%g s: after a loss, a rank that is alive "
                           "but slower than that is dropped from the group before its own step would have reported "
                           "it; set it higher (default: the DDP stall timeout + %g s)", MEMBERSHIP_TIMEOUT_ENV,
                           membership_timeout(), ddp_stall_seconds(), MEMBERSHIP_MARGIN)
    else:
        logger.warning("live recovery off for this loop: %s; a lost rank fails the group, which restarts from its "
                       "newest checkpoint (under --max-restarts)", why)


def announce() -> None:
    """Say which process this rank is, for the survivors of a loss to tell at once that it is gone."""
    generation = current()
    world.store().set(generation._key("who", dist.get_rank()), identity())
    generation.watch(world.store())


def next_generation(cause: BaseException) -> Generation:
    """Collective over the survivors of the current generation: agree on who is left, meet on a new process
    group, and make it the current generation. Raises MembershipError when this rank was counted lost or
    fewer ranks are left than the minimum world size."""
    store, old = world.store(), current()
    started = time.monotonic()
    members = old.agree_on_survivors(store)
    me, minimum = dist.get_rank(), min_world_size() or 1
    lost = sorted(set(old.members) - set(members))
    if me not in members:
        raise MembershipError(explain(
            f"the other ranks went on without this one after generation {old.number}", rank=me,
            seen=f"survivors {list(members)}", expected=f"rank {me} among them",
            fix=f"The others counted it lost: cut off from them for the heartbeat window, or too slow to say it "
                f"was alive ({MEMBERSHIP_TIMEOUT_ENV}={membership_timeout():g} s). This rank ends; its launcher "
                f"starts it again to join (under --max-restarts, or --nnodes MIN:MAX).")) from cause
    if len(members) < minimum:
        raise MembershipError(explain(
            f"too few ranks are left to go on after losing ranks {lost}", rank=me,
            seen=f"{len(members)} left: {list(members)}", expected=f"at least {MIN_WORLD_ENV}={minimum}",
            fix="The run falls back to a restart from its newest checkpoint.")) from cause
    _meet(old.number + 1, members, "the ranks left", abandoned=True)
    if _current.rank == 0:
        logger.warning("lost ranks %s (%s): %d ranks go on in generation %d, regrouped in %.3f s", lost,
                       type(cause).__name__, len(members), _current.number, time.monotonic() - started)
    return _current


def _meet(number: int, members: tuple[int, ...], who: str, abandoned: bool = False) -> None:
    """Collective over `members`: make generation `number`'s process groups (by name: joiners take part, whose
    default group is not the others', joining.py) and make it the current generation. The groups before are
    released after the regroup (_release_old_groups). `abandoned`: after a loss (a collective on them may still
    wait on the lost rank: shutdown() then leaves the groups not yet freed to the process's exit)."""
    global _current, _commits, _admissions
    # The groups are made with a short timeout (every member agreed moments ago, so all are making them now), then
    # given the membership timeout for their collectives: a member lost while they are made (a second loss within
    # the regroup) would otherwise hold the others in Gloo's connection set-up, which cannot be watched, for that long.
    connect = timedelta(seconds=min(membership_timeout(), REGROUP_CONNECT_SECONDS))
    name = f"phalanx/{world.attempt()}/generation{number}"
    try:
        group = joining.make_group(members, f"{name}/main", connect)
        control = joining.make_group(members, f"{name}/control", connect, backend="gloo")
    except RuntimeError as exc:
        raise MembershipError(explain(
            f"{who} could not make generation {number}'s process group", rank=dist.get_rank(),
            seen=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} (members {list(members)})",
            expected=f"every member connected within {connect.total_seconds():g} s",
            fix="A member was lost while the others regrouped: the run falls back to a restart from its newest "
                "checkpoint.")) from exc
    for made in (group, control):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=membership_timeout()), made)
    before = current()  # generation 0 registered its end-of-run reset
    _old_groups.extend((g, abandoned) for g in (before.group, world.control_group())
                       if g is not None and g != dist.group.WORLD)
    before.close_watch()
    _current, _commits, _admissions = Generation(number, tuple(members), group), 0, 0
    world.set_live(_current.number, _current.members, group, control, abandoned)
    world.store().set(_current._key("who", dist.get_rank()), identity())
    _current.watch(world.store())


# -- ranks that join (joining.py) --------------------------------------------------------------------


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


def admit_joiners() -> tuple[int, ...]:
    """Collective over the current generation, at a step every member agreed on (the checkpointer's agreement saw
    joiners waiting): the ranks ready to join are taken in, and the next generation is the members and them.
    Returns the joiners (none: nobody was ready after all)."""
    global _admissions
    store, old = world.store(), current()
    decision = old._key("joined", _admissions)
    _admissions += 1
    if old.rank == 0:
        ready = [rank for rank in joining.ready_ranks(store, world.launch_world_size()) if rank not in old.members]
        text = ",".join(map(str, ready)) or "-"
        if store.compare_set(decision, "", text) == text.encode():  # decided here (the first writer wins)
            for rank in ready:
                store.delete_key(joining.ready_key(rank))
            store.add(joining.WAITING, -len(ready))
    store.wait([decision], timedelta(seconds=membership_timeout()))
    text = store.get(decision).decode()
    joiners = tuple(int(rank) for rank in text.split(",")) if text != "-" else ()
    if not joiners:
        return ()
    members = tuple(sorted(old.members + joiners))
    if old.rank == 0:
        for rank in joiners:
            store.set(joining.admitted_key(rank), f"{old.number + 1}:{','.join(map(str, members))}:"
                                                  f"{','.join(map(str, joiners))}")
    _meet(old.number + 1, members, "the ranks that train and the ones joining")
    return joiners


def join_run() -> tuple[Generation, tuple[int, ...]]:
    """A joiner: say it is ready, wait until the ranks that train take it in at a step boundary (up to
    PHALANX_JOIN_TIMEOUT), and meet them on the generation that takes it in. Returns it, and the ranks it took
    in (this one among them)."""
    store, me = world.store(), dist.get_rank()
    store.set(joining.ready_key(me), identity())
    store.add(joining.WAITING, 1)
    started = time.monotonic()
    deadline, say_at = started + joining.join_timeout(), started + AWAITED_SAY_EVERY
    while not _admitted(store, me):
        now = time.monotonic()
        if now > deadline:
            raise MembershipError(explain(
                "this rank was not taken into the run it was started to join", rank=me,
                seen=f"no answer within {joining.join_timeout():g} s ({joining.JOIN_TIMEOUT_ENV})",
                expected="the ranks that train taking it in at their next step boundary (checkpointer.step())",
                fix="The others may be stopping, or their loop does not call checkpointer.step(state); its launcher "
                    "starts it again to join."))
        if now > say_at:
            say_at += AWAITED_SAY_EVERY
            logger.info("rank %d: waiting %.0f s so far to be taken into the run at a step boundary", me,
                        now - started)
        time.sleep(0.01)
    number, members, joiners = store.get(joining.admitted_key(me)).decode().split(":")
    _meet(int(number), tuple(int(rank) for rank in members.split(",")), "a joining rank")
    joining.set_pending(False)
    return _current, tuple(int(rank) for rank in joiners.split(","))


def _admitted(store, me: int) -> bool:
    try:
        if store.check([joining.admitted_key(me)]):
            return True
        if store.check([joining.CLOSED]):
            logger.warning("rank %d: %s", me, joining.RunFinished())
            raise joining.RunFinished()
        return False
    except RuntimeError as exc:  # the store's host is gone: the run ended (or its master node was lost)
        raise MembershipError(explain(
            "the run this rank was started to join ended before it was taken in", rank=me,
            seen=f"its store no longer answers ({type(exc).__name__})", expected="the run in progress",
            fix="Nothing to do if the run finished; else start it again (its newest checkpoint).")) from None


def regroup_followers(number: int, members, lost, started: float, redoing: bool = False, joined=(),
                      healed: tuple[int, float] | None = None) -> None:
    """Every model and loader that follows the generations regrouped onto the current one, and the change
    recorded for the launcher's run summary."""
    _followers[:] = [ref for ref in _followers if ref() is not None]
    for ref in list(_followers):
        method = ref()
        if method is not None:
            method(_current)
    _release_old_groups()
    progress.regrouped(number, members, lost, time.monotonic() - started, redoing, joined=list(joined),
                       healed=healed)


def _release_old_groups() -> None:
    """Release the process groups of the generation before, now that every follower moved off them: each Gloo group
    that was used holds ~3 MB (its pairs' buffers) and its sockets until it is freed, which over many losses is
    what a long run would grow by. torch forgets them here (destroy_process_group: it does not wait for their
    collectives); they are freed by the thread of _free_when_last, which a collective still waiting on a lost rank
    holds up until it ends (at once for a process gone, the group's timeout for a host cut off): freeing a group waits
    for its collectives, in C++ and without the GIL, so that the step goes on meanwhile. A generation replaced by a
    larger one (ranks joined) left nothing pending: its groups are freed at once. Those left after a loss are
    aborted, not shut down: NCCL's shutdown waits for kernels that may wait on the lost rank for ever, its abort
    ends them (Gloo's changes nothing: its collectives end by the timeout)."""
    global _freeing
    while _old_groups:
        group, lost = _old_groups.pop()
        try:
            (_abort_process_group if lost else dist.destroy_process_group)(group)
        except Exception as exc:  # torch's registry without it already
            logger.debug("an old generation's group was not unregistered: %s", exc)
        if _freeing is None:
            _freeing = queue.Queue()
            threading.Thread(target=_free_when_last, args=(_freeing,), name="phalanx-free-groups", daemon=True).start()
        _freeing.put(group)
        del group  # the thread's reference is to be the last


# torch's abort of one group (it unregisters it as destroy_process_group does); private, so looked up with a fallback
_abort_process_group = getattr(dist.distributed_c10d, "_abort_process_group", dist.destroy_process_group)


def _free_when_last(groups: queue.Queue, every: float = 0.2) -> None:
    """Hold each group until no other reference is left (a follower's attribute, a traceback's frame), then drop
    it here: the last reference's holder is the thread that waits for the group's collectives in its destructor."""
    held: list = []
    while True:
        try:
            held.append(groups.get(timeout=every if held else None))
        except queue.Empty:
            pass
        for index in range(len(held) - 1, -1, -1):
            if sys.getrefcount(held[index]) <= 2:  # the list's reference and the argument's: no other holder
                del held[index]


def lost_since(members) -> set[int]:
    """Which of `members` (the ranks of this generation or of an earlier one) are lost: no longer among the ranks
    that train, or known gone. Empty without live recovery."""
    if not live_recovery():
        return set()
    return (set(members) - set(current().members)) | _lost_among(members)


def _lost_among(ranks) -> set[int]:
    """Which of `ranks` are known gone, with live recovery on (world.barrier asks)."""
    return current().gone(world.store()) & set(ranks) if live_recovery() else set()


world.lost_among = _lost_among
world.start_solo = start_solo


def forget() -> None:
    """At shutdown, after the last collectives: the next init() starts at generation 0 again."""
    global _current, _commits
    if _current is not None:
        _current.close_watch()
    _current, _commits = None, 0
    _followers.clear()
    _old_groups.clear()  # shutdown() destroys every group left


world.forget_generations = forget
