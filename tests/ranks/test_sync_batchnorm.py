"""phalanx.nn.SyncBatchNorm on 2 and 3 Gloo ranks against ONE process running torch.nn.BatchNorm on
the concatenated batch, in float64: outputs, input gradients, summed parameter gradients, running
statistics and eval outputs must agree. One spawn per world size runs every case; tests read it.
The single-process tests (no world, state_dict, convert, merge, shapes) are in tests/unit/test_sync_batchnorm.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import SyncBatchNormError
from phalanx.nn import SyncBatchNorm
from phalanx.testing import run_ranks
from tests.helpers.sync_batchnorm_cases import CL, DEFAULT, STEPS, TOL, C, batch, generator, make_layer

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor",
               "all_to_all_single", "barrier")

# sizes: samples per rank (per member of `members` when given); tail: dimensions after (N, C).
CASES = {
    2: {
        "2d_unequal_1_6": dict(sizes=(1, 6)),
        "3d_empty_first": dict(sizes=(0, 5), tail=(4,)),
        "4d_channels_last": dict(sizes=(2, 3), tail=(4, 5), channels_last=True),
        "4d_no_affine_cumulative": dict(sizes=(3, 1), tail=(2, 2), affine=False, momentum=None),
        "5d_channels_last_3d": dict(sizes=(1, 2), tail=(2, 3, 2), channels_last=True),
        "2d_untracked": dict(sizes=(4, 2), track=False),
    },
    3: {
        "2d_1_4_7": dict(sizes=(1, 4, 7)),
        "4d_empty_middle_channels_last": dict(sizes=(3, 0, 4), tail=(3, 3), channels_last=True, momentum=None),
        "3d_no_affine_1_4_7": dict(sizes=(1, 4, 7), tail=(2,), affine=False),
        "2d_no_bias": dict(sizes=(2, 2, 5), bias=False),
        "subgroup_0_2": dict(sizes=(2, 5), tail=(2, 2), members=(0, 2)),
    },
}


def spec_of(world, name):
    return {**DEFAULT, **CASES[world][name]}


def eval_batch(name, spec, position):
    """A per-rank eval batch, of another size on every rank."""
    g = generator(name, "eval", position)
    return torch.randn((position + 2, C) + spec["tail"], generator=g, dtype=torch.float64)


class CountCollectives:
    """Counts calls of torch.distributed collectives (the module looks them up at call time)."""

    def __enter__(self):
        self.counts, self.saved = {}, {name: getattr(dist, name) for name in COLLECTIVES}
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    def take(self):
        counts, self.counts = self.counts, {}
        return counts

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def run_cases(rank, world):
    results = {}
    for name in CASES[world]:
        spec = spec_of(world, name)
        members = spec["members"] or tuple(range(world))
        group = dist.new_group(list(members)) if spec["members"] else None  # every rank must call new_group
        if rank not in members:
            continue
        position = members.index(rank)
        lo = sum(spec["sizes"][:position])
        hi = lo + spec["sizes"][position]
        layer = make_layer(SyncBatchNorm, name, spec, process_group=group)
        steps = []
        with CountCollectives() as counter:
            for step in range(STEPS):
                x, weights = batch(name, spec, step)
                x = x[lo:hi]
                if spec["channels_last"]:
                    x = x.contiguous(memory_format=CL[x.dim()])
                x = x.clone().requires_grad_()
                layer.zero_grad(set_to_none=True)
                out = layer(x)
                forward_calls = counter.take()
                (out * weights[lo:hi]).sum().backward()
                steps.append(dict(
                    out=out.detach(), dx=x.grad, forward=forward_calls, backward=counter.take(),
                    gw=None if layer.weight is None else layer.weight.grad,
                    gb=None if layer.bias is None else layer.bias.grad,
                    channels_last=spec["channels_last"] and out.is_contiguous(memory_format=CL[x.dim()])))
            layer.eval()
            eval_out = layer(eval_batch(name, spec, position))
            eval_calls = counter.take()
        results[name] = dict(steps=steps, eval_out=eval_out.detach(), eval_calls=eval_calls,
                             buffers={k: v.clone() for k, v in layer.named_buffers()})
    # Too few samples in the whole group: every rank raises the same typed error, none hangs.
    for sizes in ((0,) * world, (1,) + (0,) * (world - 1)):
        try:
            SyncBatchNorm(C)(torch.randn(sizes[rank], C))
            results[f"error_{sizes}"] = None
        except SyncBatchNormError as exc:
            results[f"error_{sizes}"] = (isinstance(exc, ValueError), str(exc))
    return results


@functools.cache
def ran(world):
    return run_ranks(run_cases, world, (world,))


def reference(name, spec):
    """One process, torch.nn.BatchNorm*d, the concatenated batch."""
    cls = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[len(spec["tail"])]
    layer = make_layer(cls, name, spec)
    steps = []
    for step in range(STEPS):
        x, weights = batch(name, spec, step)
        x = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        (out * weights).sum().backward()
        steps.append(dict(out=out.detach(), dx=x.grad, gw=None if layer.weight is None else layer.weight.grad,
                          gb=None if layer.bias is None else layer.bias.grad))
    layer.eval()
    return steps, layer


CASE_IDS = [(world, name) for world in CASES for name in CASES[world]]


@pytest.mark.parametrize("world,name", CASE_IDS, ids=[f"{w}ranks-{n}" for w, n in CASE_IDS])
def test_matches_batchnorm_on_the_whole_batch(world, name):
    """World sizes 2 and 3 (the id names it), one spawn per world size."""
    spec = spec_of(world, name)
    results = ran(world)
    members = spec["members"] or tuple(range(world))
    ours = [results[rank][name] for rank in members]
    assert all(name not in results[rank] for rank in range(world) if rank not in members)
    ref_steps, ref_layer = reference(name, spec)
    for step, ref in enumerate(ref_steps):
        mine = [r["steps"][step] for r in ours]
        for rank, m in zip(members, mine):
            assert m["dx"].shape == m["out"].shape == (spec["sizes"][members.index(rank)], C) + spec["tail"]
            assert m["forward"] == {"all_gather": 1} and m["backward"] == {"all_reduce": 1}, (rank, m)
            assert m["channels_last"] == spec["channels_last"]
        torch.testing.assert_close(torch.cat([m["out"] for m in mine]), ref["out"], **TOL)
        torch.testing.assert_close(torch.cat([m["dx"] for m in mine]), ref["dx"], **TOL)
        # Each rank holds its own share of the parameter gradients (DDP combines them); the shares add
        # up to the single process's gradient.
        for key in ("gw", "gb"):
            if ref[key] is None:
                assert all(m[key] is None for m in mine)
            else:
                torch.testing.assert_close(sum(m[key] for m in mine), ref[key], **TOL)
    ref_buffers = dict(ref_layer.named_buffers())
    for rank, r in zip(members, ours):
        assert r["buffers"].keys() == ref_buffers.keys()
        for key, value in ref_buffers.items():
            torch.testing.assert_close(r["buffers"][key], value, **TOL)
        # Eval: running statistics (or the rank's own batch when untracked), no collective.
        assert r["eval_calls"] == {}
        torch.testing.assert_close(r["eval_out"], ref_layer(eval_batch(name, spec, members.index(rank))), **TOL)


@pytest.mark.parametrize("world", sorted(CASES))
def test_too_few_samples_in_the_group_raises_on_every_rank(world):
    """World sizes 2 and 3."""
    for sizes in ((0,) * world, (1,) + (0,) * (world - 1)):
        outcomes = [r[f"error_{sizes}"] for r in ran(world)]
        assert all(o is not None and o[0] for o in outcomes), outcomes
        for rank, (_, message) in enumerate(outcomes):
            assert "more than 1 value per channel" in message and f"[rank {rank}]" in message, message


def _torch_sync_batchnorm_under_phalanx_ddp(rank: int) -> dict:
    import phalanx

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, C), nn.SyncBatchNorm(C), nn.Linear(C, 2)).double()
    model = phalanx.DistributedDataParallel(net)
    x = torch.randn((2, 5)[rank], 4, generator=generator("ddp", rank), dtype=torch.float64)
    weights = torch.randn(x.shape[0], 2, generator=generator("ddp-w", rank), dtype=torch.float64)
    (model(x) * weights).sum().backward()
    return {"layer": type(model.module[1]).__module__ + "." + type(model.module[1]).__qualname__,
            "grads": [p.grad.clone() for p in model.parameters()], "running_mean": net[1].running_mean.clone()}


@pytest.mark.smoke
def test_phalanx_ddp_runs_torchs_sync_batchnorm_on_cpu_as_the_whole_batch():
    """World size 2: torch's nn.SyncBatchNorm (which refuses CPU input) is swapped for ours by DDP."""
    per_rank = run_ranks(_torch_sync_batchnorm_under_phalanx_ddp, 2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, C), nn.BatchNorm1d(C), nn.Linear(C, 2)).double()
    x = torch.cat([torch.randn((2, 5)[r], 4, generator=generator("ddp", r), dtype=torch.float64) for r in range(2)])
    weights = torch.cat([torch.randn((2, 5)[r], 2, generator=generator("ddp-w", r), dtype=torch.float64)
                         for r in range(2)])
    (ref(x) * weights).sum().backward()
    for outcome in per_rank:
        assert outcome["layer"] == "phalanx.nn.sync_batchnorm.SyncBatchNorm"
        for mine, theirs in zip(outcome["grads"], ref.parameters()):
            torch.testing.assert_close(mine * 2, theirs.grad, **TOL)  # DDP averages the ranks' sums
        torch.testing.assert_close(outcome["running_mean"], ref[1].running_mean, **TOL)
