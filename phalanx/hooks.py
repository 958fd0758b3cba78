"""Communication hooks: how a bucket of gradients is averaged across ranks, with torch's contract.

A hook is `hook(state, bucket) -> torch.futures.Future[Tensor]` whose result is the bucket's averaged
gradients, so the same hooks run on phalanx DDP and on torch DDP. torch's stock hooks are re-exported
as they are (state None means the model's process group); phalanx adds the shared-memory hook.

>>> model.register_comm_hook(None, phalanx.hooks.fp16_compress_hook)               # doctest: +SKIP
>>> model.register_comm_hook(phalanx.shm_communicator(), phalanx.hooks.shm_allreduce_hook)
"""

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "shm_allreduce_hook"]


def shm_allreduce_hook(state, bucket):  # unannotated: torch DDP accepts no annotation but torch's own Future
    """Average `bucket.buffer()` across the ranks of one host through shared memory.

    `state` is a ShmCommunicator (see `phalanx.shm_communicator`); returns a torch.futures.Future
    holding the averaged buffer.

    >>> model.register_comm_hook(phalanx.shm_communicator(), shm_allreduce_hook)   # doctest: +SKIP
    """
    return state.allreduce_(bucket.buffer())
