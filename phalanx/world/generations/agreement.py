"""The survivors' agreement on the next generation, after a loss.

Every survivor says it is alive; once each member has either said so or is known gone (or the membership timeout
passed), the first proposal stored is the next generation. The survivors then meet on its process groups, with their
old ranks in their old order (current.meet), and enter it only once every member made them (groups_formed): a member
lost between the decision and the groups (a host's ranks dying one after another) fails them on its neighbours only,
and the others would go on into a generation that holds it. Then they all agree again, without it, up to
FORM_ATTEMPTS times.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta

import torch.distributed as dist

from ...errors import MembershipError, explain
from ...log import logger
from .. import group as world
from .commit import give_up_counter
from .current import Generation, GroupsNotFormed, current, meet
from .settings import (
    AGREE_READ_EVERY,
    AWAITED_SAY_EVERY,
    MEMBERSHIP_TIMEOUT_ENV,
    MIN_WORLD_ENV,
    ORPHAN_AFTER,
    membership_timeout,
    min_world_size,
)

DECIDER_LOOK = 0.005  # seconds between the deciding survivor's looks at who is alive
DECISION_LOOK = 0.02  # seconds between the other survivors' looks at the decision
FORM_ATTEMPTS = 3  # agreements on the next generation, each after its groups failed on a member lost meanwhile
FORM_LOOK = 0.5  # seconds between a member's looks at who is gone while it waits for the others' groups (a wait that
# times out is logged by torch: the others' groups mostly come within the first; one that failed ends the wait at once)


def agree_on_survivors(generation: Generation, store, attempt: int = 0) -> tuple[int, ...]:
    """Collective over the survivors of `generation`: the members that go on, the same tuple on each of them. Each
    says which step it applied last (for the ranks in doubt about one: commit.py), then appends its rank to one
    list; the first of them decides once every member is on it or known gone (its watcher said so, or after
    ORPHAN_AFTER its own probe: a member whose watcher is lost too), or the membership timeout passed. The others
    look for the decision, and read the list only now and then (the first of them may be lost too). `attempt`: the
    agreement's number after the groups of the ones before failed (keys of its own)."""
    me = dist.get_rank()
    suffix = f"-{attempt}" if attempt else ""
    decision, listed = generation._key("next" + suffix), generation._key("alive" + suffix)
    if not attempt:
        generation.say_applied(store)  # first: a rank in doubt about the last step learns from it (commit.py)
    store.append(listed, f"{me},")
    watch, timeout = generation.watch(store), membership_timeout()
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
                gone |= watch.probe(set(generation.members) - alive - gone)
            settled = alive | gone
            if settled >= set(generation.members) or now > deadline:
                # a member that said it is alive and then was found gone (its host's ranks killed one after another)
                # is left out now: kept in, it would fail the new groups' connect, and the run would restart
                store.compare_set(decision, "", ",".join(map(str, sorted(alive - gone))))
                break
            if now > say_at:
                say_at += AWAITED_SAY_EVERY
                logger.warning("generation %d: waiting for rank(s) %s, alive but not yet regrouping (a slow "
                               "step?), up to %.0f s (%s); then the others go on without them", generation.number + 1,
                               sorted(set(generation.members) - settled), timeout, MEMBERSHIP_TIMEOUT_ENV)
        time.sleep(DECIDER_LOOK if deciding else DECISION_LOOK)
    return tuple(int(r) for r in store.get(decision).decode().split(","))


def next_generation(cause: BaseException) -> Generation:
    """Collective over the survivors of the current generation: agree on who is left, meet on a new process
    group, and make it the current generation. Raises MembershipError when this rank was counted lost or
    fewer ranks are left than the minimum world size, or when the groups could not be made FORM_ATTEMPTS times."""
    store, old = world.store(), current()
    started = time.monotonic()
    for attempt in range(FORM_ATTEMPTS):
        members = agree_on_survivors(old, store, attempt)
        _check_left(members, old, cause)
        try:
            meet(old.number + 1, members, "the ranks left", abandoned=True, attempt=attempt,
                 formed=functools.partial(groups_formed, old, store, members, attempt))
            break
        except GroupsNotFormed as failure:
            if attempt + 1 == FORM_ATTEMPTS:
                raise
            logger.warning("generation %d: its groups were not made on every member of %s (%s): the ranks left "
                           "agree again", old.number + 1, list(members), str(failure).splitlines()[0])
    survivors = current()
    if survivors.rank == 0:
        logger.warning("lost ranks %s (%s): %d ranks go on in generation %d, regrouped in %.3f s",
                       sorted(set(old.members) - set(members)), type(cause).__name__, len(members), survivors.number,
                       time.monotonic() - started)
    return survivors


def _check_left(members: tuple[int, ...], old: Generation, cause: BaseException) -> None:
    """Raise MembershipError when this rank is not among `members`, or fewer are left than the minimum."""
    me, minimum = dist.get_rank(), min_world_size() or 1
    if me not in members:
        raise MembershipError(explain(
            f"the other ranks went on without this one after generation {old.number}", rank=me,
            seen=f"survivors {list(members)}", expected=f"rank {me} among them",
            fix=f"The others counted it lost: cut off from them for the heartbeat window, or too slow to say it "
                f"was alive ({MEMBERSHIP_TIMEOUT_ENV}={membership_timeout():g} s). This rank ends; its launcher "
                f"starts it again to join (under --max-restarts, or --nnodes MIN:MAX).")) from cause
    if len(members) < minimum:
        lost = sorted(set(old.members) - set(members))
        raise MembershipError(explain(
            f"too few ranks are left to go on after losing ranks {lost}", rank=me,
            seen=f"{len(members)} left: {list(members)}", expected=f"at least {MIN_WORLD_ENV}={minimum}",
            fix="The run falls back to a restart from its newest checkpoint.")) from cause


def groups_formed(old: Generation, store, members: tuple[int, ...], attempt: int, made: bool) -> bool:
    """Collective over `members`, once each made the next generation's groups or failed to (`made`): whether every
    one made them, the same answer on each. A counter each adds 1 to once its groups are made; the member whose add
    fills it says so, and the others wait for that. A member that could not make them, or that finds a member gone
    while it waits (at its looks, every FORM_LOOK seconds), gives the counter up (commit.give_up_counter, as a
    generation's first steps are): every member reads the same outcome."""
    counter, done = old._key("formed", attempt), old._key("formed", attempt, "done")
    if made:
        if store.add(counter, 1) == len(members):
            store.set(done, "1")
            return True
        # The key only the last add and a give-up set: a verdict about the loss being recovered from, which may come
        # late from another watcher, must not end this wait (it sets the commit's keys, Generation.in_flight).
        watch, deadline = old.watch(store), time.monotonic() + membership_timeout()
        while not watch.gone() & set(members) and time.monotonic() < deadline:
            try:
                store.wait([done], timedelta(seconds=FORM_LOOK))
                break
            except dist.DistStoreError:  # not yet: look again at who is gone
                continue
    return give_up_counter(store, counter, len(members), done)
