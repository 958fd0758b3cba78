"""Typed exceptions for everything phalanx reports to a user.

Every message names who saw the problem (the rank), what was seen, what was expected and what to
do, so a log line from one rank out of many is enough to act on.
"""

from __future__ import annotations

import pickle


def explain(problem: str, *, rank: int | None = None, seen=None, expected=None, fix: str | None = None) -> str:
    """Build a message: '[rank R] problem: seen X, expected Y. fix'."""
    parts = []
    if rank is not None:
        parts.append(f"[rank {rank}] ")
    parts.append(problem)
    details = []
    if seen is not None:
        details.append(f"seen {seen}")
    if expected is not None:
        details.append(f"expected {expected}")
    if details:
        parts.append(": " + ", ".join(details))
    text = "".join(parts).rstrip(".") + "."
    if fix:
        text += " " + fix
    return text


class PhalanxError(RuntimeError):
    """Base of every error phalanx raises."""


class WorldConfigError(PhalanxError, ValueError):
    """The environment describing the world (RANK, WORLD_SIZE, MASTER_ADDR, SLURM_*, ...) is wrong."""


class MasterUnreachableError(PhalanxError, ConnectionError):
    """The rendezvous master could not be reached within the connect timeout."""


class StoreLostError(MasterUnreachableError):
    """The rendezvous store went away with its host (node 0's `phalanx run`) in the middle of an elastic run."""


class RendezvousTimeoutError(PhalanxError, TimeoutError):
    """The nodes did not meet within --rdzv-timeout: fewer than --nnodes MIN (elastic), or some of the fixed
    --nnodes N missing (`missing_ranks`: their node ranks)."""

    def __init__(self, message: str, missing_ranks=()):
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)


class DuplicateNodeRankError(WorldConfigError):
    """Two launchers of a fixed --nnodes N run hold the same --node-rank (both left it at its default 0, say).
    `launchers`: the two, as 'host (address, pid N)'."""

    def __init__(self, message: str, node_rank: int = -1, launchers=()):
        super().__init__(message)
        self.node_rank = node_rank
        self.launchers = list(launchers)


class RunEndedError(PhalanxError):
    """An elastic run was closed (its workers finished) before this node met the others in a new round."""


class PortInUseError(PhalanxError, OSError):
    """The master port is already taken by another process on this host."""


class RanksTimedOutError(PhalanxError, TimeoutError):
    """Some ranks did not arrive (at a barrier, or at the end of a run) within the time bound."""

    def __init__(self, message: str, missing_ranks=()):
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)


