"""The same model everywhere, at the start: the cross-rank signature check and coalesced broadcasts.

A replica is described by a signature (names, shapes, dtypes of parameters and buffers); ranks
compare a digest of it in one all-gather. Tensors are broadcast flattened per (device, dtype), one
collective per group rather than one per tensor; a step tag can ride along in a trailing slot.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ...bucket.step_guard import tag_modulus
from ...diagnose import recorder
from ...errors import ParameterMismatchError, explain

BROADCAST_CAP_BYTES = 250 * 1024 * 1024  # per flat chunk: bounds the extra memory of a broadcast


def trained(module: torch.nn.Module, ignored=frozenset()) -> list:
    """(name, parameter) for the parameters DDP averages: trainable, not ignored."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad and name not in ignored]


def shared_states(module: torch.nn.Module, ignored=frozenset()) -> list:
    """(name, tensor) for the parameters and buffers replicas share: all but the ignored ones."""
    return [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in ignored]


def synced_buffers(module: torch.nn.Module, ignored=frozenset()) -> list:
    return [b for name, b in module.named_buffers() if name not in ignored]


def replica_signature(module: torch.nn.Module) -> list[str]:
    """One line per parameter and buffer: what must agree across ranks for DDP to be meaningful."""
    lines = [f"parameter {name} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
             for name, p in module.named_parameters()]
    lines += [f"buffer {name} {tuple(b.shape)} {b.dtype}" for name, b in module.named_buffers()]
    return lines


def check_same_signature(module: torch.nn.Module, group, device: torch.device) -> None:
    """Raise ParameterMismatchError naming the first differing parameter if ranks hold different models."""
    lines = replica_signature(module)
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    entry = recorder.begin(recorder.ALL_GATHER, -1, mine.numel(), mine.dtype)
    dist.all_gather(gathered, mine, group=group)
    recorder.done(entry)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    # Error path only: exchange the full signatures to say exactly what differs.
    everyone: list = [None] * world
    dist.all_gather_object(everyone, lines, group=group)
    raise _mismatch_error(everyone, dist.get_rank(group))


def _mismatch_error(signatures: list[list[str]], rank: int) -> ParameterMismatchError:
    reference = signatures[0]
    length = max(len(s) for s in signatures)
    for position in range(length):
        entries = [s[position] if position < len(s) else "<nothing>" for s in signatures]
        if all(entry == entries[0] for entry in entries):
            continue
        differing = [r for r, entry in enumerate(entries) if entry != entries[0]]
        name = next(e.split(" ")[1] for e in entries if e != "<nothing>")
        seen = "; ".join(f"rank {r}: {entries[r]}" for r in differing)
        return ParameterMismatchError(explain(
            f"ranks {differing} hold a different model than rank 0 at {name!r}", rank=rank,
            seen=seen, expected=f"rank 0: {reference[position] if position < len(reference) else '<nothing>'}",
            fix="Build the same model (same architecture, shapes and dtypes) on every rank before wrapping it "
                "in DistributedDataParallel."), name=name, ranks=differing)
    return ParameterMismatchError(explain("ranks disagree on the model signature", rank=rank), ranks=[])


def _groups(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Split tensors into chunks of one (device, dtype), each at most cap_bytes (or one tensor)."""
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    chunks = []
    for members in by_key.values():
        chunk, size = [], 0
        for t in members:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > cap_bytes:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        chunks.append(chunk)
    return chunks


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group, *, tag: int | None = None,
                        wait=None, cap_bytes: int = BROADCAST_CAP_BYTES) -> tuple[int, int] | None:
    """Copy `tensors` from global rank `src` to every rank of `group`, one collective per flat chunk.

    With `tag`, src's tag travels in a trailing slot of the first chunk; returns (tag received,
    own tag), both reduced to what the slot's dtype holds exactly, so a caller can check that every
    rank was at the same step. `wait(work, what)` waits for a collective (default: `work.wait()`).
    """
    tags = None
    me = dist.get_rank()
    for index, chunk in enumerate(_groups([t for t in tensors if t.numel() > 0], cap_bytes)):
        extra = 1 if (tag is not None and index == 0) else 0
        sizes = [t.numel() for t in chunk]
        if me == src:
            flat = torch.cat([t.reshape(-1) for t in chunk] + ([chunk[0].new_zeros(1)] if extra else []))
        else:
            flat = torch.empty(sum(sizes) + extra, dtype=chunk[0].dtype, device=chunk[0].device)
        if extra:
            own = tag % tag_modulus(flat.dtype)
            if me == src:
                flat[-1] = own
        entry = recorder.begin(recorder.BROADCAST, -1, flat.numel(), flat.dtype)
        work = dist.broadcast(flat, src, group=group, async_op=True)
        work.wait() if wait is None else wait(work, "the broadcast of module buffers")
        recorder.done(entry)
        if extra:
            tags = (int(flat[-1].item()), own)
        if me != src:
            pieces = flat[:sum(sizes)].split(sizes)
            torch._foreach_copy_(chunk, [piece.view_as(t) for piece, t in zip(pieces, chunk)])
    return tags
