"""`phalanx run`: start one worker per device on this node, on torch's elastic agent.

torch.distributed.elastic does the work: rendezvous between nodes, one process per local rank,
monitoring, stopping the whole group when one worker fails, restarting it up to --max-restarts
times. phalanx adds what a user sees: a loopback-only store on a free port for single-node runs,
rank-prefixed output, the failing rank's own traceback printed last, no process left behind, a
stop request turned into one agreed checkpoint (stop.py), and a run summary (goodput.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from datetime import timedelta

import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig

from ..allocator import preload_for_workers
from ..diagnose import progress
from ..diagnose.watch import DEFAULT_STALL_TIMEOUT, ON_STALL, stall_timeout
from ..errors import PhalanxError, RunEndedError, explain
from ..world.generation import MEMBERSHIP_MARGIN, MEMBERSHIP_TIMEOUT_ENV, MIN_WORLD_ENV, membership_timeout
from ..world.group import usable_cores
from ..world.interface import set_for_world
from ..world.meeting.membership import ElasticRendezvous
from ..world.meeting.rendezvous import StaticRendezvous
from ..world.meeting.slurm import launcher_nodes
from ..world.meeting.store import LOOPBACK
from ..world.stop import STOP_EXIT_CODE
from . import live_status
from .agent import Agent
from .diagnosis import STALL_EXIT_CODE, RunDiagnosis
from .failures import describe_failure, failure_traceback, root_cause, sweep_process_groups
from .goodput import RunSummary
from .live_status import LiveStatus
from .regroup import KeptSurvivors, Regroup
from .stop import (
    DEFAULT_GRACE_PERIOD,
    GraceExpired,
    StoppedBeforeStart,
    StopRequest,
    interruptible,
    stop_lost,
    stop_report,
)
from .warm_start import START_METHODS, WORKER_ENTRY, WorkerServer

DEFAULT_MULTI_NODE_PORT = 29500
MAX_AUTO_CPU_WORKERS = 8


DEFAULT_UNDER_RANGE = " (the default under --nnodes MIN:MAX; --min-world-size 0: off)"


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


def _choose_interface(master_addr: str | None, several_nodes: bool) -> None:
    """Name Gloo's and NCCL's interface for the workers, unless the user did (world/interface.py)."""
    choice = set_for_world(master_addr, several_nodes)
    if choice is not None:
        _say(choice.sentence)


def _rendezvous_handler(args, config: LaunchConfig, node_rank: int):
    timeout = timedelta(seconds=args.rdzv_timeout)
    if config.min_nodes == config.max_nodes:
        addr = args.master_addr or LOOPBACK
        port = args.master_port if args.master_port is not None else (
            DEFAULT_MULTI_NODE_PORT if config.max_nodes > 1 else 0)
        return StaticRendezvous(addr, port, node_rank, config.max_nodes, config.run_id, timeout)
    # An elastic range: the node that owns the master address hosts the store; torch's dynamic rendezvous on it.
    port = args.master_port if args.master_port is not None else DEFAULT_MULTI_NODE_PORT
    return ElasticRendezvous(args.master_addr, port, config.run_id, config.min_nodes, config.max_nodes, timeout)


def _worker_command(args) -> tuple[str, tuple]:
    # -u: a worker's stdout goes to a log file that is tailed to the console; unbuffered, lines
    # appear as they are printed and nothing is lost when the worker is killed.
    target = ("-m", args.target) if args.module else (args.target,)
    return sys.executable, ("-u", WORKER_ENTRY, *target, *args.args)


def _quiet_torch_elastic() -> None:
    # torch's agent logs every step at WARNING (signals sent, exit codes); phalanx prints its own
    # summary. Each torch module sets its own logger's level, so each one is turned down.
    level = os.environ.get("PHALANX_ELASTIC_LOG_LEVEL", "CRITICAL")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(level)


def run(argv: list[str] | None = None, server: WorkerServer | None = None) -> int:
    """`phalanx run ...`: launch, wait, report; returns the process exit code. `server`: the workers' fork
    server, forked from this process by the `phalanx` command (cli.py); without it, one is started here."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        nproc, min_nodes, max_nodes = check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.from_slurm:
        _say(args.from_slurm)
    _choose_interface(args.master_addr, max_nodes > 1)
    own_log_dir = args.log_dir is None
    log_dir = tempfile.mkdtemp(prefix="phalanx-run-") if own_log_dir else args.log_dir
    config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc, run_id="phalanx",
        max_restarts=args.max_restarts, monitor_interval=args.monitor_interval,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template="[rank ${rank}] ")
    # Workers read the environment of this process: tell phalanx.init() that lines are already
    # prefixed with the rank. OMP_NUM_THREADS is deliberately left alone (init() shares the cores).
    os.environ["PHALANX_RANK_PREFIXED"] = "1"
    # SIGTERM, SIGINT and SIGUSR1 are this launcher's (stop.py): torch's handler would kill the workers.
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGHUP,SIGQUIT")
    # The workers' records of their collectives live here; this process watches them, not the workers.
    rings = tempfile.mkdtemp(prefix="phalanx-rings-")
    os.environ["PHALANX_RUN_DIR"] = rings
    os.environ["PHALANX_STALL_WATCHER"] = "launcher"
    if args.min_world_size is not None:  # the workers recover in-process (world/generation.py)
        os.environ[MIN_WORLD_ENV] = str(args.min_world_size)
        _say(f"live recovery: a rank lost (killed, or its host gone) costs the step in flight while at least "
             f"{args.min_world_size} ranks are left; a worker that raises fails the group as before"
             f"{'' if args.min_world_size_given else DEFAULT_UNDER_RANGE}.")
    preload_for_workers()  # the system's tcmalloc, else the shipped mimalloc: glibc fragments (phalanx/allocator/)
    diagnosis = RunDiagnosis(rings, args.stall_timeout, args.on_stall, args.log_dir, args.straggler_every)
    stop = StopRequest(args.grace_period, args.node_rank)
    summary = RunSummary(args.log_dir, writes_job_file=args.node_rank == 0)
    stop.install()  # from now on: during the rendezvous too
    live = LiveStatus() if live_status.wanted() else None
    if live is not None:
        live.install()
    if args.start_method == "spawn" and server is not None:
        server.close()
        server = None
    elif args.start_method == "forkserver" and server is None:
        # After the environment is set (LD_PRELOAD above): the workers it forks would otherwise start fresh.
        server = WorkerServer.spawn()
    agent = handler = None
    try:
        try:
            # In a thread: waiting for node 0's store is a C++ call that would hold a stop request back.
            handler = interruptible(lambda: _rendezvous_handler(args, config, args.node_rank))
            entrypoint, worker_args = _worker_command(args)
            spec = WorkerSpec(role="worker", local_world_size=nproc, entrypoint=entrypoint, args=worker_args,
                              rdzv_handler=handler, max_restarts=args.max_restarts,
                              monitor_interval=args.monitor_interval)
            elastic = isinstance(handler, ElasticRendezvous)
            survivors = (KeptSurvivors(args.min_world_size, summary.now.changes) if args.min_world_size is not None
                         else None)
            regroup = Regroup(handler, args.grace_period, summary.now.changes, survivors) if elastic else None
            agent = Agent(spec=spec, logs_specs=config.logs_specs, start_method="spawn",
                          log_line_prefix_template=config.log_line_prefix_template, diagnosis=diagnosis, stop=stop,
                          summary=summary, regroup=regroup, live=live, server=server, survivors=survivors)
            _quiet_torch_elastic()  # now that every torch module in use has made its logger
            result = agent.run()
            ended = _conclude(agent, result, diagnosis, stop, args.max_restarts)
        except RunEndedError as exc:  # a node that came to join a run which finished first: nothing left to do
            ran = summary.now.attempts
            if ran and agent is not None:
                agent.end_attempt("failed")
            ended = _Ended(1 if ran else 0, "failed" if ran else "finished", [str(exc)])
        except (PhalanxError, RendezvousError) as exc:
            if agent is not None:  # an elastic group that lost its store: the attempt ends here
                agent.end_attempt("failed")
            ended = _Ended(1, "failed", [f"{type(exc).__name__}: {exc}"])
        except SignalException as exc:
            ended = _stopped_by_signal(agent, exc, diagnosis, stop)
        if live is not None:
            live.uninstall()  # the summary and the verdict below are plain lines
        if summary.now.attempts:
            summary.writes_job_file = agent is not None and agent.get_worker_group().group_rank in (0, None)
            summary.finish(ended.outcome)
        ended.report()
        return ended.code
    finally:
        if live is not None:
            live.uninstall()
        if agent is not None:
            sweep_process_groups(agent.group_pids)
            agent.stop_log_tailers()
        if isinstance(handler, ElasticRendezvous) and not summary.now.attempts:
            handler.leave()  # stopped or failed while it waited: closing the rendezvous would end the others' run
        elif handler is not None:
            handler.shutdown()
        if server is not None:
            server.close()
        if own_log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
        shutil.rmtree(rings, ignore_errors=True)


