"""How a pseudo-gradient travels across hosts under `DiLoCo(compress=...)`: one small interface, two codecs.

A codec turns a 1-D tensor of n values into a flat uint8 tensor of `size(n)` bytes and back. It is lossy: the
caller keeps what it lost (error feedback, exchange.py). Gloo has no bfloat16, hence fp16 and int8 only.
"""

from __future__ import annotations

import torch

ROW = 256  # values that share one int8 scale: 4 bytes of scale per 256 of data, 1.6 % on top of the int8 values
FP16_MAX = 65504.0


class Int8Rows:
    """Symmetric int8 per row of ROW consecutive values: scale = max |x| / 127 in fp32, q = round(x / scale).
    The layout is [the rows' fp32 scales][the n int8 values]."""

    name = "int8"

    def size(self, n: int) -> int:
        return 4 * -(-n // ROW) + n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        rows = x.new_zeros(-(-n // ROW) * ROW)
        rows[:n] = x
        rows = rows.view(-1, ROW)
        scale = (rows.abs().amax(dim=1) / 127).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a row of zeros: any scale, 1
        q = (rows / scale.to(rows.dtype)[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.view(-1)[:n].view(torch.uint8)])

    def decode(self, data: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        count = -(-n // ROW)
        scale = data[:4 * count].clone().view(torch.float32).to(dtype)  # cloned: a slice need not be 4-aligned
        q = torch.zeros(count * ROW, dtype=dtype, device=data.device)
        q[:n] = data[4 * count:4 * count + n].view(torch.int8).to(dtype)
        return (q.view(count, ROW) * scale[:, None]).view(-1)[:n]


class Half:
    """fp16, clamped to its range (a larger value comes back as +-65504, the rest in the error feedback)."""

    name = "fp16"

    def size(self, n: int) -> int:
        return 2 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        return data[:2 * n].clone().view(torch.float16).to(dtype)


def codec(name: str):
    """The codec `DiLoCo(compress=name)` names ("int8" or "fp16")."""
    return {"int8": Int8Rows, "fp16": Half}[name]()
