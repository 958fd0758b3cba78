"""`phalanx run`'s command line: the flags (torchrun's spellings, dashed and underscored), their checks taken
together, and the defaults an srun step gives (one task per node).

A bad flag is a ValueError that names the flag, the value seen and the value expected; `run()` turns it into
argparse's usage error (exit code 2) before anything starts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ...diagnose.watch import DEFAULT_STALL_TIMEOUT, ON_STALL, stall_timeout
from ...errors import explain
from ...world.generation import MEMBERSHIP_MARGIN, MEMBERSHIP_TIMEOUT_ENV, membership_timeout
from ...world.group import usable_cores
from ...world.meeting.membership import LAST_CALL_SECONDS
from ...world.meeting.slurm import launcher_nodes
from ...world.meeting.store import LOOPBACK
from ...world.stop import STOP_EXIT_CODE
from ..stop import DEFAULT_GRACE_PERIOD

DEFAULT_MULTI_NODE_PORT = 29500
MAX_AUTO_CPU_WORKERS = 8
START_METHODS = ("forkserver", "spawn")  # how the workers start: forked from the launcher (forkserver/), or fresh


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx run", allow_abbrev=False,
        description="Run a training script on every device of this node (and of other nodes), "
                    "restarting the group when a worker fails.",
        epilog="examples:\n  phalanx run --nproc-per-node 2 train.py --epochs 3\n"
               "  phalanx run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -m mypkg.train\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1", metavar="N|auto",
        help="workers on this node; auto = one per GPU, else one per CPU core (at most 8). Default 1")
    add("--nnodes", default=None, metavar="N|MIN:MAX",
        help="number of nodes, or an elastic range MIN:MAX (nodes may leave and join; the same command on each, "
             "no --node-rank). Default 1, or the srun step's node count")
    add("--node-rank", "--node_rank", dest="node_rank", type=int, default=None, metavar="R",
        help="this node's index in 0..nnodes-1 (fixed --nnodes only). Default 0, or SLURM_NODEID under srun")
    add("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="A",
        help=f"address of node 0, reachable from every node (required for several nodes). Default {LOOPBACK}, "
             f"or the srun step's first node")
    add("--master-port", "--master_port", dest="master_port", type=int, default=None, metavar="P",
        help=f"port of the rendezvous store on node 0. Default: a free port (one node), "
             f"{DEFAULT_MULTI_NODE_PORT} (several nodes), one per SLURM_JOB_ID under srun")
    add("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0, metavar="K",
        help="restart the whole worker group up to K times when a worker fails (a node lost or joining under "
             "--nnodes MIN:MAX is not a failure). Default 0")
    add("--min-world-size", "--min_world_size", dest="min_world_size", type=int, default=None, metavar="N",
        help="live recovery: a worker killed by a signal (SIGKILL, the OOM killer) or a node lost is not a failure "
             "while at least N ranks are left; the others keep their processes and go on from the step in flight "
             "(a global-batch loop, docs/launching.md). 0: off. Default: MIN x --nproc-per-node under --nnodes "
             "MIN:MAX, else off (a lost worker fails the group)")
    add("--log-dir", "--log_dir", dest="log_dir", default=None, metavar="D",
        help="also keep each worker's stdout/stderr/error.json under D/<run>/attempt_<n>/<local rank>/")
    add("--monitor-interval", "--monitor_interval", dest="monitor_interval", type=float, default=0.1, metavar="S",
        help="seconds between checks of the workers' health. Default 0.1")
    add("--rdzv-timeout", "--rdzv_timeout", dest="rdzv_timeout", type=float, default=600.0, metavar="S",
        help="seconds the nodes wait for each other before giving up. Default 600")
    add("--rdzv-last-call", "--rdzv_last_call", dest="rdzv_last_call", type=float, default=LAST_CALL_SECONDS,
        metavar="S", help=f"--nnodes MIN:MAX: once MIN nodes are in, the first round waits S seconds more for "
                          f"others (none once MAX are in); later nodes join the run in progress. "
                          f"Default {LAST_CALL_SECONDS:g}")
    add("--stall-timeout", "--stall_timeout", dest="stall_timeout", default=None, metavar="S",
        help=f"report a hang when no rank made progress for S seconds (which rank is stuck, where, in which "
             f"collective); 0 = off. Default: $PHALANX_STALL_TIMEOUT, else {DEFAULT_STALL_TIMEOUT:g} (with live "
             f"recovery, above the survivors' agreement: {MEMBERSHIP_TIMEOUT_ENV} + {MEMBERSHIP_MARGIN:g})")
    add("--on-stall", "--on_stall", dest="on_stall", choices=ON_STALL, default=None,
        help="after a stall report: restart the group (under --max-restarts, else stop), stop it, or wait "
             "(keep it alive for a debugger). Default: $PHALANX_ON_STALL, else restart")
    add("--straggler-every", "--straggler_every", dest="straggler_every", type=int, default=None, metavar="N",
        help="every N steps, name a rank that arrives consistently late at the gradient exchanges; 0 = off. "
             "Default: $PHALANX_STRAGGLER_EVERY, else 100")
    add("--grace-period", "--grace_period", dest="grace_period", type=float, default=DEFAULT_GRACE_PERIOD,
        metavar="S", help=f"on SIGTERM, SIGINT or SIGUSR1, wait up to S seconds for the workers to save at an agreed "
                          f"step and exit {STOP_EXIT_CODE}, then kill them. Default {DEFAULT_GRACE_PERIOD:g}")
    add("--start-method", "--start_method", dest="start_method", choices=START_METHODS, default="forkserver",
        help="forkserver: fork each worker from a process that imported torch once, so a start or restart costs "
             "milliseconds, not seconds of CPU per worker; spawn: a fresh interpreter per worker. "
             "Default forkserver")
    add("-m", "--module", action="store_true",
        help="the target is a module to run as `python -m`, not a script path")
    add("target", metavar="script.py | module", help="the training script (or module with -m)")
    add("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def parse_nnodes(text: str) -> tuple[int, int]:
    """'2' -> (2, 2); '1:4' -> (1, 4)."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high:
        raise ValueError(explain("--nnodes is not a node count or range", seen=repr(text),
                                 expected="N >= 1, or MIN:MAX with 1 <= MIN <= MAX"))
    return low, high


