"""Where a sharded model waits for its parameter all-gather: in the forward that first needs each bucket.

After the optimizer step the all-gathers of the buckets run in the background (on a process group),
first layers first; a forward pre-hook on every module with parameters of its own waits for the
buckets holding them, so the later layers' transfers overlap the first layers' compute. A state-dict
pre-hook completes all of them before the model is saved.
"""

from __future__ import annotations

import weakref

import torch

from ..exchange.sharded import ShardedExchange


def install_gather_waits(module: torch.nn.Module, sharded: ShardedExchange) -> list:
    """Register the waits for `sharded`'s all-gathers on `module` and its submodules; returns the hooks' handles."""
    exchange = weakref.ref(sharded)  # a deep copy of the model copies its hooks, not the exchange
    bucket_of = {id(p): bucket.index for bucket in sharded.buckets for p in bucket.params}

    def waiter(indices: list[int]):
        def wait_for_parameters(_module, _inputs):
            target = exchange()
            if target is not None and target.gathering:
                target.wait_gathered(indices)
        return wait_for_parameters

    handles = []
    for sub in module.modules():
        indices = sorted({bucket_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in bucket_of})
        if indices:
            handles.append(sub.register_forward_pre_hook(waiter(indices)))

    def complete_before_saving(*_args, **_kwargs):
        target = exchange()
        if target is not None:
            target.wait_gathered()
    handles.append(module.register_state_dict_pre_hook(complete_before_saving))
    return handles
