"""The process's place in the world: `init()` / `shutdown()`, the rank helpers, `barrier()`.

This module is the face the rest of phalanx calls (and `phalanx` re-exports); each part is a file of process/: what a
process brings (its device, backend, CPU threads, timeouts), who it was launched as, the ranks it trains with now and
the barrier among them, and how it joins and leaves the world.
"""

from __future__ import annotations

from .process.identity import (
    attempt,
    device,
    is_initialized,
    launch_rank,
    launch_world_size,
    local_rank,
    local_world_size,
    store,
)
from .process.lifecycle import before_shutdown, init, run_before_shutdown, shutdown
from .process.live import (
    DEAD_CHECK_AFTER,
    SHUTDOWN_WAIT,
    barrier,
    control_group,
    group_rank,
    group_size,
    is_main,
    live_generation,
    live_group,
    live_members,
    rank,
    set_live,
    world_size,
)
from .process.resources import DEFAULT_CONNECT_TIMEOUT, DEFAULT_TIMEOUT, collective_device, usable_cores

__all__ = [
    "DEAD_CHECK_AFTER", "DEFAULT_CONNECT_TIMEOUT", "DEFAULT_TIMEOUT", "SHUTDOWN_WAIT", "attempt", "barrier",
    "before_shutdown", "collective_device", "control_group", "device", "group_rank", "group_size", "init",
    "is_initialized", "is_main", "launch_rank", "launch_world_size", "live_generation", "live_group", "live_members",
    "local_rank", "local_world_size", "rank", "run_before_shutdown", "set_live", "shutdown", "store", "usable_cores",
    "world_size",
]
