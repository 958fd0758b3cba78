"""What `phalanx run` reads from SLURM when `srun` starts it once per node: the node count, this node's
rank, the master (the step's first node) and a port derived from the job id, so that

    srun phalanx run --nproc-per-node auto train.py

needs no flags and no `bash -c` quoting. Pure functions of an environment mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import WorldConfigError, explain
from ..discovery import job_port, parse_nodelist, parse_tasks_per_node


@dataclass(frozen=True)
class SlurmNodes:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str

    def describe(self) -> str:
        return (f"node {self.node_rank} of {self.nnodes}, master {self.master_addr}:{self.master_port} "
                f"(from SLURM job {self.job_id}'s step: SLURM_NODEID, SLURM_STEP_NUM_NODES, SLURM_STEP_NODELIST)")


def launcher_nodes(env: Mapping[str, str]) -> SlurmNodes | None:
    """The nodes of the srun step this launcher runs in; None outside an srun step.

    Raises WorldConfigError when the step runs more than one task on a node: each task would be a
    launcher of its own, for the same node.
    """
    needed = ("SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_NODEID")
    if not all(env.get(name) for name in needed):
        return None  # the batch script itself, salloc's shell, or no SLURM at all
    try:
        nnodes, node_rank = int(env["SLURM_STEP_NUM_NODES"]), int(env["SLURM_NODEID"])
    except ValueError:
        raise WorldConfigError(explain(
            "SLURM_STEP_NUM_NODES or SLURM_NODEID is not an integer",
            seen=f"{env['SLURM_STEP_NUM_NODES']!r}, {env['SLURM_NODEID']!r}", expected="integers",
            fix="Run `phalanx run` under srun, or pass --nnodes and --node-rank.")) from None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "1")
    if any(count != 1 for count in parse_tasks_per_node(per_node)):
        raise WorldConfigError(explain(
            "srun started several `phalanx run` on one node", rank=None,
            seen=f"SLURM_STEP_TASKS_PER_NODE={per_node}", expected="1 task per node (a launcher per node)",
            fix="Give the step one task per node (`#SBATCH --ntasks-per-node=1`, or `srun --ntasks-per-node=1`): "
                "`phalanx run --nproc-per-node N` starts the node's workers. Or pass --nnodes and --node-rank."))
    return SlurmNodes(nnodes, node_rank, parse_nodelist(env["SLURM_STEP_NODELIST"])[0], job_port(env),
                      env.get("SLURM_JOB_ID", "?"))
