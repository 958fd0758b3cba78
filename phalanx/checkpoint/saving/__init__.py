"""What `Checkpointer.save()` does on every rank, in either mode: written now by rank 0 (`synchronous.py`), or
each rank's share handed to its background writer (`in_background.py`, on the machinery of ../background/);
and the small collectives by which every rank acts on the same decision, in a save or a restore
(`decisions.py`).
"""
