"""`phalanx run`'s live status on a terminal: one line kept under the workers' output, redrawn twice a second.

    phalanx: step 1,240 / 5,000 | 8.3 steps/s | ETA 7m33s

The step is what a StepLog counted on the lowest local rank (its progress record, diagnose/progress.py);
the rate is taken over the last ten seconds; the ETA needs the loop's length (`StepLog(total_steps=)`).
Only when stdout is a terminal: the console's streams are wrapped so that every line written by the
workers' tailer or the launcher first clears the status line, which is drawn again after it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque

from ..diagnose import progress

REDRAW_SECONDS = 0.5
RATE_WINDOW = 10.0  # seconds of history behind steps/s
CLEAR = "\r\x1b[K"


def wanted(stream=None) -> bool:
    """A terminal that can redraw a line, and nobody asked for none (PHALANX_LIVE_STATUS=0)."""
    stream = stream or sys.stdout
    return (os.environ.get("PHALANX_LIVE_STATUS", "1") != "0" and os.environ.get("TERM", "") != "dumb"
            and hasattr(stream, "isatty") and stream.isatty())


def describe(step: int, total: int, history: deque) -> str:
    """The status text from the step, the loop's length (0: unknown) and (time, step) samples.

    >>> describe(150, 1000, deque([(0.0, 100), (10.0, 150)]))
    'phalanx: step 150 / 1,000 | 5.0 steps/s | ETA 2m50s'
    """
    text = f"phalanx: step {step:,}" + (f" / {total:,}" if total else "")
    if len(history) >= 2 and history[-1][0] > history[0][0] and history[-1][1] > history[0][1]:
        rate = (history[-1][1] - history[0][1]) / (history[-1][0] - history[0][0])
        text += f" | {rate:.1f} steps/s" if rate >= 1 else f" | {1 / rate:.1f} s/step"
        if total and total > step:
            text += f" | ETA {_duration((total - step) / rate)}"
    return text


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class LiveStatus:
    """The status line and the stream wrappers that keep it below everything else (see the module docstring)."""

    def __init__(self, stream=None):
        self.out = stream or sys.stdout
        self.lock = threading.Lock()
        self.text = ""
        self.shown = False
        self.history: deque = deque()
        self._next = 0.0
        self._saved = None

    def install(self) -> None:
        """Route sys.stdout (and sys.stderr, when it is a terminal too) through the line keeper."""
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = _Keeper(sys.stdout, self)
        if wanted(sys.stderr):
            sys.stderr = _Keeper(sys.stderr, self)

    def uninstall(self) -> None:
        with self.lock:
            self._clear()
            self.text = ""
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None

    def update(self, directory: str | None) -> None:
        """Read the attempt's progress records (at most every REDRAW_SECONDS) and redraw."""
        now = time.monotonic()
        if directory is None or now < self._next:
            return
        self._next = now + REDRAW_SECONDS
        found = progress.live(directory)
        if found is None:
            return
        step, total = found
        if self.history and step < self.history[-1][1]:
            self.history.clear()  # a new attempt resumed earlier
        self.history.append((now, step))
        while len(self.history) > 2 and now - self.history[0][0] > RATE_WINDOW:
            self.history.popleft()
        with self.lock:
            self.text = describe(step, total, self.history)
            self._draw()

    def _clear(self) -> None:
        if self.shown:
            self.out.write(CLEAR)
            self.out.flush()
            self.shown = False

    def _draw(self) -> None:
        if self.text:
            self.out.write(CLEAR + self.text)
            self.out.flush()
            self.shown = True


class _Keeper:
    """A console stream whose writes clear the status line first and draw it again after a whole line."""

    def __init__(self, stream, status: LiveStatus):
        self._stream, self._status = stream, status

    def write(self, text: str) -> int:
        status = self._status
        with status.lock:
            status._clear()
            written = self._stream.write(text)
            if text.endswith("\n"):
                self._stream.flush()
                status._draw()
        return written

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)
