"""Where processes first meet, before there is a world: the rendezvous store (store.py), the launchers' meetings
(`--nnodes N`: rendezvous.py and its roll call, roll_call.py; `--nnodes MIN:MAX`: membership.py, torch's rounds),
the lines that say who is awaited (waiting.py), and an srun step's nodes (slurm.py).
"""
