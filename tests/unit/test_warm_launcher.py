"""What the warm launcher decides before it forks (`phalanx warm`, phalanx/warm.py): which commands run fresh.

The forking itself, signals and exit statuses are tests/e2e/test_warm_launcher.py's."""

import os

from phalanx import warm as warm_launcher
from phalanx.launch.warm_start import _REEXECUTED, context


def test_a_process_has_the_context_of_itself_and_a_difference_is_named():
    own = context()
    assert warm_launcher._difference(own, context()) is None
    assert {"python", "phalanx", "user", "limits", "umask", "net namespace", "mnt namespace"} <= set(own)
    moved = {**own, "net namespace": own["net namespace"] + 1}  # `ip netns exec`
    assert warm_launcher._difference(moved, own) == "its net namespace differs from the server's"
    assert warm_launcher._difference(moved, own, ["net"]) is None  # a server that enters it (root's)
    assert warm_launcher._to_enter(moved, own) == (["net"] if os.geteuid() == 0 else [])
    code = "code (Python, phalanx, torch files)"
    elsewhere = {**own, code: [[0, 1]] + own[code][1:]}  # another Python in another mount namespace
    assert warm_launcher._difference(elsewhere, own, ["mnt"]) == f"its {code} differs from the server's"
    other_pid = {**own, "pid namespace": own["pid namespace"] + 1}  # not entered: fresh
    assert warm_launcher._to_enter(other_pid, own) == []
    slurm = {**own, "cgroup": "0::/slurm/job_7\n"}
    assert warm_launcher._difference(slurm, own) == "its cgroup differs from the server's"


def test_only_the_variables_read_while_torch_is_imported_make_a_command_run_fresh():
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "HOME": "/root"}
    per_run = {**server, "RANK": "0", "PHALANX_STOP_INTERVAL": "0", "MASTER_PORT": "1234", "PYTHONUNBUFFERED": "1",
               "PWD": "/tmp", "SHLVL": "2", "TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "",
               "SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "ACCELERATE_USE_CPU": "1"}
    assert warm_launcher._import_time_difference(per_run, server) is None
    threads = warm_launcher._import_time_difference({**server, "OMP_NUM_THREADS": "2"}, server)
    assert threads == "its environment differs from the server's in OMP_NUM_THREADS (read while torch is imported)"
    many = {**server, **{f"VAR{i}": "x" for i in range(7)}}
    assert "VAR0, VAR1, VAR2, VAR3, VAR4 and 2 more" in warm_launcher._import_time_difference(many, server)


def test_the_environment_a_fresh_command_would_have_after_preloading_its_allocator(monkeypatch):
    import phalanx.allocator

    monkeypatch.setattr(phalanx.allocator, "preloadable", lambda path: True)  # (it starts a process to see)
    plain = {"PATH": os.environ.get("PATH", "/bin"), "PHALANX_ALLOCATOR": "system"}
    assert warm_launcher._as_fresh(plain) == plain  # opted out: no preload, no second start
    again = {**plain, "PHALANX_ALLOCATOR": "mimalloc", _REEXECUTED: "1", "LD_PRELOAD": "/x/libmimalloc.so"}
    assert warm_launcher._as_fresh(again) == again  # started again already: as it is
    shipped = {"PATH": plain["PATH"], "PHALANX_ALLOCATOR": "mimalloc"}
    preload = phalanx.allocator.worker_preload(shipped)
    fresh = warm_launcher._as_fresh(shipped)
    assert fresh == ({**shipped, "LD_PRELOAD": preload, _REEXECUTED: "1"} if preload else shipped)
