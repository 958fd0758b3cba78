"""Fingerprints of tensors and values, and the verdict over every rank's: pure, so it can be tested alone.

A tensor's fingerprint is the sum of its bytes read as 64-bit integers (32-, 16- or 8-bit where its size or
alignment says so), wrapping around: integer sums are exact and their order does not matter, so every rank
gets the same number for the same bytes, and one changed element (a flipped bit, a value off by an ulp)
always changes it, by the difference of the changed words. What it misses: changes that cancel out exactly,
two 8-byte words swapped, or two words changed by opposite amounts. Fingerprints are combined with odd weights
(a sum, wrapping too), which keeps that property: one changed part always changes the whole.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass

import torch

MASK = (1 << 64) - 1


def wrap(value: int) -> int:
    """`value` as a signed 64-bit integer, wrapping around (what int64 tensor arithmetic gives).

    >>> wrap(2 ** 63), wrap(-1), wrap(2 ** 64 + 5)
    (-9223372036854775808, -1, 5)
    """
    value &= MASK
    return value - (1 << 64) if value >> 63 else value


@functools.lru_cache(maxsize=4096)
def salt(name: str) -> int:
    """An odd 64-bit weight derived from `name`, the same in every process (Python's hash() is not)."""
    return wrap(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") | 1)


@functools.lru_cache(maxsize=4096)
def _layout(key, dtype: torch.dtype, shape: torch.Size) -> int:
    return salt(f"{key}:{dtype}:{tuple(shape)}")


def value_fingerprint(value) -> int:
    """A Python value (a number, a string, a tuple of them ...) as a signed 64-bit integer, from its repr."""
    if isinstance(value, float):
        text = struct.pack("<d", value).hex()  # every bit: repr rounds nothing either, but says "nan" for all NaNs
    else:
        text = f"{type(value).__name__}:{value!r}"
    return salt(text)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """`flat` (1-D, contiguous) as the widest integers its size and address allow."""
    nbytes = flat.numel() * flat.element_size()
    address = flat.data_ptr()
    raw = flat.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and address % size == 0:
            return raw.view(dtype)
    return raw


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The fingerprint of `tensor`'s values: a 0-dim int64 tensor on its device (nothing read back).

    >>> a = torch.arange(6, dtype=torch.float32)
    >>> b = a.clone(); b[3] = torch.nextafter(b[3], torch.tensor(10.0))   # one ulp, one element
    >>> bool(fingerprint(a) == fingerprint(a.clone())), bool(fingerprint(a) == fingerprint(b))
    (True, False)
    """
    tensor = tensor.detach()
    if tensor.dim() and tensor.is_contiguous() and not tensor.is_sparse and tensor.data_ptr() % 8 == 0 and \
            tensor.shape[-1] * tensor.element_size() % 8 == 0:  # the usual case, in the fewest calls
        return tensor.view(torch.int64).sum()
    if tensor.is_sparse:
        tensor = tensor.coalesce()
        return fingerprint(tensor.indices()) * 3 + fingerprint(tensor.values())
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    words = _words(flat)
    return words.sum() if words.dtype == torch.int64 else words.sum(dtype=torch.int64)


def combine(parts: list[torch.Tensor], weights: list[int], device: torch.device, constant: int = 0) -> torch.Tensor:
    """Σ weights[i] * parts[i] + constant (int64, wrapping): one 0-dim tensor on `device`."""
    if not parts:
        return torch.full((), constant, dtype=torch.int64, device=device)
    stacked = torch.stack([p.to(device) for p in parts])
    return (stacked * torch.tensor(weights, dtype=torch.int64, device=device)).sum() + constant


def state_fingerprint(state: dict, device: torch.device) -> torch.Tensor:
    """One parameter's optimizer state ({key: tensor or value}), keys and structure included."""
    return states_fingerprints([state], device)[0]


def states_fingerprints(states: list[dict | None], device: torch.device) -> torch.Tensor:
    """states_fingerprint of each state (None: none, 0), as one int64 tensor: a few tensor calls in all, not a
    few per parameter (an audit of a model of hundreds of tensors is mostly this bookkeeping)."""
    parts, weights, owners, constants = [], [], [], [0] * len(states)
    for number, state in enumerate(states):
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor):
                parts.append(fingerprint(value))
                weights.append(salt(str(key)))
                owners.append(number)
                constants[number] += _layout(key, value.dtype, value.shape)
            else:
                constants[number] += salt(f"{key}:{value_fingerprint(value)}")
        constants[number] = wrap(constants[number])
    total = torch.tensor(constants, dtype=torch.int64, device=device)
    if parts:
        weighted = torch.stack([p.to(device) for p in parts]) * torch.tensor(weights, dtype=torch.int64, device=device)
        total.index_add_(0, torch.tensor(owners, device=device), weighted)
    return total


@dataclass
class Verdict:
    """The ranks' fingerprints compared: `sides` are the groups of ranks that agree (largest first, then by
    lowest rank); `majority` the side with more than half of the ranks, if one has; `columns` the entries
    (indices into the rows) where the ranks differ, in order."""

    sides: list[list[int]]
    majority: list[int] | None
    columns: list[int]

    @property
    def agree(self) -> bool:
        return len(self.sides) <= 1

    @property
    def differing(self) -> list[int]:
        """The ranks outside the majority (all of them when there is none)."""
        keep = set(self.majority or ())
        return sorted(r for side in self.sides for r in side if r not in keep)


def compare(rows: list[list[int]]) -> Verdict:
    """Rank r's fingerprints at rows[r]; which ranks agree, and on what they differ.

    >>> compare([[1, 2], [1, 3], [1, 2]])
    Verdict(sides=[[0, 2], [1]], majority=[0, 2], columns=[1])
    >>> compare([[1, 2], [1, 3]]).majority is None
    True
    """
    by_value: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        by_value.setdefault(tuple(row), []).append(rank)
    sides = sorted(by_value.values(), key=lambda side: (-len(side), side[0]))
    majority = sides[0] if len(sides[0]) * 2 > len(rows) else None
    columns = [c for c in range(len(rows[0])) if len({row[c] for row in rows}) > 1] if len(sides) > 1 else []
    return Verdict(sides, majority, columns)