class _Ended:
    """How a run ended: the exit code, the run summary's word for it, and the lines that say so (printed
    after the summary; a failure's traceback comes last of all)."""

    def __init__(self, code: int, outcome: str, lines=(), failures: dict | None = None, max_restarts: int = 0):
        self.code, self.outcome, self.lines = code, outcome, list(lines)
        self.failures, self.max_restarts = failures, max_restarts

    def report(self) -> None:
        for line in self.lines:
            _say(line)
        if self.failures:
            _report_failure(self.failures, self.max_restarts)


def _conclude(agent: Agent, result, diagnosis: RunDiagnosis, stop: StopRequest, max_restarts: int) -> _Ended:
    failed = result is not None and result.is_failed()
    failures = result.failures if failed else {}
    genuine = {rank: f for rank, f in failures.items() if f.exitcode != STOP_EXIT_CODE and f.exitcode > 0}
    if agent.ended_by_stop or (stop.active and failed and not genuine):
        others = {rank: f.exitcode for rank, f in failures.items() if f.exitcode != STOP_EXIT_CODE}
        code, lines = stop_report(stop, progress.read(diagnosis.directory), others)
        outcome = "stopped" if code == STOP_EXIT_CODE else "killed"
        agent.end_attempt(outcome)
        return _Ended(code, outcome, lines)
    agent.end_attempt("failed" if failed else "finished")
    if not failed:
        return _Ended(0, "finished")
    if diagnosis.stalled:
        return _Ended(STALL_EXIT_CODE, "failed", ["the workers were stopped after the stall reported above."])
    diagnosis.on_failure(failures)
    rank, failure = root_cause(failures)
    return _Ended(failure.exitcode if failure.exitcode > 0 else 1, "failed", failures=failures,
                  max_restarts=max_restarts)


