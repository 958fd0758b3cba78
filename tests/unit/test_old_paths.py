"""Module paths from before the split of engine/ (issue 23) still import, and give the very objects of
the modules their content moved to: scripts and notebooks that reached into phalanx.engine keep working."""

from __future__ import annotations

import importlib

import pytest

# old module -> {public name it defined: the module that defines it now}
MOVED = {
    "phalanx.engine.buckets": dict.fromkeys(
        ["FIRST_BUCKET_BYTES", "plan_buckets", "sparse_indices", "LARGE_TENSOR_NUMEL", "Bucket", "GradBucket"],
        "phalanx.bucket.buckets"),
    "phalanx.engine.step_guard": dict.fromkeys(
        ["DEFAULT_STALL_SECONDS", "PRESENCE_AFTER_SECONDS", "NAMING_GRACE_SECONDS", "stall_seconds", "StepGuard",
         "tag_modulus"], "phalanx.bucket.step_guard"),
    "phalanx.engine.shard_plan": dict.fromkeys(
        ["CHUNK_ALIGN", "Piece", "BucketShard", "chunk_size", "cut_bucket", "pieces_of"], "phalanx.bucket.shard_plan"),
    "phalanx.engine.exchange": {"BucketExchange": "phalanx.exchange.base",
                                "AllReduceExchange": "phalanx.exchange.all_reduce",
                                "CommHookExchange": "phalanx.exchange.comm_hook"},
    "phalanx.engine.shm_exchange": dict.fromkeys(["ALL_REDUCE", "POSTED", "SPLIT", "ShmExchange"],
                                                 "phalanx.exchange.shm"),
    "phalanx.engine.shm_copy_in": dict.fromkeys(["gradient_addresses", "BucketCopyIn"], "phalanx.exchange.shm_copy_in"),
    "phalanx.engine.sharded_exchange": {
        **dict.fromkeys(["STAGING_BUFFERS", "ShardedExchange"], "phalanx.exchange.sharded"),
        **dict.fromkeys(["OPTIMIZER", "GRADIENTS", "SHARD_MODES", "check_shard", "unsupported_with_sharding"],
                        "phalanx.bucket.shard_levels")},
    "phalanx.engine.shm_sharded_exchange": {"ShmShardedExchange": "phalanx.exchange.shm_sharded"},
    "phalanx.engine.phase_timer": dict.fromkeys(["PHASES", "PhaseTimer"], "phalanx.exchange.phase_timer"),
    "phalanx.engine.sharded_optimizer": dict.fromkeys(["WHOLE_TENSOR_OPTIMIZERS", "ShardedOptimizer"],
                                                      "phalanx.sharding.sharded_optimizer"),
    "phalanx.engine.optimizer_view": {"OptimizerView": "phalanx.sharding.optimizer_view"},
    "phalanx.engine.full_state": dict.fromkeys(["whole", "full_model_state", "local_part", "load_full_model_state"],
                                               "phalanx.sharding.full_state"),
    "phalanx.engine.grad_norm": {"clip_sharded_grad_norm_": "phalanx.sharding.grad_norm"},
    "phalanx.engine.shard_waits": {"install_gather_waits": "phalanx.sharding.shard_waits"},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_gives_the_objects_of_the_new_modules(old):
    module = importlib.import_module(old)
    for name, new in MOVED[old].items():
        assert getattr(module, name) is getattr(importlib.import_module(new), name), f"{old}.{name}"


def test_old_paths_work_with_every_import_form():
    import phalanx.engine.exchange
    from phalanx.bucket.buckets import Bucket
    from phalanx.engine.buckets import Bucket as OldBucket
    from phalanx.exchange.all_reduce import AllReduceExchange

    assert OldBucket is Bucket
    assert phalanx.engine.exchange.AllReduceExchange is AllReduceExchange


def test_the_fronts_stay_where_they_were():
    import phalanx
    from phalanx.engine.ddp import DDP, DistributedDataParallel
    from phalanx.engine.fully_sharded import ParameterShardedDDP, choose_blocks  # noqa: F401

    assert phalanx.DistributedDataParallel is DistributedDataParallel is DDP is phalanx.DDP
    assert DistributedDataParallel.__module__ == "phalanx.engine.ddp"
    assert issubclass(ParameterShardedDDP, DistributedDataParallel)
