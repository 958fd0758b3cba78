"""This process in the world, one part per file: what it brings (resources.py: its device, backend, CPU threads, the
timeouts it is given), who it was launched as (identity.py), the ranks it trains with now and the barrier among them
(live.py), and how it joins and leaves the world (lifecycle.py: init() / shutdown()). `world/group.py` is their face.
"""
