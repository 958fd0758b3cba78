"""How a full bucket becomes its average: the `BucketExchange` interface and its implementations.

`base.py` is the interface the reducer calls (`launch` during backward, `deliver` at its end); each
implementation is a module of its own: `all_reduce.py` (the process group), `comm_hook.py` (a user's
hook), `shm.py` (shared memory on one host, with `shm_copy_in.py`), `sharded.py` and `shm_sharded.py`
(reduce-scatter, all-gather after the step). `phase_timer.py` times every exchange's phases.
`choose.py` is the one place that picks an exchange: a new transport is a module here plus a line
there, and the DDP front does not change.

May import: bucket, shm, diagnose, errors, log.
"""
