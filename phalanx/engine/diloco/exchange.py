"""The cross-host average of one local rank's chunk of a pseudo-gradient, on the cross-host group of its local index.

`Exact` all-reduces the chunk in its dtype. `Compressed` cannot: a sum of int8 overflows, and fp16 would add in
fp16. It runs a reduce-scatter and an all-gather of its own: each host's chunk, plus the error it left out last
time, is cut into N pieces and encoded; host k receives every host's piece k (an all-to-all), decodes and adds
them in host order in fp32 (or the parameters' fp64), encodes the mean plus its own earlier error, and every host
all-gathers the N encoded means. Both halves keep what the codec lost and add it to the next one (error
feedback), so nothing of the pseudo-gradient is dropped for good. Each rank sends 2(N-1)/N of the chunk's
encoded bytes: a ring all-reduce's count, at the codec's size.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ...world import generation
from .codec import codec

WHAT = "DiLoCo's outer step across hosts"  # a wait watched for a lost peer under live recovery (generation.wait_for)


class Exact:
    """The chunk's mean over the hosts by one all-reduce, in its own dtype (compress=None)."""

    def __init__(self, network, hosts: int):
        self.network, self.hosts = network, hosts

    def wire_bytes(self, chunk: torch.Tensor) -> int:
        """The bytes this rank sends across hosts for `chunk`: a ring all-reduce's 2(N-1)/N of it."""
        return 2 * (self.hosts - 1) * chunk.numel() * chunk.element_size() // self.hosts

    def average(self, chunk: torch.Tensor, key: str) -> torch.Tensor:
        generation.wait_for(dist.all_reduce(chunk, group=self.network, async_op=True), WHAT)
        return chunk.div_(self.hosts)

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Nothing is lost, nothing kept."""


class Compressed:
    """The chunk's mean over the hosts through a codec, with error feedback (compress="int8" or "fp16"). The
    residuals are this rank's (its host's chunk), keyed by the caller's `key` (fragment and dtype group)."""

    def __init__(self, name: str, network, hosts: int):
        self.codec = codec(name)
        self.network, self.hosts = network, hosts
        self.residuals: dict[str, torch.Tensor] = {}
        # Gloo moves these bytes on the CPU only (no all-to-all of CUDA tensors); other backends where they lie.
        self.on_cpu = dist.get_backend(network) == "gloo"

    def wire_bytes(self, chunk: torch.Tensor) -> int:
        piece = -(-chunk.numel() // self.hosts)
        return 2 * (self.hosts - 1) * self.codec.size(piece)

    def average(self, chunk: torch.Tensor, key: str) -> torch.Tensor:
        hosts, n, code = self.hosts, chunk.numel(), self.codec
        dtype = chunk.dtype if chunk.element_size() >= 4 else torch.float32  # added in fp32 at least
        piece = -(-n // hosts)
        x = torch.zeros(hosts * piece, dtype=dtype, device=chunk.device)
        x[:n] = chunk
        x += self._residual(f"{key}/sent", x)
        encoded = [code.encode(part) for part in x.split(piece)]
        self.residuals[f"{key}/sent"] = x - torch.cat([code.decode(e, piece, dtype) for e in encoded])
        size = code.size(piece)
        wire = torch.cat(encoded)
        wire = wire.cpu() if self.on_cpu else wire
        received = torch.empty_like(wire)
        # host k gets every host's piece k
        generation.wait_for(dist.all_to_all_single(received, wire, group=self.network, async_op=True), WHAT)
        parts = [code.decode(received[h * size:(h + 1) * size], piece, dtype).to(x.device) for h in range(hosts)]
        total = parts[0]
        for part in parts[1:]:  # in host order on every host: the same bits everywhere
            total = total + part
        mean = total / hosts + self._residual(f"{key}/mean", total)
        mine = code.encode(mean)
        self.residuals[f"{key}/mean"] = mean - code.decode(mine, piece, dtype)
        mine = mine.cpu() if self.on_cpu else mine
        gathered = [torch.empty_like(mine) for _ in range(hosts)]
        generation.wait_for(dist.all_gather(gathered, mine, group=self.network, async_op=True), WHAT)
        means = torch.cat([code.decode(g, piece, dtype) for g in gathered])
        return means[:n].to(device=chunk.device, dtype=chunk.dtype)

    def _residual(self, key: str, like: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(key)
        return torch.zeros_like(like) if residual is None else residual.to(like.device)

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's residuals, for the checkpoint's per-rank part."""
        return {f"residual/{key}": value.detach().clone() for key, value in self.residuals.items()}

    def load_state(self, saved: dict[str, torch.Tensor]) -> None:
        self.residuals = {key[len("residual/"):]: value.clone() for key, value in saved.items()
                          if key.startswith("residual/")}


def exchange(compress: str | None, network, hosts: int):
    """The exchange `DiLoCo(compress=...)` names."""
    return Exact(network, hosts) if compress is None else Compressed(compress, network, hosts)


class Link:
    """The one caller of the cross-host group. With a delay, a worker thread runs every cross-host collective in
    the order submitted (the same on every rank: Gloo matches collectives by their order), overlapped with the
    next inner steps; without one, each runs at once on the caller's thread."""

    def __init__(self, background: bool):
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="phalanx-diloco") if background else None

    def submit(self, fn, *args) -> Future:
        if self._worker is not None:
            return self._worker.submit(fn, *args)
        done: Future = Future()
        done.set_result(fn(*args))
        return done
