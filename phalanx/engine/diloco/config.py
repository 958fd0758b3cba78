"""`px.DiLoCo(...)`: the settings of `across_hosts=`, checked when made (before any collective of the mode)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import AcrossHostsError, explain

COMPRESSIONS = (None, "int8", "fp16")


@dataclass(frozen=True)
class DiLoCo:
    """The DiLoCo mode of `DistributedDataParallel(..., across_hosts=px.DiLoCo(every=H))`.

    Every `every` optimizer steps the hosts average their pseudo-gradients and an outer SGD (`outer_lr`,
    `momentum`, `nesterov`) steps the synced parameters. With momentum 0 the outer step is plain SGD (Nesterov
    needs a momentum), so every=1, outer_lr=1, momentum=0 under an inner SGD is the synchronous step.
    `compress` ("int8", "fp16") sends the pseudo-gradient across hosts in fewer bytes, with error feedback.
    `fragments=F` syncs the parameters in F parts at staggered steps (fragment k at steps k*H/F + m*H), and
    `delay=D` merges each part's average D inner steps after it was sent, the exchange overlapped with them.

    >>> DiLoCo(every=100)
    DiLoCo(every=100, outer_lr=0.7, momentum=0.9, nesterov=True, compress=None, fragments=1, delay=0)
    >>> model = px.DistributedDataParallel(net, across_hosts=px.DiLoCo(every=100))   # doctest: +SKIP
    """

    every: int
    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    compress: str | None = None
    fragments: int = 1
    delay: int = 0

    def __post_init__(self):
        if not _is_int(self.every) or self.every < 1:
            raise AcrossHostsError(explain(
                "DiLoCo every is the number of optimizer steps between two outer steps", seen=f"every={self.every!r}",
                expected="an int >= 1", fix="Pass every=100, say (the outer step's period, H; docs/diloco.md)."))
        for name, low, high in (("outer_lr", 0.0, math.inf), ("momentum", 0.0, 1.0)):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not (value > low if name == "outer_lr" else low <= value < high):
                expected = "a finite number > 0" if name == "outer_lr" else "a number in [0, 1)"
                raise AcrossHostsError(explain(
                    f"DiLoCo {name} is out of range", seen=f"{name}={value!r}", expected=expected,
                    fix=f"Pass {name}={DiLoCo.__dataclass_fields__[name].default} (the default)."))
        if not isinstance(self.nesterov, bool):
            raise AcrossHostsError(explain("DiLoCo nesterov is a flag", seen=f"nesterov={self.nesterov!r}",
                                           expected="True or False", fix="Pass nesterov=True (the default)."))
        if self.compress not in COMPRESSIONS:
            raise AcrossHostsError(explain(
                "DiLoCo compress names how the pseudo-gradient crosses hosts", seen=f"compress={self.compress!r}",
                expected="None (the parameters' dtype), 'int8' or 'fp16'",
                fix="Pass compress='int8' for a quarter of fp32's bytes (docs/diloco.md), or leave it unset."))
        if not _is_int(self.fragments) or self.fragments < 1 or self.every % self.fragments:
            raise AcrossHostsError(explain(
                "DiLoCo fragments must split the period into whole steps (fragment k syncs at steps k*every/"
                "fragments + m*every)", seen=f"fragments={self.fragments!r} with every={self.every}",
                expected=f"an int >= 1 that divides every={self.every}",
                fix=f"Pass fragments={_divisor_near(self.every, self.fragments)}, or every a multiple of it."))
        if not _is_int(self.delay) or not 0 <= self.delay < self.every:
            raise AcrossHostsError(explain(
                "DiLoCo delay is the number of inner steps a fragment's average may arrive late",
                seen=f"delay={self.delay!r} with every={self.every}", expected=f"an int in [0, {self.every})",
                fix="Pass delay=1 to overlap the exchange with the next inner step, or delay=0 (the default)."))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisor_near(every: int, wanted) -> int:
    """The divisor of `every` nearest to `wanted` (1 when `wanted` is no number): the fix a bad `fragments` gets."""
    target = wanted if isinstance(wanted, (int, float)) and not isinstance(wanted, bool) else 1
    small = [d for d in range(1, math.isqrt(every) + 1) if every % d == 0]
    return min(small + [every // d for d in small], key=lambda d: (abs(d - target), d))