def resolve_nproc(text: str) -> int:
    """'auto' -> the GPU count, else the CPU core count capped at 8; 'N' -> N >= 1."""
    if text == "auto":
        if torch.cuda.is_available():
            return torch.cuda.device_count()
        return max(1, min(usable_cores(), MAX_AUTO_CPU_WORKERS))
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(explain("--nproc-per-node is not a worker count", seen=repr(text),
                                 expected="an integer >= 1 or 'auto'"))
    return value


def check_args(args: argparse.Namespace) -> tuple[int, int, int]:
    """Validate the flags together (the unset ones filled from SLURM under srun: `args.from_slurm` says so);
    return (nproc, min_nodes, max_nodes)."""
    args.from_slurm = _slurm_defaults(args)
    if not args.module and not os.path.isfile(args.target):
        raise ValueError(explain("the training script does not exist", seen=repr(args.target),
                                 expected=f"a file (relative to {os.getcwd()})",
                                 fix="Check the path, or pass -m to run a module."))
    nproc = resolve_nproc(args.nproc_per_node)
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    if max_nodes > 1 and not args.master_addr:
        raise ValueError(explain("--master-addr is required for a multi-node run", seen=f"--nnodes {args.nnodes}",
                                 expected="the address of node 0, reachable from every node"))
    if min_nodes == max_nodes and not 0 <= args.node_rank < max_nodes:
        raise ValueError(explain("--node-rank is out of range", seen=args.node_rank,
                                 expected=f"0..{max_nodes - 1} for --nnodes {args.nnodes}"))
    if args.max_restarts < 0:
        raise ValueError(explain("--max-restarts is negative", seen=args.max_restarts, expected=">= 0"))
    if args.min_world_size is not None and not 0 <= args.min_world_size <= nproc * max_nodes:
        raise ValueError(explain("--min-world-size is outside the world", seen=args.min_world_size,
                                 expected=f"1..{nproc * max_nodes} (--nproc-per-node x nodes), or 0 for off",
                                 fix="Give the fewest ranks the run may go on with."))
    args.min_world_size_given = args.min_world_size is not None
    if args.min_world_size is None and min_nodes < max_nodes:
        args.min_world_size = min_nodes * nproc  # the range already allows the run to go on smaller: live
    if args.min_world_size == 0:
        args.min_world_size = None
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        raise ValueError(explain("--master-port is out of range", seen=args.master_port, expected="0..65535"))
    given = args.stall_timeout is not None or bool(os.environ.get("PHALANX_STALL_TIMEOUT"))
    args.stall_timeout = stall_timeout(args.stall_timeout)
    if args.min_world_size:  # timeouts nest (world/generation.py): the stall watch outlasts the survivors' agreement
        above = membership_timeout() + MEMBERSHIP_MARGIN
        if not given:
            args.stall_timeout = max(args.stall_timeout, above)
        elif 0 < args.stall_timeout < above:
            _say(f"warning: --stall-timeout {args.stall_timeout:g} s is not above the survivors' agreement after a "
                 f"loss ({membership_timeout():g} s, {MEMBERSHIP_TIMEOUT_ENV}) + {MEMBERSHIP_MARGIN:g} s: a stall "
                 f"could end a regroup that would have gone on; {above:g} s or more keeps them apart.")
    args.on_stall = args.on_stall or os.environ.get("PHALANX_ON_STALL", "restart")
    if args.on_stall not in ON_STALL:
        raise ValueError(explain("PHALANX_ON_STALL is not a stall action", seen=repr(args.on_stall),
                                 expected=" or ".join(ON_STALL)))
    if args.straggler_every is None:
        args.straggler_every = int(os.environ.get("PHALANX_STRAGGLER_EVERY", "100"))
    if args.straggler_every < 0:
        raise ValueError(explain("--straggler-every is negative", seen=args.straggler_every, expected=">= 0"))
    if args.grace_period < 0:
        raise ValueError(explain("--grace-period is negative", seen=args.grace_period, expected="seconds >= 0"))
    if args.rdzv_last_call <= 0:  # torch's rendezvous refuses 0 too
        raise ValueError(explain("--rdzv-last-call must be positive", seen=args.rdzv_last_call,
                                 expected="seconds > 0, e.g. 2"))
    if args.monitor_interval <= 0:
        raise ValueError(explain("--monitor-interval must be positive", seen=args.monitor_interval,
                                 expected="seconds > 0, e.g. 0.1"))
    return nproc, min_nodes, max_nodes


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


def _slurm_defaults(args) -> str | None:
    """Under srun (one task per node), fill --nnodes, --node-rank, --master-addr and --master-port from the
    step where they were not given; the sentence that says so. Outside an srun step: 1 node, node rank 0."""
    nodes = launcher_nodes(os.environ) if args.nnodes is None or args.node_rank is None else None
    if nodes is None or (args.nnodes is None and nodes.nnodes == 1):
        args.nnodes = args.nnodes or "1"
        args.node_rank = args.node_rank or 0
        return None
    args.nnodes = args.nnodes or str(nodes.nnodes)
    args.node_rank = nodes.node_rank if args.node_rank is None else args.node_rank
    if args.master_addr is None:
        args.master_addr = nodes.master_addr
        args.master_port = nodes.master_port if args.master_port is None else args.master_port
    return f"from SLURM: {nodes.describe()}"

