"""Unit tier: one process, no child processes, no process group beyond an in-process one; fast."""
