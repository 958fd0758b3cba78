"""Checkpoints: what is saved (`checkpointer.py`), how it reaches the disk atomically and loads without
running code (`atomic_files.py`), and every rank's random states (`random_state.py`)."""

from .checkpointer import Checkpointer, unwrap
