"""Where two replicas of a tensor differ, and the value each side holds: the audit's error path only.

Collective over the model's group: the ranks fingerprint the tensor in up to CHUNKS pieces and gather those
numbers, then gather the first piece that differs, so no rank ever sends the whole tensor.
"""

from __future__ import annotations

import torch

from ...world import generation
from .fingerprint import fingerprint

CHUNKS = 4096


@torch.no_grad()
def first_difference(tensor: torch.Tensor, group) -> tuple[tuple[int, ...], list] | None:
    """(the index of the first element where the ranks' `tensor` differ, every rank's value there), or None
    when they are equal everywhere (or differ in shape)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, -(-flat.numel() // CHUNKS))
    prints = [int(fingerprint(flat[start:start + step])) for start in range(0, flat.numel(), step)]
    everyone = generation.all_gather_objects((tuple(tensor.shape), prints), group, "the replicas' chunk prints")
    if len({shape for shape, _ in everyone}) > 1:
        return None
    chunk = next((c for c in range(len(prints)) if len({found[c] for _, found in everyone}) > 1), None)
    if chunk is None:
        return None
    piece = flat[chunk * step:(chunk + 1) * step].cpu()
    pieces = generation.all_gather_objects(piece, group, "the replicas' differing chunk")
    offset = next(i for i in range(piece.numel()) if len({_bits(p[i]) for p in pieces}) > 1)
    index = chunk * step + offset
    position = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tensor.shape)) if tensor.dim() else ()
    return position, [p[offset].item() for p in pieces]


def _bits(value: torch.Tensor) -> bytes:
    return value.reshape(1).view(torch.uint8).numpy().tobytes()
