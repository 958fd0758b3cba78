"""phalanx DDP against torch DDP on 2 ranks: same model, data and seeds give the same parameters,
and phalanx's replicas are bitwise identical after every step. Comm hooks (torch's stock ones and
phalanx.hooks) stay within compression tolerance of the run without a hook.

One spawned run trains every configuration; the tests read its results.
"""


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import phalanx
from phalanx.testing import run_ranks
from tests.helpers.ddp_cases import Branchy, cnn_bn, replicas_identical

STEPS = 10


class MixedDtypes(nn.Module):
    """A float32 layer feeding float64 layers: gradients of two dtypes."""

    def __init__(self):
        super().__init__()
        self.low = nn.Linear(8, 32)
        self.high = nn.Sequential(nn.Tanh(), nn.Linear(32, 32).double(), nn.Tanh(), nn.Linear(32, 4).double())

    def forward(self, x):
        return self.high(self.low(x).double())


class TwoBranches(nn.Module):
    """The order of the sum decides which branch's gradients arrive first: ranks differ."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, a_first: bool):
        if a_first:
            first = 2 * self.a(x)
            return first + self.b(torch.tanh(x))
        second = self.b(torch.tanh(x))
        return 2 * self.a(x) + second


def _model(config: str) -> nn.Module:
    torch.manual_seed(7)
    if config == "rank_order":
        return TwoBranches()
    if config == "cnn_bn_train":
        return cnn_bn()
    if config in ("unused", "unused_as_view"):
        return Branchy()
    if config == "mixed_dtypes":
        return MixedDtypes()
    if config == "bf16_params":  # half-precision gradients: summed as bf16 by both transports
        return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(),
                             nn.Linear(512, 4)).to(torch.bfloat16)
    if config in ("large", "large_as_view"):  # large and small gradients in one bucket
        return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 4))
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _loss(config: str, model, step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    if config == "cnn_bn_train":
        return F.cross_entropy(model(torch.randn(4, 3, 8, 8, generator=g)), torch.randint(0, 3, (4,), generator=g))
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    if config in ("unused", "unused_as_view"):
        return F.mse_loss(model(x, rank % 2 == 1), y)
    if config == "rank_order":
        return F.mse_loss(model(x, rank % 2 == 0), y)
    if config == "mixed_dtypes":
        return F.mse_loss(model(x), y.double())
    if config == "bf16_params":
        return F.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    if config == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        return F.mse_loss(out.float(), y)
    return F.mse_loss(model(x), y)


def _train(wrapper, config: str, rank: int, kwargs: dict, hook=None, make_state=lambda: None) -> tuple:
    model = wrapper(_model(config), **kwargs)
    calls = [0]
    if hook is not None:
        def counted(state, bucket):
            calls[0] += 1
            return hook(state, bucket)
        model.register_comm_hook(make_state(), counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if config == "autocast" else None
    identical = True
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(config, model, step, rank)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        identical &= replicas_identical(model.module)
    state = [t.detach().clone() for t in list(model.module.parameters()) + list(model.module.buffers())]
    grads_none = [p.grad is None for p in model.module.parameters()]
    return state, identical, calls[0], grads_none, model


CONFIGS = {
    "default": {}, "as_view": {"gradient_as_bucket_view": True}, "small_buckets": {"bucket_cap_mb": 0.002},
    "cnn_bn_train": {}, "unused": {"find_unused_parameters": True}, "mixed_dtypes": {}, "autocast": {},
    "rank_order": {}, "large": {}, "large_as_view": {"gradient_as_bucket_view": True},
    "bf16_params": {},
    # Buckets mixing gradients unused here (None), on no rank, and new ones: no in-place gradient to scale.
    "unused_as_view": {"find_unused_parameters": True, "gradient_as_bucket_view": True},
}
HOOKS = {
    "torch_allreduce": default_hooks.allreduce_hook, "torch_fp16": default_hooks.fp16_compress_hook,
    "torch_bf16": default_hooks.bf16_compress_hook, "phalanx_allreduce": phalanx.hooks.allreduce_hook,
    "phalanx_fp16": phalanx.hooks.fp16_compress_hook, "phalanx_bf16": phalanx.hooks.bf16_compress_hook,
}


def _powersgd_state():
    return powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=3)


def _max_diff(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _compare_everything(rank: int) -> dict:
    out = {}
    for config, kwargs in CONFIGS.items():
        ours, identical, _, none_ours, model = _train(phalanx.DistributedDataParallel, config, rank, kwargs)
        theirs, _, _, none_theirs, _ = _train(torch.nn.parallel.DistributedDataParallel, config, rank, kwargs)
        out[config] = {"diff": _max_diff(ours, theirs), "identical": identical, "same_none": none_ours == none_theirs,
                       "buckets": model._reducer.plan(),
                       "grad_storages": len({p.grad.untyped_storage().data_ptr() for p in model.parameters()
                                              if p.grad is not None})}
    plain, _, _, _, _ = _train(phalanx.DistributedDataParallel, "default", rank, {})
    for name, hook in HOOKS.items():
        ours, identical, calls, _, _ = _train(phalanx.DistributedDataParallel, "default", rank, {}, hook)
        theirs, _, _, _, _ = _train(torch.nn.parallel.DistributedDataParallel, "default", rank, {}, hook)
        out[name] = {"vs_plain": _max_diff(ours, plain), "vs_torch_same_hook": _max_diff(ours, theirs),
                     "identical": identical, "calls": calls}
    # A stateful hook that keys its state by bucket index and reads bucket.gradients()/parameters().
    ours, identical, calls, _, _ = _train(phalanx.DistributedDataParallel, "default", rank, {},
                                          powerSGD_hook.powerSGD_hook, _powersgd_state)
    theirs, _, _, _, _ = _train(torch.nn.parallel.DistributedDataParallel, "default", rank, {},
                                powerSGD_hook.powerSGD_hook, _powersgd_state)
    out["torch_powersgd"] = {"vs_torch_same_hook": _max_diff(ours, theirs), "identical": identical, "calls": calls}
    out["transport"] = "shm" if type(model._reducer.exchange).__name__ == "ShmExchange" else "process group"
    return out


# Every comparison runs over both transports: shared memory (the default on one host) and the
# process group's backend (Gloo), which is what ranks on several hosts use.
TRANSPORTS = {"shm": {}, "process group": {"PHALANX_SHM": "0"}}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def results(request):
    outcome = run_ranks(_compare_everything, 2, timeout=240, env=TRANSPORTS[request.param])
    assert [r["transport"] for r in outcome] == [request.param] * 2, "DDP did not use the expected transport"
    return outcome


@pytest.mark.parametrize("config", list(CONFIGS))
def test_phalanx_matches_torch_ddp(results, config):
    """World size 2, over shared memory and over the process group."""
    for rank, per_rank in enumerate(results):
        outcome = per_rank[config]
        assert outcome["diff"] < 1e-5, f"rank {rank}: {config} differs from torch DDP by {outcome['diff']:.3g}"
        assert outcome["identical"], f"rank {rank}: {config} replicas not bitwise identical after every step"
        assert outcome["same_none"], f"rank {rank}: {config} grads that stay None differ from torch's"


def test_gradient_as_bucket_view_shares_bucket_storage(results):
    """World size 2, over each transport."""
    as_view, copied = results[0]["as_view"], results[0]["default"]
    assert as_view["grad_storages"] == len(as_view["buckets"]), "each bucket's grads should live in its one buffer"
    assert copied["grad_storages"] > len(copied["buckets"]), "without the flag each grad owns its storage"


def test_rebuilt_buckets_follow_rank_0s_order_on_every_rank(results):
    """World size 2, over each transport."""
    plans = [per_rank["rank_order"]["buckets"] for per_rank in results]
    assert plans[0] == plans[1]
    # On rank 0 branch b's gradients arrive first: b is parameters 2 and 3.
    assert [i for bucket in plans[0] for i in bucket][:2] in ([3, 2], [2, 3])


def test_buckets_are_grouped_by_dtype(results):
    """World size 2, over each transport."""
    model = _model("mixed_dtypes")
    dtypes = [p.dtype for p in model.parameters()]
    for bucket in results[0]["mixed_dtypes"]["buckets"]:
        assert len({dtypes[i] for i in bucket}) == 1


def test_small_cap_gives_several_buckets_in_reverse_order(results):
    """World size 2, over each transport."""
    buckets = results[0]["small_buckets"]["buckets"]
    assert len(buckets) > 1
    flat = [i for bucket in buckets for i in bucket]
    assert flat == sorted(flat, reverse=True), "gradients arrive last layer first: buckets follow that order"


@pytest.mark.parametrize("hook", list(HOOKS))
def test_comm_hooks_stay_close_to_no_hook(results, hook):
    """World size 2, over each transport."""
    tolerance = {"allreduce": 1e-6, "fp16": 5e-4, "bf16": 3e-3}[hook.split("_")[1]]
    for rank, per_rank in enumerate(results):
        outcome = per_rank[hook]
        assert outcome["calls"] >= STEPS, f"rank {rank}: the hook was not used"
        assert outcome["vs_plain"] < tolerance, f"rank {rank}: {hook} is {outcome['vs_plain']:.3g} from no hook"
        assert outcome["vs_torch_same_hook"] < 1e-6, f"rank {rank}: {hook} on phalanx differs from torch DDP"
        assert outcome["identical"]


def test_torch_powersgd_hook_runs_unchanged(results):
    """World size 2, over each transport."""
    for per_rank in results:
        outcome = per_rank["torch_powersgd"]
        assert outcome["calls"] >= STEPS and outcome["identical"]
        assert outcome["vs_torch_same_hook"] < 1e-6


def _register_ours_on_torch_ddp(rank: int) -> list[str]:
    registered = []
    # Not bf16_compress_hook: torch DDP refuses any hook of that *name* without CUDA and NCCL (its own too).
    for name in ("allreduce_hook", "fp16_compress_hook"):
        model = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        model.register_comm_hook(None, getattr(phalanx.hooks, name))  # torch checks the hook's annotations
        model(torch.randn(3, 4)).sum().backward()
        registered.append(name)
    return registered


def test_phalanx_hooks_register_on_torch_ddp_as_they_are():
    """World size 2, torch's DDP."""
    assert run_ranks(_register_ours_on_torch_ddp, 2) == [["allreduce_hook", "fp16_compress_hook"]] * 2
