"""`phalanx.spawn`: the mp.spawn style (multi-process: world size 2, Gloo on CPU)."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import RankFailedError
from tests.conftest import ROOT, checkout_on_pythonpath

ENV = {"PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _sum_of_ranks(rank, offset):
    if rank == 0:
        time.sleep(1.0)  # rank 1 finishes first: the order of results must not follow finishing order
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank + offset, int(total.item())


def _rank_1_raises(rank):
    if rank == 1:
        raise KeyError(f"missing key seen by rank {rank}")
    dist.barrier()  # rank 0 waits for a peer that is gone: spawn must stop it


def test_results_come_back_in_rank_order():
    """World size 2 (phalanx.spawn)."""
    assert phalanx.spawn(_sum_of_ranks, 2, args=(10,), env=ENV, timeout=120) == [(10, 1), (11, 1)]


def test_child_exception_reaches_the_parent_with_its_traceback():
    """World size 2 (phalanx.spawn): rank 1 raises. Forked from the server: the error's way back is the same
    whichever way the ranks started (the test above starts them fresh), and a fresh start costs ~7 s of CPU."""
    with pytest.raises(RankFailedError) as error:
        phalanx.spawn(_rank_1_raises, 2, env=ENV, timeout=120, start_method="forkserver")
    assert error.value.rank == 1
    assert "_rank_1_raises" in error.value.traceback_text
    assert "KeyError: 'missing key seen by rank 1'" in error.value.traceback_text
    assert "missing key seen by rank 1" in str(error.value)


def _what_the_rank_sees(rank):
    import sys

    return (os.environ.get("PHALANX_TEST_SET"), os.environ.get("PHALANX_TEST_UNSET"), os.environ.get("LD_PRELOAD"),
            torch.get_num_threads(), os.getppid(), "torch" in sys.modules)


@pytest.mark.smoke
def test_forked_ranks_get_the_callers_environment_at_the_call(monkeypatch):
    """World size 2 (spawn(start_method="forkserver")), twice: what the caller set or removed between the calls is
    what the ranks see, although the fork server started with the first call's environment."""
    monkeypatch.setenv("PHALANX_TEST_UNSET", "before")
    first = phalanx.spawn(_what_the_rank_sees, 2, env=ENV, timeout=120, start_method="forkserver")
    monkeypatch.delenv("PHALANX_TEST_UNSET")
    monkeypatch.setenv("PHALANX_TEST_SET", "after")
    second = phalanx.spawn(_what_the_rank_sees, 2, env=ENV, timeout=120, start_method="forkserver")
    assert [seen[:2] for seen in first] == [(None, "before")] * 2
    assert [seen[:2] for seen in second] == [("after", None)] * 2
    assert all(seen[3] == 1 for seen in first + second)  # OMP_NUM_THREADS=1 applied after the fork
    parents = {seen[4] for seen in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # forked by one server, not by this process


def test_a_rank_that_needs_another_allocator_than_the_fork_servers_runs_on_it(monkeypatch):
    """World size 1 (spawn(start_method="forkserver")) with PHALANX_ALLOCATOR=system, after a call that may have
    started the server with tcmalloc: the rank runs on the system's malloc all the same."""
    phalanx.spawn(_what_the_rank_sees, 1, env=ENV, timeout=120, start_method="forkserver")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    [seen] = phalanx.spawn(_what_the_rank_sees, 1, env={**ENV, "PHALANX_ALLOCATOR": "system"}, timeout=120,
                           start_method="forkserver")
    assert seen[2] is None, seen


def test_an_unknown_start_method_is_a_typed_error():
    """World size 2 asked for, none started."""
    with pytest.raises(ValueError, match="start_method='fork'"):
        phalanx.spawn(_sum_of_ranks, 2, args=(0,), start_method="fork")


def test_import_phalanx_leaves_dtensor_and_fsdp2_unimported():
    """No world: one `python -c "import phalanx"` (DTensor and FSDP2 cost ~1 s of CPU in every worker that imports
    phalanx; sharding/dtensor.py)."""
    code = ("import sys, phalanx, phalanx.engine, phalanx.checkpoint, phalanx.sharding.full_state; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.tensor', "
            "'torch.distributed.fsdp'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": checkout_on_pythonpath()})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def _prints(rank):
    print(f"rank {rank} says hello", flush=True)
    print(f"rank {rank} warns", file=sys.stderr, flush=True)


def test_forked_ranks_print_to_the_callers_streams_as_they_are_at_the_call(capfd):
    """World size 2 (spawn(start_method="forkserver")), after a first call that started the server under another
    test's capture: what the ranks print reaches this test's stdout and stderr."""
    phalanx.spawn(_prints, 2, env=ENV, timeout=120, start_method="forkserver")
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, (out, err)
    assert "rank 1 warns" in err, (out, err)


