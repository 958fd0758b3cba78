"""Sharding: the sharded optimizers, full-state conversions, the sharded gradient norm."""
