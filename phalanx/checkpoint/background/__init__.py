"""Saves written in the background: a snapshot of the state into a reused staging buffer (`staging.py`), a
writer process per rank that writes, fsyncs and commits it (`writer.py`), and one rank's bookkeeping of
them, at most one write in flight (`saves.py`).
"""

from .saves import BackgroundSaves, settle_directory
from .writer import commit, report
