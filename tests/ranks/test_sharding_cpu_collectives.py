"""shard="parameters" on the CPU: phalanx's FSDP2 collectives (sharding/cpu_collectives.py) against torch's.

No backward prefetch and the in-place reduce-scatter hold fewer whole blocks in backward; the bits
must be those of torch's defaults: the same parameters after AdamW steps, with clipping and with
no_sync accumulation, at 2 and 3 ranks (uneven shards, padded reduce-scatter inputs).
"""

import pytest
import torch

from phalanx.sharding import cpu_collectives
from phalanx.sharding.cpu_collectives import InPlaceReduceScatter
from phalanx.testing import run_ranks
from tests.helpers.shard_cases import train


def _both(rank, world):
    out = {}
    for name, options in {"plain": {}, "clip": {"clip": 0.5}, "no_sync": {"accumulate": 2}}.items():
        ours = train(rank, world, "parameters", steps=6, **options)
        installed = [isinstance(group._reduce_scatter_comm, InPlaceReduceScatter)
                     for block in ours["model"].blocks for group in block._get_fsdp_state()._fsdp_param_groups]
        hold_less = cpu_collectives.hold_less
        cpu_collectives.hold_less = lambda *args: None  # torch's defaults
        try:
            import phalanx.engine.fully_sharded as engine
            engine.hold_less = cpu_collectives.hold_less
            theirs = train(rank, world, "parameters", steps=6, **options)
        finally:
            cpu_collectives.hold_less = engine.hold_less = hold_less
        out[name] = {"installed": installed,
                     "equal": all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"])),
                     "norms": (ours["norms"], theirs["norms"])}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_collectives_give_torchs_bits(world):
    for rank, per_rank in enumerate(run_ranks(_both, world, (world,), timeout=240)):
        for name, outcome in per_rank.items():
            assert outcome["installed"] and all(outcome["installed"]), f"rank {rank} {name}"
            assert outcome["equal"], f"rank {rank} {name}: parameters differ from torch's collectives'"
            assert outcome["norms"][0] == outcome["norms"][1], f"rank {rank} {name}"
