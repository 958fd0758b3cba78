"""Seeing the run: `StepLog`, one record every N steps (loss over every sample of every rank, throughput,
each rank's busy time and the slowest rank, exchange and data waits, peak memory), printed by rank 0 and
written to steps.jsonl and TensorBoard; `phalanx report` draws steps.jsonl (report.py).

May import: diagnose, errors, log, world.
"""

from .steplog import StepLog
