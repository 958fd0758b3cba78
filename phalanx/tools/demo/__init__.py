"""`phalanx demo`: the command (`command.py`) and the wine classifier it trains (`wine.py`, which
examples/wine.py runs too)."""
