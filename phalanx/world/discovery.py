"""Find out which world this process belongs to, from its environment alone.

Sources, in order: the variables `phalanx run` and `torchrun` set (RANK, WORLD_SIZE, ...), SLURM's
`srun` (SLURM_PROCID, ..., inside a step: SLURM_STEP_ID), else a single process. Pure functions of a
mapping, so every case is testable on a synthetic environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import WorldConfigError, explain


@dataclass(frozen=True)
class WorldSpec:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str  # "launcher" (phalanx run / torchrun / manual), "slurm" or "single"
    agent_store: bool = False  # the launcher's agent already hosts the rendezvous store


def discover(environ: Mapping[str, str] | None = None) -> WorldSpec:
    """Read the world from `environ` (default: os.environ); raise WorldConfigError when it is wrong."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_launcher(env)
    # Only inside an srun step: the batch script itself has SLURM_PROCID=0 and SLURM_NTASKS of the whole
    # job too, and a `python train.py` there is one process, not rank 0 of a world that never comes.
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env) \
            and "SLURM_STEP_ID" in env and env.get("PHALANX_IGNORE_SLURM", "0") != "1":
        return _from_slurm(env)
    return WorldSpec(0, 1, 0, 1, None, None, "single")


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is not None:
            return default
        raise WorldConfigError(explain(
            f"environment variable {name} is missing", seen="nothing", expected="an integer",
            fix=f"Set {name}, or start the script with `phalanx run` which sets it."))
    try:
        value = int(raw.strip())
    except ValueError:
        raise WorldConfigError(explain(
            f"environment variable {name} is not an integer", seen=repr(raw),
            expected=f"an integer >= {minimum}",
            fix=f"Fix {name} in the environment that starts this process.")) from None
    if value < minimum:
        raise WorldConfigError(explain(
            f"environment variable {name} is out of range", seen=value, expected=f"an integer >= {minimum}",
            fix=f"Fix {name} in the environment that starts this process."))
    return value


def _check_below(name: str, value: int, bound_name: str, bound: int) -> None:
    if value >= bound:
        raise WorldConfigError(explain(
            f"{name} must be smaller than {bound_name}", seen=f"{name}={value}, {bound_name}={bound}",
            expected=f"0 <= {name} < {bound}",
            fix=f"Give each process a distinct {name} in 0..{bound - 1}, or raise {bound_name}."))


def _master(env: Mapping[str, str], world_size: int, source: str, default_port: int | None = None):
    addr = env.get("MASTER_ADDR") or None
    if world_size == 1 and addr is None and "MASTER_PORT" not in env:
        return None, None
    if addr is None:
        raise WorldConfigError(explain(
            "MASTER_ADDR is missing", seen="nothing",
            expected=f"the address of rank 0's host ({source}, WORLD_SIZE={world_size})",
            fix="Set MASTER_ADDR and MASTER_PORT, or start the script with `phalanx run`."))
    if "MASTER_PORT" not in env and default_port is not None:
        return addr, default_port
    port = _int(env, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise WorldConfigError(explain("MASTER_PORT is out of range", seen=port, expected="1..65535",
                                       fix="Choose a free TCP port on rank 0's host."))
    return addr, port


def _from_launcher(env: Mapping[str, str]) -> WorldSpec:
    if "WORLD_SIZE" not in env:
        raise WorldConfigError(explain("RANK is set but WORLD_SIZE is not", seen=f"RANK={env['RANK']!r}",
                                       expected="both RANK and WORLD_SIZE",
                                       fix="Set WORLD_SIZE to the number of processes."))
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", default=0 if world_size == 1 else None)
    _check_below("RANK", rank, "WORLD_SIZE", world_size)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", minimum=1, default=world_size)
    local_rank = _int(env, "LOCAL_RANK", default=rank % local_world_size)
    _check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    addr, port = _master(env, world_size, "launcher")
    return WorldSpec(rank, world_size, local_rank, local_world_size, addr, port, "launcher",
                     agent_store=(env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                                  or env.get("PHALANX_STORE_HOSTED") == "1"))


def _from_slurm(env: Mapping[str, str]) -> WorldSpec:
    ntasks_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = _int(env, ntasks_name, minimum=1)
    rank = _int(env, "SLURM_PROCID")
    _check_below("SLURM_PROCID", rank, ntasks_name, world_size)
    local_rank = _int(env, "SLURM_LOCALID", default=0)
    local_world_size = _slurm_tasks_on_this_node(env, world_size)
    _check_below("SLURM_LOCALID", local_rank, "tasks on this node", local_world_size)
    if "MASTER_ADDR" not in env and world_size > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise WorldConfigError(explain(
                "SLURM_JOB_NODELIST is missing", seen="nothing", expected="the job's node list",
                fix="Run under `srun`, or set MASTER_ADDR to the first node of the job."))
        env = {**env, "MASTER_ADDR": parse_nodelist(nodelist)[0]}
    addr, port = _master(env, world_size, "slurm", default_port=job_port(env))
    return WorldSpec(rank, world_size, local_rank, local_world_size, addr, port, "slurm")


def job_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of SLURM job SLURM_JOB_ID (29500 outside a job), the same on every node: two
    jobs sharing a node differ (ports 15000..34999)."""
    job_id = env.get("SLURM_JOB_ID", "")
    return 15000 + int(job_id) % 20000 if job_id.isdigit() else 29500


def _slurm_tasks_on_this_node(env: Mapping[str, str], world_size: int) -> int:
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts = parse_tasks_per_node(spec)
        node = _int(env, "SLURM_NODEID", default=0)
        if node < len(counts):
            return counts[node]
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    return world_size


def parse_tasks_per_node(spec: str) -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1] (SLURM's compressed tasks-per-node format)."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not match:
            raise WorldConfigError(explain("cannot parse SLURM tasks per node", seen=repr(spec),
                                           expected="a list like '2(x3),1'"))
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise WorldConfigError(explain("unbalanced brackets in SLURM node list", seen=repr(text),
                                       expected="a list like 'gpu[001-004,010],cpu7'"))
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_range(part: str, nodelist: str) -> list[str]:
    if "-" not in part:
        return [part]
    low, high = part.split("-", 1)
    if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
        raise WorldConfigError(explain("bad range in SLURM node list", seen=repr(part),
                                       expected=f"'low-high' with low <= high in {nodelist!r}"))
    width = len(low)  # zero padding is kept: 001-004 -> 001, 002, ...
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list: 'gpu[001-002,010],cpu7' -> gpu001, gpu002, gpu010, cpu7."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
        if not match:
            hosts.append(item)
            continue
        prefix, inside, rest = match.groups()
        suffixes = parse_nodelist(rest) if rest else [""]
        for part in inside.split(","):
            for number in _expand_range(part.strip(), nodelist):
                hosts += [prefix + number + suffix for suffix in suffixes]
    if not hosts:
        raise WorldConfigError(explain("empty SLURM node list", seen=repr(nodelist), expected="at least one host"))
    return hosts
