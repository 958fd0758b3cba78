"""Joining the world: the environment read (discovery), where processes first meet (meeting/: the rendezvous store,
the launchers' meetings, an srun step's nodes), the network interface between hosts (interface.py), the process
group, the generations of live recovery, the step the run is at (step_count.py), and the stop requests that reach
the process (stop.py).

`group.py` holds `init()` / `shutdown()` and the rank helpers that `phalanx` re-exports (their parts: process/);
`generation.py`, live recovery's generations (their parts: generations/).

May import: diagnose, allocator, shm, errors, log.
"""

from .group import (
    barrier,
    before_shutdown,
    collective_device,
    device,
    group_rank,
    group_size,
    init,
    is_initialized,
    is_main,
    launch_rank,
    launch_world_size,
    live_group,
    local_rank,
    local_world_size,
    rank,
    run_before_shutdown,
    shutdown,
    store,
    usable_cores,
    world_size,
)
