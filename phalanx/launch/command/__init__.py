"""`phalanx run` as a command: what it reads (flags.py: the flags, checked together, and the defaults an srun step
gives) and what it answers (outcome.py: how the run ended, its exit code, the lines printed last). Between the two,
run.py launches.
"""
