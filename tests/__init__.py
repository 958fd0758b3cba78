"""phalanx's test suite, in three tiers: unit/, ranks/, e2e/ (see conftest.py)."""
