"""Importing this module loads every module behind phalanx's public names at once, as the first `px.` name in a
process does (`phalanx._load_all`): `phalanx.spawn`'s fork server imports it, so that the ranks it forks start
with them (20 % of the ranks' time in tests/ranks/test_sharding_resume.py). None of those modules reads the
environment or starts a thread as it is imported, so a rank forked with them behaves as one that imported them."""

from . import _load_all

_load_all()
