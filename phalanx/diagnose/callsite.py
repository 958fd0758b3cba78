"""Where in the user's code a collective was issued: the first frame outside phalanx, torch and Python.

A collective launched from a gradient hook has phalanx, torch.autograd and the user's
`loss.backward()` above it; the user's line is what a report must show. Whether a code object is
"ours" is decided once per code object, and each (code, line) is interned once, so the steady cost
is a short walk of `f_back` with two dict look-ups per frame.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

_LIBRARY_DIRS = tuple(sorted({
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # phalanx/
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,
}))
_ours: dict = {}  # code object -> True when it belongs to a library, not to the user


def is_library_file(filename: str) -> bool:
    """True for phalanx's, torch's and the standard library's files (and frozen or generated code)."""
    return filename.startswith(_LIBRARY_DIRS) or filename.startswith("<") or "worker_entry.py" in filename


def describe(filename: str, line: int, function: str) -> str:
    """'train.py:42 in __next__' (relative to the working directory when below it)."""
    try:
        shown = os.path.relpath(filename)
        if shown.startswith(".."):
            shown = filename
    except ValueError:
        shown = filename
    return f"{shown}:{line} in {function}"


class CallSites:
    """Interns the user's call sites into a ring's site table (`add(text) -> id`)."""

    def __init__(self, add):
        self._add = add
        self._ids: dict = {}  # (code, line) -> site id

    def here(self, depth: int = 2) -> int:
        """The site id of the innermost user frame above the caller's caller (0: none)."""
        try:
            frame = sys._getframe(depth)
        except ValueError:
            return 0
        ours = _ours
        while frame is not None:
            code = frame.f_code
            mine = ours.get(code)
            if mine is None:
                mine = ours[code] = is_library_file(code.co_filename)
            if not mine:
                break
            frame = frame.f_back
        if frame is None:
            return 0
        key = (code, frame.f_lineno)
        site = self._ids.get(key)
        if site is None:
            site = self._ids[key] = self._add(describe(code.co_filename, frame.f_lineno, code.co_name))
        return site