def _stopped_by_signal(agent: Agent | None, exc: SignalException, diagnosis: RunDiagnosis,
                       stop: StopRequest) -> _Ended:
    """The run ended in the middle: a stop before any worker ran, the grace period over, a second Ctrl-C,
    or SIGHUP / SIGQUIT (torch's handler)."""
    if agent is not None:
        agent.end_attempt("killed")
    records = progress.read(diagnosis.directory)
    if isinstance(exc, StoppedBeforeStart):
        when = ("while the workers were being restarted after a failure" if agent is not None
                and agent.summary.now.attempts else "during the rendezvous, before any worker started")
        return _Ended(STOP_EXIT_CODE, "stopped", [f"stopped on request ({exc.sigval.name}) {when}: nothing to save; "
                                                  f"run the same command to resume."])
    if isinstance(exc, GraceExpired) or stop.active:
        code, lines = stop_report(stop, records, {})
        if not isinstance(exc, GraceExpired) and code != STOP_EXIT_CODE:  # the second Ctrl-C
            code, lines = 128 + int(exc.sigval), [f"stopped at once by a second Ctrl-C; the workers were killed"
                                                  f"{stop_lost(records)}."]
        return _Ended(code, "stopped" if code == STOP_EXIT_CODE else "killed", lines)
    return _Ended(128 + int(exc.sigval), "killed", [f"stopped by {exc.sigval.name}; the workers were stopped too."])


def _report_failure(failures: dict, max_restarts: int) -> int:
    rank, failure = root_cause(failures)
    attempt = f" on the last attempt ({max_restarts + 1} of {max_restarts + 1})" if max_restarts else ""
    _say(f"{describe_failure(rank, failure)}{attempt}.")
    for other in sorted(r for r in failures if r != rank):
        _say(f"  then {describe_failure(other, failures[other])}")
    traceback_text = failure_traceback(failure)
    if traceback_text:
        _say(f"traceback of rank {rank}, the first to fail:")
        sys.stderr.write(traceback_text if traceback_text.endswith("\n") else traceback_text + "\n")
        sys.stderr.flush()
    return failure.exitcode if failure.exitcode > 0 else 1


def main(argv: list[str] | None = None) -> int:
    return run(argv)
