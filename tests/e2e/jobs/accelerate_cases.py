"""Cases of Accelerate's test scripts called one by one: `accelerate_cases.py comm_hooks|sync torch|phalanx SCRIPT`.

Loads the script unmodified (not as `__main__`) and calls its test functions case by case, with the DDP
class given (with_ddp_class.py), printing `case NAME: passed` or `case NAME: failed: ERROR` for each, so
a case one class refuses does not hide the others. Exits 1 when a case failed.

comm_hooks: test_ddp_comm_hook.py's `test_ddp_comm_hook` for each case its main() runs (device_ids
            dropped for CPU modules: the script passes device_ids=[local rank], refused on CPU).
sync:       test_sync.py's gradient-accumulation cases that its main() runs only on GPUs
            (`test_gradient_accumulation`, `test_gradient_accumulation_with_opt_and_scheduler`).
"""

import itertools
import runpy
import sys

from accelerate import DDPCommunicationHookType as Hook

from tests.e2e.jobs.with_ddp_class import close_world, install, say

COMM_HOOK_CASES = [  # test_ddp_comm_hook.py's main(), accelerate 1.15
    (Hook.NO, Hook.NO, {}), (Hook.FP16, Hook.NO, {}), (Hook.BF16, Hook.NO, {}), (Hook.POWER_SGD, Hook.NO, {}),
    (Hook.POWER_SGD, Hook.FP16, {}), (Hook.POWER_SGD, Hook.BF16, {}),
    (Hook.POWER_SGD, Hook.NO, {"matrix_approximation_rank": 2}), (Hook.BATCHED_POWER_SGD, Hook.NO, {}),
    (Hook.BATCHED_POWER_SGD, Hook.FP16, {}), (Hook.BATCHED_POWER_SGD, Hook.BF16, {}),
]


def comm_hook_cases(script: dict):
    for hook, wrapper, state in COMM_HOOK_CASES:
        yield f"{hook.value}/{wrapper.value}/{state}", lambda h=hook, w=wrapper, s=state: (
            script["test_ddp_comm_hook"](h, w, s))


def sync_cases(script: dict):
    for flags in itertools.product([True, False], repeat=3):  # split_batches, dispatch_batches, sync_each_batch
        yield f"accumulation/{flags}", lambda f=flags: script["test_gradient_accumulation"](*f)
        if any(flags):  # main() leaves out all False here
            yield f"with_opt_and_scheduler/{flags}", lambda f=flags: (
                script["test_gradient_accumulation_with_opt_and_scheduler"](*f))


if __name__ == "__main__":
    kind, which, path = sys.argv[1:]
    install(which, drop_device_ids=kind == "comm_hooks")
    script = runpy.run_path(path, run_name="accelerate_script")
    failed = 0
    for label, call in {"comm_hooks": comm_hook_cases, "sync": sync_cases}[kind](script):
        try:
            call()
            say(f"case {label}: passed")
        except Exception as error:  # every case reports; the run fails at the end
            failed += 1
            first, *rest = str(error).splitlines() or [""]
            say(f"case {label}: failed: {type(error).__name__}: {first}")
            # The rest (Accelerate's messages hold both models' gradients): whether a failure is a roundoff
            # next to zero or a step not averaged at all. One case failed once in a full run, never alone.
            say("\n".join(f"    {line}" for line in rest[:40]))
    close_world()
    sys.exit(1 if failed else 0)
