"""Hangs, desyncs and stragglers: each rank's record of its collectives, and the verdicts read from it.

`recorder` is what the engine calls (one None check when off); `watch` and `verdict` are what
`phalanx run` and the workers' watchdog use to say which rank is stuck, where, and in what.

May import: errors, log.
"""

from .straggler import RankSkew, straggler_report
