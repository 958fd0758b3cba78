"""Lightning's Fabric and Trainer with strategy="phalanx_ddp" (phalanx/integrations/lightning.py) against the
same runs with strategy="ddp" (torch's class), on 2 CPU ranks under `phalanx run` (tests/e2e/jobs/lightning_job.py;
Lightning takes it for torchrun: the same torch elastic variables):
gradient accumulation (its first micro-batch under no_sync), a checkpoint at the half and a fresh model
resumed from it, and for the Trainer a manual-optimization run and a run with a comm hook. The ddp run
comes first in each test, so a failure of the launch or of Lightning shows there. Marked `trainers`: needs
the trainers extra.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ROOT
from tests.helpers.trainers import phalanx_run, require

pytestmark = pytest.mark.trainers
JOB = ROOT / "tests" / "e2e" / "jobs" / "lightning_job.py"
WRAPPER = {"ddp": "torch.nn.parallel.distributed.DistributedDataParallel",
           "phalanx_ddp": "phalanx.engine.ddp.DistributedDataParallel"}
STEPS, ACCUMULATE = 8, 2  # lightning_job.py's


def _run(api: str, strategy: str, out) -> dict:
    code, output = phalanx_run([JOB, api, strategy, out])
    assert code == 0, f"{api} with strategy={strategy!r} exited with {code}:\n{output}"
    result = torch.load(out / f"{api}-{strategy}.pt", weights_only=True)
    assert result["wrapper"] == WRAPPER[strategy] and result["ranks"] == 2, result
    return result


@pytest.mark.parametrize("api", ["fabric", "trainer"])
def test_phalanx_strategy_ends_where_ddp_ends(api, tmp_path):
    """World size 2: the uninterrupted run, the run resumed from the checkpoint (and the Trainer's manual
    optimization) end allclose to strategy="ddp"; no_sync kept the micro-batch gradients apart as ddp did;
    the checkpoints at the half hold the same weights under the same keys (no `module.`)."""
    require("lightning")
    torch_ddp = _run(api, "ddp", tmp_path)
    ours = _run(api, "phalanx_ddp", tmp_path)
    for key in ("uninterrupted", "resumed", "manual"):
        if key in torch_ddp:
            torch.testing.assert_close(ours[key], torch_ddp[key], rtol=1e-6, atol=1e-7, msg=f"{api}: {key}")
    torch.testing.assert_close(ours["resumed"], ours["uninterrupted"], rtol=1e-6, atol=1e-7)
    # One backward per micro-batch: the first of each step under no_sync (ranks apart), the last synchronized.
    assert (ours["apart"], ours["equal"]) == (torch_ddp["apart"], torch_ddp["equal"])
    assert ours["apart"] > 0 and ours["equal"] > 0 and ours["apart"] + ours["equal"] >= STEPS * ACCUMULATE
    if api == "trainer":  # manual_backward synchronizes every backward
        assert (ours["manual_apart"], ours["manual_equal"]) == (0, STEPS)
        # ddp_comm_hook: Lightning's DDPStrategy registers it on GPUs only, phalanx_ddp on the CPU too; the fp16
        # round trip of the averaged gradients stays within half precision of the unhooked ddp run.
        calls = (torch_ddp["hook_calls"], ours["hook_calls"])
        assert calls[0] == 0 and calls[1] >= STEPS, calls
        torch.testing.assert_close(ours["fp16_hook"], torch_ddp["fp16_hook"], rtol=1e-2, atol=2e-3)
        assert not torch.equal(ours["fp16_hook"], torch_ddp["fp16_hook"])  # the hook did round the gradients

    _same_checkpoints(api, tmp_path)


def _same_checkpoints(api: str, folder) -> None:
    saved = {s: torch.load(folder / f"{api}-{s}.ckpt", weights_only=True) for s in ("ddp", "phalanx_ddp")}
    if api == "trainer":
        assert saved["phalanx_ddp"]["global_step"] == saved["ddp"]["global_step"] == STEPS // 2
        ours, theirs = saved["phalanx_ddp"]["state_dict"], saved["ddp"]["state_dict"]
        steps = [len(saved[s]["optimizer_states"][0]["state"]) for s in ("ddp", "phalanx_ddp")]
    else:
        assert saved["phalanx_ddp"]["step"] == saved["ddp"]["step"] == STEPS // 2
        ours, theirs = saved["phalanx_ddp"]["model"], saved["ddp"]["model"]
        steps = [len(saved[s]["optimizer"]["state"]) for s in ("ddp", "phalanx_ddp")]
    assert list(ours) == list(theirs) and not any(key.startswith("module.") for key in ours), (list(ours), list(theirs))
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-7, msg=f"{api} checkpoint: {key}")
    assert steps[0] == steps[1] > 0  # the optimizer's state (momentum) is saved for every parameter
