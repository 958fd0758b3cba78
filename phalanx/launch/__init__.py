"""Starting workers: `phalanx run` on torch's elastic agent (`run.py`), the worker entry point, failure
reports, and `phalanx.spawn` for the mp.spawn style.

May import: world, diagnose, errors, log.
"""
