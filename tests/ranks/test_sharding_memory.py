"""The reason shard="parameters" exists: a model whose replicated AdamW state does not fit a rank's memory
trains there.

World size 2 over Gloo, each rank in a memory cgroup of its own (cgroup v1, where the machine has
one; else the rank's anonymous resident memory, sampled in each step, is compared to the limit).
The model, 12 x Linear(1448, 1448), has 25.2M parameters: replicated fp32 AdamW state is 16 bytes
each, 384 MiB, over the 288 MiB limit on what a rank allocates once started. Built on the meta
device and sharded, it trains; the same model replicated (shard="none") under the same limit is
killed, which proves the limit bites. The ranks start as on a machine without the system's tcmalloc
(PHALANX_ALLOCATOR_SEARCH empty): with the allocator that comes with phalanx, the shipped mimalloc.
"""

import os
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import phalanx as px
from phalanx import allocator
from phalanx.errors import RankFailedError
from phalanx.testing import run_ranks

WIDTH, DEPTH = 1448, 12
PARAMS = DEPTH * (WIDTH * WIDTH + WIDTH)
LIMIT = 288 * 2**20
MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")
FRESH_MACHINE = {"PHALANX_ALLOCATOR_SEARCH": ""}  # hide the system's tcmalloc: what `make install` alone brings


def _cgroups_usable() -> bool:
    return os.geteuid() == 0 and (MEMORY_CGROUPS / "cgroup.procs").exists() and os.access(MEMORY_CGROUPS, os.W_OK)


@pytest.fixture
def cgroups():
    """One memory cgroup per rank, limited to LIMIT; removed afterwards (the ranks have ended by then)."""
    if not _cgroups_usable():
        yield None
        return
    made = []
    for rank in range(2):
        path = MEMORY_CGROUPS / f"phalanx-test-{uuid.uuid4().hex[:8]}-{rank}"
        path.mkdir()
        made.append(path)
        (path / "memory.limit_in_bytes").write_text(str(LIMIT))
    try:
        yield [str(p) for p in made]
    finally:
        for path in made:
            for pid in (path / "cgroup.procs").read_text().split():  # none, unless a rank outlived its test
                (MEMORY_CGROUPS / "cgroup.procs").write_text(pid)
            path.rmdir()


def _mlp():
    return torch.nn.Sequential(*[layer for _ in range(DEPTH) for layer in (torch.nn.Linear(WIDTH, WIDTH),
                                                                          torch.nn.ReLU())])


def _anonymous_bytes() -> int:
    """Resident memory the process allocated (not the library code it maps, which RSS counts too)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _train_under_limit(rank, world, shard, groups):
    if groups:  # from here on, what this rank allocates is charged to its cgroup
        Path(groups[rank], "cgroup.procs").write_text(str(os.getpid()))
    start = _anonymous_bytes()
    peak = start
    torch.manual_seed(0)
    if shard == "parameters":
        with torch.device("meta"):
            net = _mlp()
    else:
        net = _mlp()
    model = px.DistributedDataParallel(net, shard=shard)
    opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, WIDTH, generator=generator)).pow(2).mean()
        peak = max(peak, _anonymous_bytes())
        loss.backward()
        peak = max(peak, _anonymous_bytes())
        opt.step()
        peak = max(peak, _anonymous_bytes())
    state = sum((v.to_local() if isinstance(v, DTensor) else v).numel() * 4 for entry in opt.state.values()
                for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    used = peak - start
    charged = int(Path(groups[rank], "memory.max_usage_in_bytes").read_text()) if groups else None
    return used, charged, state, allocator.current()


def test_a_model_whose_replicated_state_does_not_fit_trains_sharded(cgroups):
    """World size 2: 16 bytes/parameter would be 384 MiB; sharded, each rank stays under 288 MiB."""
    assert 16 * PARAMS > 1.3 * LIMIT
    shipped = allocator.shipped_mimalloc()
    for used, charged, state, have in run_ranks(_train_under_limit, 2, (2, "parameters", cgroups), timeout=240,
                                                env=FRESH_MACHINE):
        assert have == ("mimalloc" if shipped else "glibc"), have
        assert state == pytest.approx(8 * PARAMS / 2, rel=0.01)  # exp_avg + exp_avg_sq, this rank's half
        if charged is not None:  # what the cgroup counted at its highest (had it passed the limit: killed)
            assert charged <= LIMIT
        else:  # sampled after each forward, backward and step
            assert used < LIMIT, f"anonymous memory grew by {used / 2**20:.0f} MiB"


def test_the_limit_bites_the_same_model_replicated(cgroups):
    """World size 2: the control. Replicated, the model does not train under the limit (killed by the cgroup,
    or, without cgroups, its anonymous memory passes the limit)."""
    if cgroups is None:
        used, _, _, _ = run_ranks(_train_under_limit, 2, (2, "none", None), timeout=240, env=FRESH_MACHINE)[0]
        assert used > LIMIT
        return
    with pytest.raises(RankFailedError):
        run_ranks(_train_under_limit, 2, (2, "none", cgroups), timeout=240, env=FRESH_MACHINE)
    oom_kills = [int(line.split()[1]) for group in cgroups for line in Path(group, "memory.oom_control").read_text()
                 .splitlines() if line.startswith("oom_kill ")]
    assert sum(oom_kills) >= 1, oom_kills
