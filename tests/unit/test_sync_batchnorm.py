"""phalanx.nn.SyncBatchNorm in one process, without a world: it is torch's BatchNorm (outputs, gradients,
state_dict), convert_sync_batchnorm swaps layers in place, the statistics merge stays exact at a
large offset, and a wrong input shape is a typed error. The multi-rank tests are in
tests/ranks/test_sync_batchnorm.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from phalanx.errors import PhalanxError, SyncBatchNormError
from phalanx.nn import SyncBatchNorm, convert_sync_batchnorm
from phalanx.nn.sync_batchnorm import merge_stats
from tests.helpers.sync_batchnorm_cases import CL, DEFAULT, STEPS, C, batch, generator, make_layer


@pytest.mark.parametrize("tail,channels_last", [((), False), ((5,), False), ((3, 4), True), ((2, 2, 2), False)])
@pytest.mark.parametrize("affine,momentum", [(True, 0.1), (False, None)])
def test_without_a_world_it_is_batchnorm(tail, channels_last, affine, momentum):
    if dist.is_initialized() and dist.get_world_size() > 1:
        pytest.skip("this process is in a world of several ranks")
    spec = {**DEFAULT, "tail": tail, "affine": affine, "momentum": momentum, "sizes": (6,)}
    cls = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[len(tail)]
    ours, theirs = make_layer(SyncBatchNorm, "single", spec), make_layer(cls, "single", spec)
    for step in range(STEPS):
        x, weights = batch("single", spec, step)
        if channels_last:
            x = x.contiguous(memory_format=CL[x.dim()])
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        for layer, xi in ((ours, xa), (theirs, xb)):
            (layer(xi) * weights).sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    for layer in (ours, theirs):
        layer.eval()
    assert torch.equal(ours(x), theirs(x))
    for (key, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), key
    with pytest.raises(ValueError):  # torch's own check, unchanged
        ours.train()(torch.randn((1, C) + (1,) * len(tail), dtype=torch.float64))


@pytest.mark.parametrize("affine,track,bias", [(True, True, True), (False, True, True), (True, False, False),
                                               (False, False, True)])
def test_state_dict_is_batchnorms(affine, track, bias):
    ours = SyncBatchNorm(4, affine=affine, track_running_stats=track, bias=bias)
    theirs = nn.BatchNorm2d(4, affine=affine, track_running_stats=track, bias=bias)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.train()(torch.randn(5, 4, 2, 2))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)


def test_convert_sync_batchnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Flatten(2),
                          nn.Sequential(nn.BatchNorm1d(4, momentum=None), nn.SyncBatchNorm(4, affine=False)),
                          nn.Sequential(nn.Linear(9, 3), nn.BatchNorm1d(4, track_running_stats=False)))
    model(torch.randn(6, 2, 3, 3))  # running statistics away from their initial values
    model[1].weight.requires_grad_(False)
    model[3][0].eval()
    before = copy.deepcopy(model).eval()
    old = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    converted = convert_sync_batchnorm(model)
    assert converted is model
    new = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(new) == len(old) == 4 and all(type(m) is SyncBatchNorm for m in new)
    for o, n in zip(old, new):
        assert (n.momentum, n.eps, n.affine, n.track_running_stats, n.training) == \
            (o.momentum, o.eps, o.affine, o.track_running_stats, o.training)
        assert list(dict(n.named_parameters())) == list(dict(o.named_parameters()))
        for (_, a), (_, b) in zip(n.named_parameters(), o.named_parameters()):
            assert a is b and a.requires_grad == b.requires_grad  # shared: an optimizer keeps working
        assert list(n.state_dict()) == list(o.state_dict())
        for key, value in o.state_dict().items():
            assert torch.equal(n.state_dict()[key], value)
    assert not new[0].weight.requires_grad and not new[1].training
    x = torch.randn(5, 2, 3, 3)
    torch.testing.assert_close(converted.eval()(x), before(x))
    # A bare layer is replaced and returned; the classmethod and the function agree; a group is kept.
    group = object()
    single = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3), process_group=group)
    assert type(single) is SyncBatchNorm and single.process_group is group
    assert convert_sync_batchnorm(nn.SyncBatchNorm(3, process_group=group)).process_group is group


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda sizes: sum(sizes) >= 2),
       st.sampled_from([0.0, 1e8]))
def test_merge_is_exact_with_a_large_offset(sizes, offset):
    """The merge adds squared deviations: at a 1e8 offset it keeps ~8 digits of the variance (float64's
    spacing there is 1.5e-8), where E[x^2] - E[x]^2 would keep none."""
    x = torch.randn(sum(sizes), C, dtype=torch.float64, generator=generator(tuple(sizes))) + offset
    rows = []
    for part in torch.split(x, sizes):
        var, mean = torch.var_mean(part, dim=0, correction=0) if len(part) else (torch.zeros(C), torch.zeros(C))
        rows.append((len(part), mean, var * len(part)))
    counts = torch.tensor([[float(n)] for n, _, _ in rows], dtype=torch.float64)
    means, m2s = (torch.stack([r[i] for r in rows]).double() for i in (1, 2))
    total, mean, m2 = merge_stats(counts, means, m2s)
    var, whole_mean = torch.var_mean(x, dim=0, correction=0)
    assert total == len(x)
    torch.testing.assert_close(mean, whole_mean, rtol=1e-14, atol=1e-12)
    torch.testing.assert_close(m2 / total, var, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("shape", [(3,), (2, 4), (2, 4, 5)])
def test_wrong_input_shape_is_a_typed_error(shape):
    with pytest.raises(SyncBatchNormError) as info:
        SyncBatchNorm(3)(torch.randn(shape))
    assert isinstance(info.value, ValueError) and isinstance(info.value, PhalanxError)
    assert f"seen {shape}" in str(info.value) and "expected (N, 3, *)" in str(info.value)


