"""The gradient bucket and what travels with it: the vocabulary every layer of the DDP engine shares.

`buckets.py`: which parameters share a bucket (the plan), its flat storage, the gradients' views
into it, the copies in and out, and the `GradBucket` comm hooks see. `shard_plan.py`: a bucket's cut
into per-rank chunks when sharding. `shard_levels.py`: the `shard` argument's levels and checks.
`step_guard.py`: the step tag in every bucket's last slot and the bounded waits that check it.
It lies below exchange/, sharding/ and engine/, which all hand buckets around, so none of them
has to import another sideways. The step guard adds its waits to diagnose's step clock.

May import: errors, world, diagnose.
"""
