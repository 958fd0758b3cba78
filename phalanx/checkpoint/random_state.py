"""Every process's random number generators as plain tensors, so a resumed run draws the same numbers.

Covers torch's CPU generator, the CUDA generator of this rank's device, Python's `random` and
NumPy's global generator. States are tensors only (no pickled objects), so they load with
weights_only=True, and `gather` moves every rank's states to every rank as byte tensors.
"""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import torch
import torch.distributed as dist

from ..world import generation
from ..world import group as world

ENTRY = "entry/"  # the prefix of an entry's own per-rank random state: "entry/<name>/<key>"


def own_device() -> torch.device:
    """This rank's device (whose CUDA generator is its own): the world's, or the CPU before init()."""
    return world.device() if world.is_initialized() else torch.device("cpu")


def capture(device: torch.device | None = None, state: dict | None = None) -> dict[str, torch.Tensor]:
    """This process's generator states; CUDA only for `device` (a rank never touches another's GPU). With the
    checkpoint's `state`, also the random state of its entries that keep one per rank (`rank_random_state()`: a
    loader's generator state at the start of its pass, from which a resumed pass draws its workers' seeds)."""
    states = {"torch": torch.get_rng_state()}
    for name, value in (state or {}).items():
        if hasattr(value, "rank_random_state"):
            states.update({f"{ENTRY}{name}/{key}": tensor for key, tensor in value.rank_random_state().items()})
    if device is not None and device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    version, internal, gauss_next = random.getstate()
    states["python"] = torch.tensor([version, *internal], dtype=torch.int64)
    states["python_gauss"] = torch.tensor([gauss_next is not None, gauss_next or 0.0], dtype=torch.float64)
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states["numpy"] = torch.tensor([position, has_gauss, *keys.tolist()], dtype=torch.int64)
    states["numpy_gauss"] = torch.tensor([cached_gaussian], dtype=torch.float64)
    return states


def restore(states: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Set this process's generators to `states` (from `capture`)."""
    torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
    python = states["python"].tolist()
    has_gauss, gauss = states["python_gauss"].tolist()
    random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    numpy = states["numpy"].tolist()
    keys = np.array(numpy[2:], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, numpy[0], numpy[1], float(states["numpy_gauss"][0])))


def restore_entries(states: dict[str, torch.Tensor], state: dict) -> None:
    """Hand each entry of `state` its own per-rank random state from `states` (capture's, of this rank)."""
    for name, value in state.items():
        prefix = f"{ENTRY}{name}/"
        if hasattr(value, "load_rank_random_state"):
            value.load_rank_random_state({key[len(prefix):]: tensor for key, tensor in states.items()
                                          if key.startswith(prefix)})


def reseed_derived(states: dict[str, torch.Tensor], rank: int, device: torch.device | None = None) -> int:
    """Seed every generator from (`states`, `rank`): a new rank gets a stream of its own, reproducibly."""
    digest = hashlib.sha256(states["torch"].cpu().numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1  # torch seeds are < 2**63
    torch.manual_seed(seed)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    return seed


def encode(states: dict[str, torch.Tensor]) -> torch.Tensor:
    """Pack named tensors into one uint8 tensor: an 8-byte header length, a JSON header, the raw bytes."""
    layout = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in states.items()]
    header = json.dumps(layout).encode()
    parts = [torch.tensor(list(len(header).to_bytes(8, "little")), dtype=torch.uint8),
             torch.frombuffer(bytearray(header), dtype=torch.uint8)]
    parts += [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in states.values()]
    return torch.cat(parts)


def decode(blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of `encode`."""
    blob = blob.cpu()
    header_size = int.from_bytes(bytes(blob[:8].tolist()), "little")
    layout = json.loads(bytes(blob[8:8 + header_size].tolist()).decode())
    offset, states = 8 + header_size, {}
    for name, dtype_name, shape in layout:
        dtype = getattr(torch, dtype_name)
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        # clone() gives the bytes an aligned storage of their own before reinterpreting them
        states[name] = blob[offset:offset + size].clone().view(dtype).reshape(shape)
        offset += size
    return states


def gather(states: dict[str, torch.Tensor], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Every rank's `states`, in rank order, on every rank (collective: all ranks must call it)."""
    if not dist.is_initialized() or world.group_size() == 1:
        return [states]
    group = world.live_group()  # after a loss, the ranks left
    return [decode(blob) for blob in generation.all_gather_bytes(encode(states).to(device), group, "the random states")]
