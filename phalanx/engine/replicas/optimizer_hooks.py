"""How an optimizer's steps reach the replica audit of the model it steps: one global pre-hook, one post-hook.

torch calls both around every `step()` of every optimizer. An optimizer is the model's when it holds one of
the model's parameters (found once per optimizer, again when its parameter count changes); a sharded
model's optimizer, which holds pieces of them, is claimed by name (`claim`). A process with no audit pays a
dictionary lookup per step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> weakref to the audit of its model
_claimed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> weakref to the audit it was claimed for
_found: WeakIdKeyDictionary = WeakIdKeyDictionary()  # optimizer -> (its parameter count, [weakrefs to audits])
_handles: list = []


def watch(audit, params: list[torch.Tensor]) -> None:
    """Steps of optimizers holding any of `params` reach `audit` (held weakly)."""
    reference = weakref.ref(audit)
    for p in params:
        _owner[p] = reference
    _found.clear()
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before))
        _handles.append(register_optimizer_step_post_hook(_after))


def claim(optimizer: torch.optim.Optimizer, audit) -> None:
    """`optimizer` steps `audit`'s model though it holds none of its parameters (a ShardedOptimizer's wrapped
    optimizer, over pieces): its pre-hook reaches the audit; its step's end is the ShardedOptimizer's to say."""
    _claimed[optimizer] = weakref.ref(audit)
    _found.pop(optimizer, None)


def audits_of(optimizer: torch.optim.Optimizer) -> list:
    """The live audits whose models `optimizer` steps."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    found = _found.get(optimizer)
    if found is None or found[0] != count:
        references = []
        claimed = _claimed.get(optimizer)
        if claimed is not None:
            references.append(claimed)
        for group in optimizer.param_groups:
            for p in group["params"]:
                reference = _owner.get(p)
                if reference is not None and reference not in references:
                    references.append(reference)
        found = _found[optimizer] = (count, references)
    return [audit for audit in (reference() for reference in found[1]) if audit is not None]


def _before(optimizer, args, kwargs) -> None:
    for audit in audits_of(optimizer):
        audit.before_optimizer_step(optimizer)


def _after(optimizer, args, kwargs) -> None:
    if optimizer in _claimed:  # the ShardedOptimizer's step goes on (its all-gather): it calls the audit itself
        return
    for audit in audits_of(optimizer):
        audit.after_optimizer_step(optimizer)
