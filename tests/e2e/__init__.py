"""End-to-end tier: phalanx as a user runs it (`phalanx run`, demo, bench, the README, the examples, resume)."""
