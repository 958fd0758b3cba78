"""px.DiLoCo's arguments, checked where it is built (one process; its runs are tests/ranks/test_diloco.py)."""

from __future__ import annotations

import dataclasses

import pytest

import phalanx as px
from phalanx.errors import AcrossHostsError


def test_defaults_are_the_papers():
    config = px.DiLoCo(every=500)
    assert (config.every, config.outer_lr, config.momentum, config.nesterov) == (500, 0.7, 0.9, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.every = 1


@pytest.mark.parametrize("kwargs, named", [
    ({"every": 0}, "every=0"), ({"every": 2.5}, "every=2.5"), ({"every": True}, "every=True"),
    ({"every": 4, "outer_lr": 0}, "outer_lr=0"), ({"every": 4, "outer_lr": float("nan")}, "outer_lr=nan"),
    ({"every": 4, "momentum": 1.0}, "momentum=1.0"), ({"every": 4, "momentum": -0.1}, "momentum=-0.1"),
    ({"every": 4, "nesterov": "yes"}, "nesterov='yes'"),
])
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, named):
    with pytest.raises(AcrossHostsError) as caught:
        px.DiLoCo(**kwargs)
    message = str(caught.value)
    assert named in message and "expected" in message and "Pass " in message
    assert isinstance(caught.value, ValueError)  # a bad argument, as Python's own checks say it
