"""The shard levels of DistributedDataParallel's `shard` argument, its checks, and the error for a feature
a level does not support.

"optimizer" (ZeRO-1) and "gradients" (ZeRO-2) are reduce-scatters in the exchange (exchange/sharded.py);
"parameters" is torch's FSDP2 behind DDP's surface (engine/fully_sharded.py). The exchange, the
sharding layer and the front all name the levels: they are defined here, below them all.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import ShardingError, explain

OPTIMIZER, GRADIENTS = "optimizer", "gradients"
SHARD_MODES = ("none", OPTIMIZER, GRADIENTS, "parameters")  # "parameters": torch's FSDP2 (fully_sharded.py)


def check_shard(shard: str, as_view: bool, named: list) -> str:
    """DistributedDataParallel's `shard` argument, checked against the rest of its configuration."""
    if shard not in SHARD_MODES:
        raise ShardingError(explain("DistributedDataParallel shard must name a sharding mode", seen=f"shard={shard!r}",
                                    expected=" | ".join(repr(m) for m in SHARD_MODES),
                                    fix="Pass shard='optimizer' (ZeRO-1), 'gradients' (ZeRO-2) or 'parameters' "
                                        "(FSDP2)."))
    on_meta = [name for name, p in named if p.is_meta]
    if on_meta:
        raise ShardingError(explain(
            "a model built on the meta device is materialized only by shard='parameters'", rank=dist.get_rank(),
            seen=f"shard={shard!r} and meta parameters {on_meta[:5]}", expected="parameters with values",
            fix="Use shard='parameters' (it initializes one module at a time), or build the model on a real "
                "device (net.to_empty(device=...) and your init)."))
    if shard == "gradients" and as_view:
        raise ShardingError(explain(
            "gradient_as_bucket_view does not apply with shard='gradients'", rank=dist.get_rank(),
            seen="gradient_as_bucket_view=True", expected="False",
            fix="Drop gradient_as_bucket_view: with shard='gradients' the full gradients are freed once reduced."))
    if shard != "none":
        strided = [name for name, p in named if not p.is_contiguous()]
        if strided:
            raise ShardingError(explain(
                "sharding cuts parameters into flat pieces: they must be contiguous", rank=dist.get_rank(),
                seen=f"non-contiguous parameters {strided[:5]}", expected="contiguous parameters",
                fix="Make them contiguous before wrapping (p.data = p.data.contiguous()), or use shard='none'."))
    return shard


def unsupported_with_sharding(feature: str, shard: str, fix: str) -> ShardingError:
    return ShardingError(explain(f"{feature} does not work with sharded DistributedDataParallel",
                                 rank=dist.get_rank(), seen=f"shard={shard!r}", expected="shard='none'", fix=fix))
