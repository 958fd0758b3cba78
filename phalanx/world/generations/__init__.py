"""Live recovery's generations of the world, one part per file: when it is on and how long its waits last
(settings.py), the generation this process is in and the meeting on the next (current.py), the per-step commit
(commit.py), the tree along which the hosts' speakers commit after a generation's first step (commit_tree.py) and the
boards on which a host's ranks agree on it (host_board.py), the survivors' agreement
(agreement.py), the joiners taken in (admissions.py), the watched waits on collectives (waits.py), the models and
loaders that follow (followers.py), the old groups released (release.py), and recovery from a loss (recovery.py).
`world/generation.py` is their face: the names the rest of phalanx calls.
"""
