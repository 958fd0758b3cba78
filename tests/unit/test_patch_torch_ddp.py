"""phalanx.patch_torch_ddp() rebinds torch's DDP name in its two homes and undoes it (pure: no process group)."""

from __future__ import annotations

import torch.nn.parallel
import torch.nn.parallel.distributed

import phalanx

TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel


def _bound() -> tuple:
    return torch.nn.parallel.DistributedDataParallel, torch.nn.parallel.distributed.DistributedDataParallel


def test_the_call_patches_until_undone():
    patch = phalanx.patch_torch_ddp()
    try:
        assert _bound() == (phalanx.DistributedDataParallel, phalanx.DistributedDataParallel)
        assert phalanx.torch_ddp_is_patched()
    finally:
        patch.undo()
    assert _bound() == (TORCH_DDP, TORCH_DDP) and not phalanx.torch_ddp_is_patched()
    patch.undo()  # a second undo changes nothing
    assert _bound() == (TORCH_DDP, TORCH_DDP)


def test_the_context_manager_undoes_on_an_exception():
    try:
        with phalanx.patch_torch_ddp() as patch:
            assert patch.active and phalanx.torch_ddp_is_patched()
            raise KeyError("inside")
    except KeyError:
        pass
    assert _bound() == (TORCH_DDP, TORCH_DDP) and not patch.active


def test_patches_nest_and_each_undo_restores_what_it_replaced():
    outer = phalanx.patch_torch_ddp()
    with phalanx.patch_torch_ddp():
        assert phalanx.torch_ddp_is_patched()
    assert phalanx.torch_ddp_is_patched()  # the outer patch still holds
    outer.undo()
    assert _bound() == (TORCH_DDP, TORCH_DDP)
