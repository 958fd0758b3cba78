"""torch's contract for `register_comm_hook`, with torch's exception types and words, then ours.

Code written against torch DDP matches on these messages ("Communication hook must be callable.",
...), so phalanx raises the same types with the same text first, and adds what was seen and what
to do. A hook's annotations, when present, must be torch's `GradBucket` and `Future[Tensor]`.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from ..errors import CommHookError, explain

NOT_CALLABLE = "Communication hook must be callable."
ONLY_ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."
BUCKET_ANNOTATION = "Communication hook: bucket annotation should be dist.GradBucket."
RETURN_ANNOTATION = "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."


def check_comm_hook(hook, already_registered: bool) -> None:
    """Raise CommHookError where torch DDP's register_comm_hook raises."""
    rank = dist.get_rank() if dist.is_initialized() else None
    if already_registered:
        raise CommHookError(ONLY_ONCE + " " + explain(
            "a comm hook is already registered on this model", rank=rank, seen=f"a second hook {_name(hook)}",
            fix="Register one hook per model; to change it, wrap the model in a new DistributedDataParallel."))
    if not callable(hook):
        raise CommHookError(NOT_CALLABLE + " " + explain(
            "the hook is not callable", rank=rank, seen=f"a {type(hook).__name__}",
            expected="a function hook(state, bucket) -> torch.futures.Future[torch.Tensor]",
            fix="Pass the function itself, e.g. default_hooks.allreduce_hook, not the result of calling it."))
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    parameters = list(signature.parameters.values())
    bucket = signature.parameters.get("bucket", parameters[1] if len(parameters) > 1 else None)
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise CommHookError(BUCKET_ANNOTATION + " " + explain(
            f"the bucket parameter of {_name(hook)} is annotated otherwise", rank=rank,
            seen=_shown(bucket.annotation), expected="torch.distributed.GradBucket, or no annotation",
            fix="Annotate it `bucket: dist.GradBucket` or drop the annotation."))
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise CommHookError(RETURN_ANNOTATION + " " + explain(
            f"{_name(hook)} is annotated to return something else than a future of a tensor", rank=rank,
            seen=_shown(signature.return_annotation), expected="torch.futures.Future[torch.Tensor], or no annotation",
            fix="Return the future of the averaged bucket (e.g. work.get_future()) and annotate it so, "
                "or drop the annotation."))


def _name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _shown(annotation) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__qualname__", repr(annotation))
