"""`export_weights` / `load_weights`: a model's whole weights in one safetensors file, for inference.

The file is in the safetensors layout (an 8-byte header length, a JSON header giving each tensor's
dtype, shape and byte range, then the raw bytes), which the `safetensors` package and most
inference tools read, and which loads without any code execution (no pickle at all). A model
sharded with shard="parameters" is exported one tensor at a time: every rank takes part in
gathering each tensor, rank 0 writes it and lets it go, so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import mmap as memory_map
import struct
from pathlib import Path

import torch

from ..errors import CheckpointError, CheckpointWriteError, explain
from ..world import group as world
from . import atomic_files
from .entries import unwrap

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
CODES = {code: dtype for dtype, code in DTYPES.items()}


def _header(state: dict) -> bytes:
    entries, offset = {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    entries["__metadata__"] = {"format": "pt", "written_by": "phalanx"}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def export_weights(model: torch.nn.Module, path) -> Path | None:
    """Collective: write `model`'s state dict (unwrapped: plain keys) as a safetensors file at `path`,
    atomically; returns the path on rank 0 (None elsewhere). Works at every shard level.

    >>> px.export_weights(model, "runs/gpt/weights.safetensors")     # doctest: +SKIP
    """
    from ..sharding.full_state import whole  # the engine is needed only here (DTensor shards)

    path = Path(path)
    state = {k: v for k, v in unwrap(model).state_dict().items() if isinstance(v, torch.Tensor)}
    unsupported = sorted({str(v.dtype) for v in state.values() if v.dtype not in DTYPES})
    if unsupported:
        raise CheckpointError(explain("export_weights() writes real and integer tensors only",
                                      rank=world.group_rank(), seen=unsupported, expected=sorted(map(str, DTYPES)),
                                      fix="Convert those entries, or save them with phalanx.Checkpointer."))
    failures: list[BaseException] = []

    def stream(file) -> None:
        file.write(_header(state))
        for value in state.values():  # every rank gathers the same tensors in the same order
            tensor = whole(value, keep=True).detach().contiguous().cpu()
            if not failures:
                try:
                    file.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
                except OSError as exc:  # keep gathering: the other ranks are in the same loop
                    failures.append(exc)
        if failures:
            raise failures[0]

    if world.group_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            atomic_files.write_atomic(path, stream)
        except OSError as exc:
            raise CheckpointWriteError(explain(f"could not export the weights to {path}", rank=0,
                                               seen=f"{type(exc).__name__}: {exc}", expected="a writable path",
                                               fix="Free space or fix permissions.")) from exc
    else:
        for value in state.values():
            whole(value, keep=False)
    return path if world.group_rank() == 0 else None


def load_weights(path, device="cpu", *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Read a safetensors file (from export_weights or elsewhere) into a state dict; no code is executed.

    With `mmap=True` the tensors are views of the file mapped into memory (copy-on-write, on the CPU):
    nothing is read until used, so a rank that copies its slices of each (a meta-built
    `shard="parameters"` model's `init=`) reads only those.

    >>> model = px.DistributedDataParallel(meta_net, shard="parameters",             # doctest: +SKIP
    ...                                    init=px.load_weights("weights.safetensors", mmap=True))
    """
    path = Path(path)
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
        start = 8 + length
        mapped = memory_map.mmap(file.fileno(), 0, access=memory_map.ACCESS_COPY) if mmap else None
        state = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            dtype = CODES[entry["dtype"]]
            if mapped is not None:
                if start + end > len(mapped):
                    raise CheckpointError(explain(f"{path} is truncated", seen=f"{len(mapped)} bytes",
                                                  expected=f"{start + end} for {name}",
                                                  fix="Export the weights again."))
                count = (end - begin) // dtype.itemsize
                tensor = torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin) if count \
                    else torch.empty(0, dtype=dtype)
                state[name] = tensor.reshape(entry["shape"])
                continue
            file.seek(start + begin)
            data = bytearray(file.read(end - begin))
            if len(data) != end - begin:
                raise CheckpointError(explain(f"{path} is truncated", seen=f"{len(data)} bytes of {name}",
                                              expected=f"{end - begin}", fix="Export the weights again."))
            tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            state[name] = tensor.reshape(entry["shape"]).to(device)
    return state
