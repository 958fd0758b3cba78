"""DDP under torch's distributed autograd (RPC): `dist_autograd.backward` inside a `dist_autograd.context()`.

There the gradients go into the context, never into `param.grad`, and AccumulateGrad's tensor hooks
(register_post_accumulate_grad_hook, what the reducer counts with) do not run; the AccumulateGrad
nodes' own post hooks do. So a DDP forward run inside a context has the reducer hook those nodes
(once, on first use: a model never used this way pays nothing), and at the end of that backward
the context's gradients stand in for `param.grad` while the buckets are exchanged, as torch's
reducer reads and writes them in the context.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed.autograd as dist_autograd

try:
    from torch._C._distributed_rpc import _is_current_rpc_agent_set
except ImportError:  # a torch built without RPC has no distributed autograd either
    def _is_current_rpc_agent_set() -> bool:
        return False


def current_context() -> int | None:
    """The id of the distributed autograd context this thread is in, or None (then backward is local)."""
    if not _is_current_rpc_agent_set():  # contexts need RPC: the usual case costs one cheap call
        return None
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:  # RPC is up, but this thread is in no context
        return None


def accumulator_hooks(params: list[torch.Tensor], on_gradient) -> tuple[list, list]:
    """Post hooks on each parameter's AccumulateGrad node, calling `on_gradient(index)`. The nodes are
    held (as torch's reducer holds them): a node nobody holds is made anew, without hooks, next backward."""
    nodes = [torch.autograd.graph.get_gradient_edge(p).node for p in params]
    handles = [node.register_hook(_call(on_gradient, i)) for i, node in enumerate(nodes)]
    return nodes, handles


def _call(on_gradient, index: int):
    def hook(_grad_inputs, _grad_outputs):
        on_gradient(index)
    return hook


@contextmanager
def context_gradients(params: list[torch.Tensor], context_id: int):
    """Inside: each parameter's `.grad` is its gradient in the context (None if it got none), so the
    exchange averages them where they are. After: results written into the context, `.grad` restored."""
    found = dist_autograd.get_gradients(context_id)  # the context's own tensors: written in place
    own = [p.grad for p in params]
    theirs = [found.get(p) for p in params]
    for p, grad in zip(params, theirs):
        p.grad = grad
    try:
        yield
    finally:
        for p, grad, kept in zip(params, theirs, own):
            if grad is not None and p.grad is not None and p.grad is not grad:  # replaced (a bucket view)
                grad.copy_(p.grad)
            p.grad = kept
