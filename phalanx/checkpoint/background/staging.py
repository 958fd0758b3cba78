"""Staging: a snapshot of a state's tensors in host memory that the background writer reads.

`Staging.snapshot(tree)` copies every tensor of `tree` (a state dict, or any nest of dicts, lists and
tuples) into one shared-memory buffer and returns the tree with each tensor replaced by a reference
to its bytes there; the plain values are copied too (containers rebuilt), so nothing the training
changes afterwards reaches the checkpoint. The buffer is an anonymous shared mapping, allocated once
(sized to the first snapshot, exactly, bar 16-byte alignment) and reused by every later snapshot; a
process forked after it sees the same pages. With CUDA it is page-locked (cudaHostRegister), so copies
from the GPU run at full speed; `rebuild` turns the references back into tensors, views of the buffer.
"""

from __future__ import annotations

import copy
import mmap

import torch

STAGED = "__phalanx_staged__"
ALIGN = 16  # the widest element (complex128): every tensor's bytes start aligned for a view of its dtype
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _stageable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type != "meta"


def staged_bytes(tree) -> int:
    """The buffer bytes a snapshot of `tree` takes."""
    total = 0

    def walk(value):
        nonlocal total
        if _stageable(value):
            total += _aligned(value.numel() * value.element_size())
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                walk(item)

    walk(tree)
    return total


class Staging:
    """One reusable shared-memory buffer per Checkpointer, and the snapshots taken into it."""

    def __init__(self):
        self.buffer: mmap.mmap | None = None
        self.flat: torch.Tensor | None = None
        self.size = 0
        self.allocations = 0  # how many times a buffer was allocated: once, unless the state grew
        self.pinned = False

    def reserve(self, nbytes: int, pin: bool) -> bool:
        """Make the buffer at least `nbytes` long; True when a new buffer had to be allocated (the state grew)."""
        if self.buffer is not None and nbytes <= self.size and (self.pinned or not pin):
            return False
        self.release()
        size = max(nbytes, ALIGN)
        self.buffer = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        self.flat = torch.frombuffer(self.buffer, dtype=torch.uint8)
        self.size = size
        self.allocations += 1
        if pin and torch.cuda.is_available():
            # Page-locked: copies from the GPU go straight into the pages (non_blocking), at full bandwidth.
            code = torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), size, 0)
            self.pinned = int(code) == 0
        return True

    def release(self) -> None:
        if self.buffer is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        self.flat, self.pinned = None, False
        try:
            self.buffer.close()
        except BufferError:  # a tensor still views it: the mapping goes when the last view does
            pass
        self.buffer, self.size = None, 0

    def snapshot(self, tree):
        """`tree` with its tensors copied into the buffer (replaced by references) and its plain values copied.
        Returns (skeleton, whether the buffer was reallocated). Blocks until every copy is complete."""
        needed = staged_bytes(tree)
        on_gpu = []
        grew = self.reserve(needed, pin=has_cuda_tensor(tree))
        offset = 0

        def walk(value):
            nonlocal offset
            if _stageable(value):
                nbytes = value.numel() * value.element_size()
                if nbytes:
                    target = self.flat[offset:offset + nbytes].view(value.dtype).view(value.shape)
                    target.copy_(value.detach(), non_blocking=value.device.type == "cuda")
                    if value.device.type == "cuda":
                        on_gpu.append(value.device)
                ref = {STAGED: offset, "nbytes": nbytes, "dtype": str(value.dtype).removeprefix("torch."),
                       "shape": list(value.shape), "parameter": isinstance(value, torch.nn.Parameter),
                       "requires_grad": value.requires_grad}
                offset += _aligned(nbytes)
                return ref
            if isinstance(value, torch.Tensor):  # sparse, quantized, ...: a copy of its own travels to the writer
                return value.detach().clone()
            if type(value) in _IMMUTABLE:
                return value
            if isinstance(value, dict):
                return type(value)((k, walk(v)) for k, v in value.items())
            if isinstance(value, (list, tuple, set)):
                return type(value)(walk(v) for v in value)
            return copy.deepcopy(value)

        skeleton = walk(tree)
        for device in set(on_gpu):  # the copies are complete before the writer may read them
            torch.cuda.synchronize(device)
        return skeleton, grew


def has_cuda_tensor(tree) -> bool:
    if isinstance(tree, torch.Tensor):
        return tree.device.type == "cuda"
    if isinstance(tree, dict):
        return any(has_cuda_tensor(v) for v in tree.values())
    if isinstance(tree, (list, tuple, set)):
        return any(has_cuda_tensor(v) for v in tree)
    return False


def rebuild(skeleton, buffer: mmap.mmap):
    """The writer's side: `skeleton` with every reference turned into a tensor viewing `buffer` (a storage of
    its own per tensor, so torch.save writes each tensor's bytes only)."""
    def walk(value):
        if isinstance(value, dict) and STAGED in value:
            dtype, nbytes = getattr(torch, value["dtype"]), value["nbytes"]
            if nbytes:
                raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=value[STAGED])
                tensor = raw.view(dtype).view(value["shape"])
            else:
                tensor = torch.empty(value["shape"], dtype=dtype)
            if value["parameter"]:
                return torch.nn.Parameter(tensor, requires_grad=value["requires_grad"])
            return tensor
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, (list, tuple, set)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(skeleton)
