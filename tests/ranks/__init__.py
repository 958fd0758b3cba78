"""Ranks tier: library code in several processes (phalanx.testing.run_ranks, phalanx.spawn, a child process)."""
