"""phalanx.patch_torch_ddp() rebinds torch's DDP name in its two homes and undoes it (pure: no process group)."""

from __future__ import annotations

import json
import sys

import pytest
import torch.nn.parallel
import torch.nn.parallel.distributed

import phalanx
from phalanx.errors import WorldConfigError
from phalanx.integrations import with_phalanx_ddp

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


def test_the_runner_runs_a_script_unmodified_under_the_patch_then_undoes_it(tmp_path, monkeypatch):
    script, seen = tmp_path / "train.py", tmp_path / "seen.json"
    script.write_text("import json, sys, torch.nn.parallel\n"
                      "import phalanx\n"
                      "patched = torch.nn.parallel.DistributedDataParallel is phalanx.DistributedDataParallel\n"
                      "with open(sys.argv[1], 'w') as f:\n"
                      "    json.dump([patched, sys.argv, __name__, sys.path[0]], f)\n")
    monkeypatch.setattr(sys, "argv", ["runner"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with_phalanx_ddp.main([str(script), str(seen), "--epochs", "3"])
    assert json.loads(seen.read_text()) == [True, [str(script), str(seen), "--epochs", "3"], "__main__", str(tmp_path)]
    assert _bound() == (TORCH_DDP, TORCH_DDP)


@pytest.mark.parametrize("argv, needle", [([], "no script"), (["--epochs", "3"], "no script"), (["-m"], "no script"),
                                          (["missing.py"], "does not exist")])
def test_the_runner_without_a_script_is_a_typed_error(argv, needle):
    with pytest.raises(WorldConfigError, match=needle):
        with_phalanx_ddp.main(argv)
