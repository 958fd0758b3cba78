"""px.DiLoCo's arguments, checked where it is built (one process; its runs are tests/ranks/test_diloco.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import phalanx as px
from phalanx.engine.diloco import fragments
from phalanx.engine.diloco.codec import ROW, Half, Int8Rows
from phalanx.errors import AcrossHostsError


def test_defaults_are_the_papers():
    config = px.DiLoCo(every=500)
    assert (config.every, config.outer_lr, config.momentum, config.nesterov) == (500, 0.7, 0.9, True)
    assert config.compress is None  # the exact average, until quality runs measure int8 (docs/diloco.md)
    assert (config.fragments, config.delay) == (1, 0)  # one outer step every H steps, waited for: DiLoCo's
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.every = 1


@pytest.mark.parametrize("kwargs, named", [
    ({"every": 0}, "every=0"), ({"every": 2.5}, "every=2.5"), ({"every": True}, "every=True"),
    ({"every": 4, "outer_lr": 0}, "outer_lr=0"), ({"every": 4, "outer_lr": float("nan")}, "outer_lr=nan"),
    ({"every": 4, "momentum": 1.0}, "momentum=1.0"), ({"every": 4, "momentum": -0.1}, "momentum=-0.1"),
    ({"every": 4, "nesterov": "yes"}, "nesterov='yes'"), ({"every": 4, "compress": "int4"}, "compress='int4'"),
    ({"every": 4, "compress": "bf16"}, "compress='bf16'"), ({"every": 4, "fragments": 3}, "fragments=3"),
    ({"every": 4, "fragments": 0}, "fragments=0"), ({"every": 4, "delay": 4}, "delay=4"),
    ({"every": 4, "delay": -1}, "delay=-1"), ({"every": 4, "delay": 0.5}, "delay=0.5"),
])
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, named):
    with pytest.raises(AcrossHostsError) as caught:
        px.DiLoCo(**kwargs)
    message = str(caught.value)
    assert named in message and "expected" in message and "Pass " in message
    assert isinstance(caught.value, ValueError)  # a bad argument, as Python's own checks say it


def test_steplog_records_count_outer_steps_and_bytes_across_hosts():
    from phalanx.observe.window import FIELDS, line, make_record

    def row(**values):
        out = [0.0] * len(FIELDS)
        for name, value in {"steps": 10, "end_step": 20, "samples": 40, "wall_s": 1.0, **values}.items():
            out[FIELDS.index(name)] = value
        return out

    record = make_record([row(outer_steps=2, across_bytes=3e6), row(outer_steps=2, across_bytes=3e6)], now=0.0)
    assert (record["outer_steps"], record["bytes_across_hosts"]) == (2, 6_000_000)
    assert "outer 2 (6.0 MB across hosts)" in line(record)
    plain = make_record([row()], now=0.0)
    assert (plain["outer_steps"], plain["bytes_across_hosts"]) == (0, 0) and "outer" not in line(plain)


@pytest.mark.parametrize("codec", [Int8Rows(), Half()], ids=lambda c: c.name)
def test_codecs_round_trip_within_their_precision(codec):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * ROW + 5, generator=g, dtype=torch.float64) * torch.arange(3 * ROW + 5) / 100
    x[ROW:2 * ROW] = 0  # a row of zeros decodes to zeros
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.numel() == codec.size(x.numel())
    back = codec.decode(data, x.numel(), torch.float64)
    assert torch.equal(back[ROW:2 * ROW], torch.zeros(ROW, dtype=torch.float64))
    if codec.name == "int8":  # within half a step of each row's own scale
        for start in range(0, x.numel(), ROW):
            row = slice(start, start + ROW)
            assert float((back[row] - x[row]).abs().max()) <= float(x[row].abs().max()) / 254 * 1.0001
    else:
        assert torch.allclose(back, x, rtol=2 ** -11, atol=2 ** -25)  # fp16's rounding; its subnormals' spacing
    assert codec.size(1000) == (1000 + 4 * 4 if codec.name == "int8" else 2000)


def test_a_bad_fragments_names_a_divisor_of_every():
    with pytest.raises(AcrossHostsError, match=r"fragments=3 with every=100.*Pass fragments=2,"):
        px.DiLoCo(every=100, fragments=3)


def test_fragments_are_whole_parameters_of_about_equal_size_synced_in_turn():
    assert fragments.split([6, 2, 2, 2], 2) == [[0], [1, 2, 3]]
    assert fragments.split([1, 1, 10], 3) == [[0], [1], [2]]
    assert fragments.split([5] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert fragments.split([1, 2], 3) is None
    # every=6, 3 fragments: one every 2 steps, each every 6; with 1 fragment, DiLoCo's every H.
    assert [fragments.due(s, 6, 3) for s in range(1, 13)] == [[], [1], [], [2], [], [0]] * 2
    assert [fragments.due(s, 3, 1) for s in range(1, 7)] == [[], [], [0]] * 2
