"""Sharding above the exchange: the optimizers and helpers of the shard levels.

`sharded_optimizer.py` re-targets the user's optimizer at the chunks this rank owns ("optimizer",
"gradients"), on the views `optimizer_view.py` shares with the FSDP2 level's optimizer;
`grad_norm.py` is `clip_grad_norm_` over sharded gradients; `shard_waits.py` the forward hooks that
wait for each layer's all-gather; `full_state.py` whole tensors out of FSDP2's shards and back;
`shard_copies/` keeps a copy of each rank's optimizer shard on another rank, for live recovery.
For the FSDP2 level: `meta_init.py` materializes a model built on the meta device one module at a
time, `param_retarget.py` moves an optimizer built over the original parameters onto the shards, and
`stray_optimizers.py` refuses a step of an optimizer that would update tensors the model no longer
trains (at every level).
The reduce-scatter itself is exchange/sharded.py; the FSDP2 front is engine/fully_sharded.py.

May import: bucket, exchange, errors, log, world.
"""
