"""The `phalanx` command: `run` launches training, `demo` and `bench` run the bundled jobs, `report` draws a run,
`allocator` prints the LD_PRELOAD for torchrun or srun, `warm` serves commands from one import of torch.

Subcommands are dispatched by name, each to its own module's `main(argv)`, imported only when
used so that `phalanx run` does not pay for the demo's or benchmarks' imports.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "run": ("phalanx.launch.run", "launch a script on N workers per node (like torchrun); `phalanx run --help`"),
    "demo": ("phalanx.tools.demo.command", "train the bundled demo model on 2 processes"),
    "bench": ("phalanx.tools.bench", "measure phalanx DDP against torch DDP and compute-only"),
    "report": ("phalanx.observe.report", "draw a StepLog's steps.jsonl (loss, throughput, step time) into a PNG"),
    "allocator": ("phalanx.allocator", "print the LD_PRELOAD that gives torchrun / srun ranks phalanx's allocator"),
    "warm": ("phalanx.warm", "serve phalanx commands from one import of torch (set PHALANX_WARM_LAUNCHER)"),
}

USAGE = (f"usage: phalanx {{{','.join(COMMANDS)}}} [options]\n\n"
         + "\n".join(f"  {name:<9} {text}" for name, (_, text) in COMMANDS.items())
         + "\n\nexample: phalanx run --nproc-per-node 2 train.py\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `phalanx` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"phalanx {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"phalanx: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n\n{USAGE}",
              end="", file=sys.stderr)
        return 2
    if name != "warm" and os.environ.get("PHALANX_WARM_LAUNCHER"):
        from .launch import warm_start

        code = warm_start.hand_over(argv)  # run in a fork of a server that imported torch (phalanx/warm.py)
        if code is not None:
            return code
    if name == "run":
        return _run(rest)
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise  # the command exists but one of its imports is missing: show the real error
        print(f"phalanx: `phalanx {name}` is not part of this installation ({module_name} is missing)",
              file=sys.stderr)
        return 2
    # `phalanx warm` forks this very command for each request it serves.
    return int((module.main(rest, command=main) if name == "warm" else module.main(rest)) or 0)


def _run(argv: list[str]) -> int:
    """`phalanx run`: the launcher gets the workers' allocator and forks the workers' server from itself, both
    before it starts a thread (launch/forkserver/prepare.py), then launches. In a worker forked from that server, this
    never returns: the worker's script runs and the process ends as `python script.py` would
    (worker_entry.run_forked)."""
    from .launch import warm_start

    started = warm_start.prepare_launcher(argv)
    if isinstance(started, warm_start.WorkerStart):
        from .launch import worker_entry

        worker_entry.run_forked(started.argv)
    from .launch.run import run

    try:
        return run(argv, server=started)
    finally:
        if started is not None:
            started.close()


if __name__ == "__main__":
    sys.exit(main())
