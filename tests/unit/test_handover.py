"""The state handed to a joining rank (checkpoint/handover.py), its pure parts: the layout without its tensors and
back, the stripes each rank that trains sends, and a stripe cut across tensors of several dtypes."""

from __future__ import annotations

import io

import torch

from phalanx.checkpoint.handover import _as_bytes, _filled, _hollow, _stripe_of, _stripes


def _state():
    return {"model": {"w": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64)},
            "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(3, 5, dtype=torch.float64)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "flags": (torch.tensor([True, False, True]), 3, "text")}


def test_a_layout_without_tensors_loads_safely_and_fills_back_to_the_state():
    state, tensors = _state(), []
    hollow = _hollow(state, tensors)
    blob = io.BytesIO()
    torch.save(hollow, blob)
    layout = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)  # no pickled code: a checkpoint's rule
    assert len(blob.getvalue()) < 4000 and len(tensors) == 5
    filled = _filled(layout, iter(tensors))
    assert torch.equal(filled["model"]["w"], state["model"]["w"]) and filled["flags"][1:] == (3, "text")
    assert filled["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert filled["optimizer"]["state"][0]["exp_avg"].dtype == torch.float64


def test_the_stripes_cover_every_byte_once_and_each_is_cut_across_the_tensors():
    tensors = []
    _hollow(_state(), tensors)
    whole = torch.cat([_as_bytes(t) for t in tensors])
    for senders in (1, 2, 3, 7):
        stripes = _stripes(whole.numel(), senders)
        assert stripes[0][0] == 0 and stripes[-1][1] == whole.numel()
        assert all(a[1] == b[0] for a, b in zip(stripes, stripes[1:]))
        joined = torch.cat([_stripe_of(tensors, start, end, torch.device("cpu")) for start, end in stripes])
        assert torch.equal(joined, whole)