def test_import_phalanx_loads_no_torch_until_a_name_needs_it():
    """No world: `import phalanx` alone loads no torch (the `phalanx` command relies on it: launch/warm_start.py);
    every public name, every subpackage as an attribute and `phalanx.metrics` still resolve."""
    code = ("import sys, phalanx; before = 'torch' in sys.modules; "
            "names = [getattr(phalanx, n) for n in phalanx.__all__]; "
            "import phalanx.metrics, phalanx.data.metrics; "
            "print(before, 'torch' in sys.modules, len(names) == len(phalanx.__all__), "
            "phalanx.metrics is phalanx.data.metrics, callable(phalanx.checkpoint.unwrap), "
            "phalanx.world.init is phalanx.init)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": checkout_on_pythonpath()})
    assert done.returncode == 0 and done.stdout.split() == ["False", "True", "True", "True", "True", "True"], \
        done.stdout + done.stderr


FORKING_COMMAND = """
import os, torch, torch.distributed as dist, phalanx
from phalanx.launch import spawn, warm_start

def rank_sees(rank):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return os.getppid(), int(total.item()), os.environ.get("PHALANX_TEST_CALLER")

if __name__ == "__main__":
    plain = spawn._a_warm_command_that_can_fork("")
    warm_start.forked_command = os.getpid()  # as phalanx/warm.py marks a command it forked
    os.environ["PHALANX_TEST_CALLER"] = "set before the call"
    env = {"PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    seen = phalanx.spawn(rank_sees, 2, env=env, timeout=120, start_method="forkserver")
    print(plain, [ppid == os.getpid() for ppid, _, _ in seen], [total for _, total, _ in seen], seen[0][2])
"""


def test_a_command_a_warm_launcher_forked_forks_its_ranks_itself(tmp_path):
    """World size 2 (spawn(start_method="forkserver")) in a command forked by a warm launcher (phalanx/warm.py, which
    has imported torch already): the ranks are forks of the command itself, no fork server imports torch again,
    and they meet, all-reduce and see the caller's environment at the call. A plain process would start the
    server (the tests above). On glibc's malloc (PHALANX_ALLOCATOR=system): the command's allocator is the ranks'."""
    script = tmp_path / "command.py"
    script.write_text(FORKING_COMMAND)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": checkout_on_pythonpath(), "PHALANX_ALLOCATOR": "system"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "False [True, True] [3, 3] set before the call", done.stdout + done.stderr


def test_a_fork_server_started_by_other_code_is_used_only_with_the_ranks_allocator(monkeypatch):
    """Other code of the process started multiprocessing's fork server first (torch's test suites do), with an
    LD_PRELOAD of its own: ranks that need another allocator are spawned, not forked from it (seen in CI: a rank that
    was to run on mimalloc ran on glibc's malloc after torch's suite had started the server in the same process)."""
    from multiprocessing import forkserver

    from phalanx.launch import spawn as spawn_module

    monkeypatch.setattr(spawn_module, "_server_preload_env", [])
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", os.getpid())  # a server: this process's environ
    at_start = spawn_module._running_server()  # its LD_PRELOAD, read from /proc/<pid>/environ ("" when unset)
    other = f"{at_start}:/elsewhere/libother.so" if at_start else "/elsewhere/libother.so"
    monkeypatch.setenv("LD_PRELOAD", other)
    assert spawn_module._context("forkserver", other).get_start_method() == "spawn"
    monkeypatch.setenv("LD_PRELOAD", at_start) if at_start else monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert spawn_module._context("forkserver", at_start).get_start_method() == "forkserver"


def test_once_the_other_codes_fork_server_stopped_the_ranks_fork_from_ours(monkeypatch):
    """The server other code started, with another allocator, is stopped (torch's suites stop theirs): the next
    call starts phalanx's own and forks from it, rather than spawning every rank from then on (seen in the suite:
    after tests/e2e/test_torch_ddp_suite.py, a pytest worker's later tests spawned every rank, ~6 s of CPU each)."""
    from multiprocessing import forkserver

    from phalanx.launch import spawn as spawn_module

    monkeypatch.setattr(spawn_module, "_server_preload_env", [("/elsewhere/libother.so", False)])
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", None)  # no server runs now
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert spawn_module._context("forkserver", "").get_start_method() == "forkserver"
    assert spawn_module._server_preload_env == [("", True)]


def test_our_fork_server_is_started_again_for_another_allocator_rather_than_spawning_every_rank(monkeypatch):
    """The server phalanx started with one LD_PRELOAD, then a call needs another: the server is stopped and started
    again with it (seen in CI: after tests/ranks/test_allocator.py, every later call of a pytest worker spawned its
    ranks, ~5x the CPU of each test)."""
    from phalanx.launch import spawn as spawn_module

    monkeypatch.setattr(spawn_module, "_server_preload_env", [("/elsewhere/libother.so", True)])
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert spawn_module._context("forkserver", "").get_start_method() == "forkserver"
    assert spawn_module._server_preload_env == [("", True)]
    assert phalanx.spawn(_sum_of_ranks, 2, args=(0,), start_method="forkserver", env=ENV) == [(0, 1), (1, 1)]
