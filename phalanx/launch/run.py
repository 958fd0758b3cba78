"""`phalanx run`: start one worker per device on this node, on torch's elastic agent.

torch.distributed.elastic does the work: rendezvous between nodes, one process per local rank,
monitoring, stopping the whole group when one worker fails, restarting it up to --max-restarts
times. phalanx adds what a user sees: a loopback-only store on a free port for single-node runs,
rank-prefixed output, the failing rank's own traceback printed last, no process left behind, a
stop request turned into one agreed checkpoint (stop.py), and a run summary (goodput.py). The
flags and the verdict at the end are command/'s (flags.py, outcome.py); this module launches.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from datetime import timedelta

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig

from ..allocator import preload_for_workers
from ..errors import PhalanxError, RunEndedError
from ..world.generation import MIN_WORLD_ENV
from ..world.interface import set_for_world
from ..world.meeting.membership import ElasticRendezvous
from ..world.meeting.rendezvous import StaticRendezvous
from ..world.meeting.store import LOOPBACK
from . import live_status
from .agent import Agent
from .command.flags import DEFAULT_MULTI_NODE_PORT, build_parser, check_args
from .command.outcome import Ended, conclude, stopped_by_signal
from .diagnosis import RunDiagnosis
from .failures import sweep_process_groups
from .forkserver.server import WORKER_ENTRY, WorkerServer
from .goodput import RunSummary
from .live_status import LiveStatus
from .regroup import KeptSurvivors, Regroup
from .stop import StopRequest, interruptible

DEFAULT_UNDER_RANGE = " (the default under --nnodes MIN:MAX; --min-world-size 0: off)"


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


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
    return ElasticRendezvous(args.master_addr, port, config.run_id, config.min_nodes, config.max_nodes, timeout,
                             args.rdzv_last_call)


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
            ended = conclude(agent, result, diagnosis, stop, args.max_restarts)
        except RunEndedError as exc:  # a node that came to join a run which finished first: nothing left to do
            ran = summary.now.attempts
            if ran and agent is not None:
                agent.end_attempt("failed")
            ended = Ended(1 if ran else 0, "failed" if ran else "finished", [str(exc)])
        except (PhalanxError, RendezvousError) as exc:
            if agent is not None:  # an elastic group that lost its store: the attempt ends here
                agent.end_attempt("failed")
            ended = Ended(1, "failed", [f"{type(exc).__name__}: {exc}"])
        except SignalException as exc:
            ended = stopped_by_signal(agent, exc, diagnosis, stop)
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


def main(argv: list[str] | None = None) -> int:
    return run(argv)
