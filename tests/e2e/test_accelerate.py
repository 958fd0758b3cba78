"""Accelerate's own test scripts (shipped in its wheel, accelerate/test_utils/scripts/) on 2 CPU ranks, with
torch's DDP class and then with phalanx's in its place (phalanx.patch_torch_ddp()): torch's run first in
each test, so that a failure of the launch shows there and a failure of phalanx's class shows alone.

Launch: torchrun with ACCELERATE_USE_CPU=1 (the variable `accelerate launch --cpu` sets; that command itself
starts one process on one host, or goes through mpirun) for test_script.py, Accelerate's main script, as its
users launch it; `phalanx run`, whose workers get the same torch elastic variables and start as forks, for
the other cases. Without the variable, Accelerate under torchrun on a machine without GPUs sees no
distributed run and builds no DDP model at all. The scripts run unmodified
(tests/e2e/jobs/with_ddp_class.py); test_ddp_comm_hook.py passes `device_ids=[local rank]` to its
reference model, which both classes refuse on the CPU, so there the class bound to torch's name takes
them as None (a shim applied to both classes). Marked `trainers`: needs the trainers extra.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers.trainers import phalanx_run, require, torchrun

pytestmark = pytest.mark.trainers
JOBS = ROOT / "tests" / "e2e" / "jobs"
CPU = {"ACCELERATE_USE_CPU": "1"}
CLASS_OF = {"torch": "torch.nn.parallel.distributed.DistributedDataParallel",
            "phalanx": "phalanx.engine.ddp.DistributedDataParallel"}
BF16_REFUSED = "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+"  # torch's, on CPU


def _script(name: str) -> Path:
    accelerate = require("accelerate")
    return Path(accelerate.__file__).parent / "test_utils" / "scripts" / name


def _built(output: str, which: str) -> list[int]:
    """How many DDP models of `which` class each rank built (printed by with_ddp_class.py at exit)."""
    found = re.findall(rf"with_ddp_class: rank (\d) built (\d+) {re.escape(CLASS_OF[which])}\n", output)
    assert sorted(rank for rank, _ in found) == ["0", "1"], output
    return [int(count) for _, count in found]


def _run_script(which: str, script, *options) -> tuple[int, str]:
    launch = torchrun if script.name == "test_script.py" else phalanx_run
    return launch([JOBS / "with_ddp_class.py", which, *options, script], env=CPU)


def _cases(output: str) -> dict[str, str]:
    """{case: "passed" | "failed: ..."} from accelerate_cases.py (both ranks must agree)."""
    seen: dict[str, set] = {}
    for label, verdict in re.findall(r"case (.+?): (passed|failed: [^\n]*)\n", output):
        seen.setdefault(label, set()).add(verdict)
    assert all(len(v) == 1 for v in seen.values()), seen
    return {label: verdicts.pop() for label, verdicts in seen.items()}


@pytest.mark.parametrize("name", ["test_sync.py", "test_script.py"])
def test_script_passes_with_torch_ddp_and_with_phalanx_ddp(name):
    """World size 2: the script passes unmodified with torch's class, then with phalanx's, which built the models."""
    script = _script(name)
    for which in ("torch", "phalanx"):
        code, output = _run_script(which, script)
        assert code == 0, f"{name} with {which}'s DDP class exited with {code}:\n{output}"
        assert min(_built(output, which)) > 0, output
    if name == "test_sync.py":  # the case that reaches for model.reducer (trigger_sync_in_backward)
        assert "**Test Distributed `no_sync` context manager with multiple forwards**" in output


def test_sync_gradient_accumulation_cases_pass_with_both_classes():
    """World size 2: test_sync.py's gradient-accumulation cases (its main() runs them on GPUs only), each called
    on the CPU with torch's class and with phalanx's: all pass with both."""
    script = _script("test_sync.py")
    results = {}
    for which in ("torch", "phalanx"):
        code, output = phalanx_run([JOBS / "accelerate_cases.py", "sync", which, script], env=CPU)
        results[which] = _cases(output)
        assert code == 0 and len(results[which]) == 15, f"{which}:\n{output}"
        assert set(results[which].values()) == {"passed"}, output
        assert min(_built(output, which)) > 0


def test_ddp_comm_hook_passes_with_phalanx_wherever_it_does_with_torch():
    """World size 2: each of test_ddp_comm_hook.py's cases with torch's class, then with phalanx's. torch's class
    refuses the BF16 hooks on the CPU (it wants CUDA and NCCL); phalanx's averages them over Gloo. Every case
    that passes with torch's class passes with phalanx's, and so does the whole script, unmodified."""
    script = _script("test_ddp_comm_hook.py")
    cases = {}
    for which in ("torch", "phalanx"):
        _, output = phalanx_run([JOBS / "accelerate_cases.py", "comm_hooks", which, script], env=CPU)
        cases[which] = _cases(output)
        assert len(cases[which]) == 10 and min(_built(output, which)) > 0, output
    torch_passed = {label for label, verdict in cases["torch"].items() if verdict == "passed"}
    assert {label for label in cases["torch"] if label not in torch_passed} == {
        label for label in cases["torch"] if "bf16" in label}, cases["torch"]
    assert all(BF16_REFUSED in cases["torch"][label] for label in cases["torch"] if "bf16" in label)
    assert set(cases["phalanx"].values()) == {"passed"}, cases["phalanx"]

    code, output = _run_script("phalanx", script, "--cpu-drops-device-ids")
    assert code == 0, f"test_ddp_comm_hook.py with phalanx's DDP class exited with {code}:\n{output}"
    assert output.count("Test DDP comm hook:") == 2 * 10, output
