"""A regroup's two Gloo groups as the survivors make them, for control_plane_units.py's clients (one per namespace
host, on the one store): `group[N]` with full-mesh groups (each rank reads every member's address from the store and
connects every pair as the group is made), `group_lazy[N]` with the generations' lazy groups (generations/current.py
generation_group: made with TORCH_GLOO_LAZY_INIT, then a message each way between ring neighbours and a broadcast
from rank 0 connect the pairs of a ring all-reduce and of that broadcast, each rank reading only those peers'
addresses: joining.connect_lazy).
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

from phalanx.world.generations.agreement import DECISION_LOOK as AGREE_POLL  # a survivor's looks at the decision


def made(client, store, lazy: bool):
    """One group among the clients, connected as a regroup leaves it."""
    from phalanx.world.joining import connect_lazy, gloo_lazy

    with gloo_lazy(lazy):
        group = client.dist.ProcessGroupGloo(store, client.index, client.count, timedelta(seconds=120))
    if lazy:  # generation_group's connect: the pairs of a ring all-reduce and of a broadcast from rank 0
        connect_lazy(group)
    return group


def groups(client, rounds: int, lazy: bool, tcp_counters) -> tuple[list[tuple], tuple, object]:
    """(decided, main made, control made) per round: a regroup's two groups as the survivors make them (each polls
    the decision every AGREE_POLL s, then makes the main group, then the control group); then an untimed round's
    (connections opened, segments sent, store segments both ways): `ss`'s start in every client takes the CPU from
    the groups. Groups are kept to the end: one freed tears its pairs down (a regroup's, after its followers:
    generations/release.py). And the last one. `tcp_counters()`: the host's TCP counters."""
    kind = "lazy" if lazy else "group"
    found, kept, counts = [], [], ()
    for number in range(rounds + 1):
        client.barrier(f"{kind}{number}")
        decision = client.key(kind, number, "decision")
        if number == rounds:
            before, store_before = tcp_counters(), client.store_segments()
        if client.index == 0:
            time.sleep(2 * AGREE_POLL)  # the others poll by then
            client.store.set(decision, repr(time.monotonic()))
        while not client.store.check([decision]):
            time.sleep(AGREE_POLL)
        decided, times = float(client.store.get(decision)), []
        for name in ("main", "control"):
            kept.append(made(client, client.dist.PrefixStore(client.key(kind, number, name), client.store), lazy))
            times.append(time.monotonic())
        if number == rounds:
            after, store_after = tcp_counters(), client.store_segments()
            counts = (after["ActiveOpens"] - before["ActiveOpens"], after["OutSegs"] - before["OutSegs"],
                      store_after - store_before)
        found += [(decided, *times)][:rounds - number]  # the timed rounds'
        client.barrier(f"{kind}{number}-made")
    return found, counts, kept[-1]


def gather(units: dict, count: int, results: list[dict], name: str) -> None:
    """units[name][count]: the rounds' `first` (the decision to the last client's main group) and `second` (to its
    control group), medians; one group's connections opened and segments sent, all clients together, and the
    segments on their store connections, both ways."""
    rounds = list(zip(*(r[name] for r in results)))  # per round, per client: (decided, main, control)
    units.setdefault(name, {})[count] = {
        "first": statistics.median(max(g[1] for g in r) - r[0][0] for r in rounds),
        "second": statistics.median(max(g[2] for g in r) - max(g[1] for g in r) for r in rounds),
        "connections": sum(r[f"{name}_counts"][0] for r in results) / 2,
        "segs": sum(r[f"{name}_counts"][1] for r in results) / 2,
        "store_segs": sum(r[f"{name}_counts"][2] for r in results) / 2,
        "rounds": [[max(g[1] for g in r) - r[0][0], max(g[2] for g in r) - max(g[1] for g in r)] for r in rounds]}
