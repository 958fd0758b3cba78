"""`patch_torch_ddp()`: code that builds `torch.nn.parallel.DistributedDataParallel` by name builds phalanx's.

It rebinds the name in the two modules torch defines and re-exports it (`torch.nn.parallel` and
`torch.nn.parallel.distributed`), nothing else; undoing it binds torch's class there again. A module that
copied the name before the patch (`from torch.nn.parallel import DistributedDataParallel` at its import)
keeps torch's class: patch before importing such a library, or use its own switch (Lightning: the
`phalanx_ddp` strategy).
"""

from __future__ import annotations

import torch.nn.parallel
import torch.nn.parallel.distributed

from ..engine.ddp import DistributedDataParallel
from ..log import logger

_HOMES = (torch.nn.parallel, torch.nn.parallel.distributed)
NAME = "DistributedDataParallel"


class patch_torch_ddp:  # lower case: called like a function, `phalanx.patch_torch_ddp()`
    """Make `torch.nn.parallel.DistributedDataParallel` phalanx's class until `undo()` (or the with-block ends).

    >>> import phalanx                                          # doctest: +SKIP
    >>> phalanx.patch_torch_ddp()          # from here on, for the whole process
    >>> with phalanx.patch_torch_ddp():    # or for a block only
    ...     model = accelerator.prepare(model)    # Accelerate builds phalanx.DistributedDataParallel

    While it holds, `isinstance(model, torch.nn.parallel.DistributedDataParallel)` is true for phalanx's
    models (and false for a torch DDP built before it). Patches nest: each undo restores what its patch
    replaced.
    """

    def __init__(self):
        self._previous = [getattr(home, NAME) for home in _HOMES]
        for home in _HOMES:
            setattr(home, NAME, DistributedDataParallel)
        self.active = True
        logger.info("torch.nn.parallel.DistributedDataParallel is phalanx.DistributedDataParallel until undone")

    def undo(self) -> None:
        """Bind what this patch replaced again (torch's class, unless another patch came first)."""
        if self.active:
            for home, previous in zip(_HOMES, self._previous):
                setattr(home, NAME, previous)
            self.active = False

    def __enter__(self) -> patch_torch_ddp:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def torch_ddp_is_patched() -> bool:
    """Whether `torch.nn.parallel.DistributedDataParallel` is phalanx's class now."""
    return torch.nn.parallel.DistributedDataParallel is DistributedDataParallel
