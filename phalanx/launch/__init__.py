"""Starting workers: `phalanx run` on torch's elastic agent (`run.py`, its flags and verdict in command/, `agent.py`),
its workers forked from the launcher (forkserver/), a command forked from `phalanx warm` (`warm_start.py`), the
worker entry point, failure reports, stop requests passed on to the workers (`stop.py`), the run summary
(`goodput.py`), and `phalanx.spawn` for the mp.spawn style. Both preload the workers' allocator (phalanx/allocator/).

May import: world, diagnose, allocator, errors, log.
"""
