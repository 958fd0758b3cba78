"""DDP under distributed autograd (RPC): `dist_autograd.backward` averages the gradients in the context.

On 2 ranks with RPC up, each step runs the same batch twice: forward and `dist_autograd.backward`
inside a context, then an ordinary forward and backward. The context's gradients must equal the
ordinary DDP gradients (averaged over ranks), and the distributed backward must leave `.grad` alone.
torch's own tests of this (tests/e2e/test_torch_ddp_suite.py) cover plain models; here also
gradient_as_bucket_view and parameters used on one rank only.
"""

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

import phalanx
from phalanx.testing import free_port, run_ranks

CONFIGS = {"default": {}, "as_view": {"gradient_as_bucket_view": True},
           "unused": {"find_unused_parameters": True},
           "unused_as_view": {"find_unused_parameters": True, "gradient_as_bucket_view": True}}


class Branchy(nn.Module):
    """`left` is used on rank 0 only, `right` on the other ranks (when `branchy`)."""

    def __init__(self, branchy: bool):
        super().__init__()
        self.trunk, self.left = nn.Linear(6, 16), nn.Linear(16, 2)
        self.right = nn.Linear(16, 2) if branchy else None

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.right(h) if self.right is not None and torch.distributed.get_rank() != 0 else self.left(h)


def _compare(rank: int, port: int) -> dict:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    out = {}
    try:
        for name, kwargs in CONFIGS.items():
            torch.manual_seed(0)
            model = phalanx.DistributedDataParallel(Branchy("unused" in name), **kwargs)
            worst, untouched = 0.0, True
            for step in range(3):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
                before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                with dist_autograd.context() as context_id:
                    dist_autograd.backward(context_id, [model(x).sum()])
                    in_context = dist_autograd.get_gradients(context_id)
                untouched &= all((b is None and p.grad is None) or (b is not None and torch.equal(b, p.grad))
                                 for b, p in zip(before, model.parameters()))
                model.zero_grad()
                model(x).sum().backward()
                for p in model.parameters():
                    if p in in_context:  # a parameter unused here has no entry (docs/ddp.md)
                        worst = max(worst, (in_context[p] - p.grad).abs().max().item())
            out[name] = {"diff": worst, "untouched": untouched}
    finally:
        rpc.shutdown()
    return out


@pytest.fixture(scope="module", params=["shm", "process group"])
def results(request):
    env = {"PHALANX_SHM": "0"} if request.param == "process group" else {}
    return run_ranks(_compare, 2, (free_port(),), timeout=180, env=env)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_context_gradients_are_the_ddp_average_and_grad_is_left_alone(results, config):
    for rank, per_rank in enumerate(results):
        assert per_rank[config]["diff"] < 1e-6, f"rank {rank}: {config} differs by {per_rank[config]['diff']:.3g}"
        assert per_rank[config]["untouched"], f"rank {rank}: {config}: the distributed backward changed .grad"