class RankFailedError(PhalanxError):
    """A rank raised or died; carries that rank's traceback."""

    def __init__(self, message: str, rank: int, traceback_text: str = "", exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text
        self.exitcode = exitcode


class DataConfigError(PhalanxError, ValueError):
    """A sampler, loader or metric was given arguments that cannot work (rank out of range, wrong length)."""


class ResumeStateError(PhalanxError, ValueError):
    """A saved data position does not fit this run (another world size, dataset length or shuffle seed)."""


class CheckpointError(PhalanxError):
    """Base of the errors a Checkpointer raises."""


class CheckpointValueError(CheckpointError, TypeError):
    """An entry of the state to save holds something that cannot be loaded back safely."""


class CheckpointWriteError(CheckpointError, OSError):
    """Rank 0 could not write the checkpoint; every rank raises it, so none trains on unsaved."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """Checkpoints exist but none of them is complete and readable."""


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file holds objects that loading would have to execute code for; it was refused."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the objects it is loaded into (another model, another state layout).

    `missing`: keys the target expects but the checkpoint lacks; `unexpected`: keys only the checkpoint
    has; `mismatched`: (key, shape in checkpoint, shape in target) for tensors whose shapes differ.
    """

    def __init__(self, message: str, entry: str = "", missing=(), unexpected=(), mismatched=()):
        super().__init__(message)
        self.entry = entry
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class ParameterMismatchError(PhalanxError, ValueError):
    """Ranks wrapped models whose parameters (names, shapes or dtypes) differ."""

    def __init__(self, message: str, name: str = "", ranks=()):
        super().__init__(message)
        self.name = name
        self.ranks = sorted(ranks)


class NoTrainableParametersError(PhalanxError):
    """DistributedDataParallel was given a module with no parameter that requires a gradient."""


class UnusedParameterError(PhalanxError):
    """Parameters received no gradient in a synchronized backward pass and find_unused_parameters is off."""

    def __init__(self, message: str, names=()):
        super().__init__(message)
        self.names = list(names)


class UnevenInputsError(PhalanxError):
    """Ranks fell out of step in DDP's collectives (typically: some ran out of data without `join()`)."""

    def __init__(self, message: str, step: int = -1, missing_ranks=()):
        super().__init__(message)
        self.step = step
        self.missing_ranks = sorted(missing_ranks)


class ReplicaMismatchError(PhalanxError):
    """The replica audit found ranks holding different parameters or optimizer state, and could not heal them
    (2 ranks, no majority, or audit="raise"). `ranks`: those that differ; `sides`: the groups of ranks that
    agree; `entry`: what differs first; `step`: the audit's step; `agreed_at`: the last step all agreed."""

    def __init__(self, message: str, ranks=(), sides=(), entry: str = "", step: int = -1, agreed_at: int = -1):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.sides = [list(side) for side in sides]
        self.entry = entry
        self.step = step
        self.agreed_at = agreed_at


class NonFiniteGradientError(PhalanxError, FloatingPointError):
    """A rank's own gradient held a NaN or an Inf before the exchange: no rank applied that step. `ranks`: the
    ranks that saw one; `step`, `micro_batch`; `parameter`: the first parameter holding one (None if unknown)."""

    def __init__(self, message: str, ranks=(), step: int = -1, micro_batch: int = 0, parameter: str | None = None):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.step = step
        self.micro_batch = micro_batch
        self.parameter = parameter


class BenchConfigError(PhalanxError, ValueError):
    """`phalanx bench` was asked for something this machine or install cannot run."""


class StepLogError(PhalanxError, ValueError):
    """A StepLog was given something it cannot log (a negative sample count, a non-number loss, every < 1)."""


class TensorBoardUnavailableError(StepLogError, ImportError):
    """`StepLog(tensorboard=True)` asked for TensorBoard event files and tensorboardX is not installed."""


class PeerFailedError(PhalanxError, ConnectionError):
    """A peer rank abandoned a shared-memory exchange (it failed; its own log says why)."""

    def __init__(self, message: str, peer_rank: int | None = None):
        super().__init__(message)
        self.peer_rank = peer_rank


class PeerDiedError(PeerFailedError):
    """A peer rank's process ended (crash, SIGKILL, out of memory) while this rank waited for it."""


class MembershipError(PhalanxError):
    """After a loss, the run cannot go on in-process with this rank: too few ranks are left, or the others
    went on without it (phalanx/world/generation.py)."""


class CollectiveMismatchError(PhalanxError, ValueError):
    """Ranks issued different collectives (another size, dtype or order) at the same point."""

    def __init__(self, message: str, peer_rank: int | None = None):
        super().__init__(message)
        self.peer_rank = peer_rank


class ShmUnavailableError(PhalanxError):
    """The shared-memory transport cannot serve this process group (ranks on several hosts, disabled, ...)."""


class SyncBatchNormError(PhalanxError, ValueError):
    """SyncBatchNorm got input it cannot normalize (wrong shape, fewer than 2 samples in the whole group)."""


class CommHookError(PhalanxError, TypeError, ValueError):
    """register_comm_hook() got a hook torch DDP refuses too (not callable, wrong annotations, a second hook).
    It is the TypeError, ValueError or RuntimeError torch raises there, with torch's message first."""


class DDPPickleError(PhalanxError):
    """A DistributedDataParallel on a process group other than the default one was pickled or deep-copied."""


class AcrossHostsError(PhalanxError, ValueError):
    """`across_hosts=` of DistributedDataParallel (a `phalanx.DiLoCo`) was given a bad setting, or a setting
    this mode does not run with (a sharded level, live recovery, hosts of unequal size)."""


class ShardingError(PhalanxError, ValueError):
    """A sharded DistributedDataParallel (shard="optimizer" / "gradients") was asked for something it cannot
    do: an unsupported combination (join, comm hooks, sparse gradients), or an optimizer it cannot shard."""


class StrayOptimizerError(ShardingError):
    """An optimizer holds a tensor the sharded model does not train: a parameter `shard="parameters"` replaced
    with its shard, or one that only `model.shard_optimizer(opt)` may step. Names the parameter."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def seconds_setting(raw, problem: str, expected: str, fix: str) -> float:
    """`raw` (a flag's or an environment variable's text) as seconds >= 0, else a WorldConfigError."""
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise WorldConfigError(explain(problem, seen=repr(raw), expected=expected, fix=fix))
    return seconds


class TorchInternalError(PhalanxError, NotImplementedError, AttributeError):
    """A library reached for a part of torch DDP's internals (its C++ reducer, fused optimizers, runtime
    logging) that phalanx's engine has no counterpart for. It is a NotImplementedError, and an
    AttributeError too, so that `getattr(model, name, default)` and `hasattr` see the name as absent."""

    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name
