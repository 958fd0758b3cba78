"""Run a script with torch's DDP class or phalanx's in its place:
`with_ddp_class.py torch|phalanx [--cpu-drops-device-ids] SCRIPT ARGS...`.

The script runs unmodified, as `__main__`; with `phalanx`, phalanx.patch_torch_ddp() holds while it runs.
`--cpu-drops-device-ids`: the class bound to torch's name (either one) takes `device_ids`/`output_device`
for a CPU module as None. Scripts written for GPUs pass `device_ids=[local rank]`, which both classes
refuse on the CPU; nothing else changes. At exit each rank prints how many models the class built; the
process group is destroyed after the script (left to the interpreter's exit, Gloo can abort there).
"""

import atexit
import os
import runpy
import sys

import torch.distributed as dist
import torch.nn.parallel
import torch.nn.parallel.distributed

import phalanx


def cpu_drops_device_ids(cls: type) -> type:
    class DistributedDataParallel(cls):
        def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
            if all(p.device.type == "cpu" for p in module.parameters()):
                device_ids = output_device = None
            super().__init__(module, device_ids, output_device, *args, **kwargs)
    return DistributedDataParallel


def say(line: str) -> None:
    """One line in one write: the ranks share the output, and a line must not be cut by the other's."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


_reports: list = []  # the count of models built, said once: at close_world(), else at exit


def _report() -> None:
    while _reports:
        _reports.pop()()


def install(which: str, drop_device_ids: bool) -> None:
    """Bind `which` class to torch's name (and the shim), and count the models it builds."""
    if which == "phalanx":
        phalanx.patch_torch_ddp()
    elif which != "torch":
        sys.exit(f"with_ddp_class.py: the first argument is torch or phalanx, not {which!r}")
    cls = torch.nn.parallel.DistributedDataParallel
    built, init = [], cls.__init__

    def counting_init(self, *args, **kwargs):
        built.append(type(self))
        init(self, *args, **kwargs)
    cls.__init__ = counting_init
    _reports.append(lambda: say(f"with_ddp_class: rank {os.environ.get('RANK')} built {len(built)} "
                                f"{cls.__module__}.{cls.__name__}"))
    atexit.register(_report)
    if drop_device_ids:
        shimmed = cpu_drops_device_ids(cls)
        torch.nn.parallel.DistributedDataParallel = torch.nn.parallel.distributed.DistributedDataParallel = shimmed


def close_world() -> None:
    """Both ranks done, the process group destroyed: a group left to the interpreter's exit can abort there. The
    count is said first: a rank that exits with an error has the launcher stop the others, maybe before their exit."""
    _report()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def split_arguments(argv: list[str]) -> tuple[str, bool, list[str]]:
    which, *rest = argv
    drop = bool(rest) and rest[0] == "--cpu-drops-device-ids"
    return which, drop, rest[1:] if drop else rest


if __name__ == "__main__":
    which, drop, rest = split_arguments(sys.argv[1:])
    install(which, drop)
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
    close_world()
