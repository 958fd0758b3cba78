"""The first code each worker of `phalanx run` executes: run the user's script or module, record its failure.

An uncaught exception is written, as the user's own traceback, to the file torch elastic names in
TORCHELASTIC_ERROR_FILE, so the launcher can print the failing rank's traceback last. The launcher
starts this file by path (`python -u worker_entry.py [-m] target args...`): it imports nothing
from phalanx, so the user's `import phalanx` is the first one and sees a fresh environment.
"""

import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback

# runpy is a frozen module on recent Pythons: its frames name "<frozen runpy>", not a path.
_OUR_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def _user_traceback(exc: BaseException) -> str:
    """The traceback as Python would print it for `python script.py`, without our and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in _OUR_FILES
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in _OUR_FILES):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _record(exc: BaseException, text: str) -> None:
    """Write torch elastic's error-file format, atomically, so the launcher never reads half a file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path + ".tmp", "w") as handle:
            json.dump(data, handle)
        os.replace(path + ".tmp", path)
    except OSError as error:  # a full disk must not hide the user's own exception
        print(f"phalanx: could not write the error file {path}: {error}", file=sys.stderr)


def _answer_stack_signal() -> None:
    """From the first line of the worker on, `phalanx run` can ask for its stacks, even before (or without)
    phalanx.init(): the signal and the file are diagnose/stacks.py's (STACK_SIGNAL, stack_path)."""
    directory, rank = os.environ.get("PHALANX_RUN_DIR"), os.environ.get("RANK")
    if not directory or rank is None:
        return
    number = os.environ.get("PHALANX_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt = os.path.join(directory, f"attempt-{number}")
    try:
        os.makedirs(attempt, mode=0o700, exist_ok=True)
        handle = open(os.path.join(attempt, f"rank-{rank}.stack"), "a")
    except OSError:
        return
    faulthandler.register(signal.SIGRTMIN + 6, file=handle, all_threads=True, chain=False)
    _kept.append(handle)


_kept: list = []


def main(argv: list) -> None:
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: worker_entry.py [-m] target [args...]")
    target, args = argv[0], argv[1:]
    _answer_stack_signal()
    # Same sys.path[0] as `python script.py` / `python -m module` would have (not this directory).
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    sys.argv = [target, *args]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(target), run_name="__main__")
    except SystemExit:
        raise  # an exit code the user chose: not a crash to report
    except KeyboardInterrupt as exc:  # Ctrl-C, or the launcher passing on its SIGINT: show where it stopped
        sys.stderr.write(_user_traceback(exc))
        sys.exit(130)
    except BaseException as exc:  # noqa: B902 - every crash must reach the launcher
        text = _user_traceback(exc)
        _record(exc, text)
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
