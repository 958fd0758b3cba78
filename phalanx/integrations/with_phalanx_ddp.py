"""Run a script unmodified, with phalanx's DDP in the place of torch's: a script that builds
`torch.nn.parallel.DistributedDataParallel` by name (its own code, Accelerate's, the Transformers Trainer's)
builds phalanx's. Under any launcher, as a module in front of the script:

    phalanx run --nproc-per-node 2 -m phalanx.integrations.with_phalanx_ddp train.py --epochs 3
    torchrun --nproc-per-node 2 -m phalanx.integrations.with_phalanx_ddp train.py --epochs 3
    accelerate launch -m phalanx.integrations.with_phalanx_ddp train.py --epochs 3
    python -m phalanx.integrations.with_phalanx_ddp -m mypkg.train --epochs 3      # a module, not a file

It is `patch_torch_ddp()` (patch.py) held for the whole run of the script, which runs as `__main__` with
the `sys.argv` and `sys.path[0]` that `python train.py` (or `python -m mypkg.train`) would give it.
"""

from __future__ import annotations

import os
import runpy
import sys

from ..errors import WorldConfigError, explain
from .patch import patch_torch_ddp

USAGE = "python -m phalanx.integrations.with_phalanx_ddp [-m MODULE | SCRIPT] [ARGS...]"


def target_of(argv: list[str]) -> tuple[str, bool, list[str]]:
    """(script or module, whether it is a module, its arguments); WorldConfigError for a command line without one."""
    as_module = bool(argv) and argv[0] == "-m"
    rest = argv[1:] if as_module else argv
    if not rest or (not as_module and rest[0].startswith("-")):
        raise WorldConfigError(explain(
            "no script to run with phalanx's DDP in torch's place", seen=" ".join(argv) or "no arguments",
            expected=USAGE, fix="Name the training script (or -m and its module) after the runner's name."))
    target = rest[0]
    if not as_module and not os.path.isfile(target):
        raise WorldConfigError(explain(
            "the training script does not exist", seen=repr(target), expected=f"a file (relative to {os.getcwd()})",
            fix="Check the path, or pass -m MODULE to run a module."))
    return target, as_module, rest[1:]


def main(argv: list[str]) -> None:
    target, as_module, args = target_of(argv)
    sys.argv = [target, *args]
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    with patch_torch_ddp():
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(target), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
