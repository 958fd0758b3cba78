"""Modules shared by the tests of several files (not test modules themselves)."""
