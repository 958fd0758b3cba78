"""Hosts emulated on one machine: a rank says it runs on host `rank // per_host` both where its peers read it (its
identity, by which the generation's watch groups the members) and where its launcher says it (its local rank and
local world size, from which the per-step commit's board takes its host's ranks: world/generations/host_board.py).
Call it before the rank says who it is (generation.announce())."""

from __future__ import annotations

import dataclasses

from phalanx.world import liveness
from phalanx.world.process import identity


def emulate_host(rank: int, per_host: int) -> None:
    liveness._host = lambda: f"emulated-host-{rank // per_host}"
    identity._spec = dataclasses.replace(identity._spec, local_rank=rank % per_host, local_world_size=per_host)
