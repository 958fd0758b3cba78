"""One StepLog record from every rank's numbers for the same window of steps: pure arithmetic.

Each rank sums what it saw over the window into one row of `FIELDS` floats (the only thing that
crosses the ranks); `make_record` turns the rows, in rank order, into the record's pinned fields.
Busy time is a rank's step time less what it waited for its peers: the all-reduce ends every rank's
step together, so only the busy time shows which rank the others waited for.
"""

from __future__ import annotations

import math
import statistics
import time

# A rank's row: steps in the window and its end step, the loss summed over its samples, its samples
# and tokens (TOKENS_GIVEN: steps that passed tokens), seconds busy / in all / waiting for peers /
# waiting for data, its peak memory in bytes, the optimizer steps skipped for a non-finite gradient, and
# across_hosts=DiLoCo's outer steps and the bytes it all-reduced across hosts in them.
FIELDS = ("steps", "end_step", "loss_sum", "samples", "tokens", "tokens_given", "busy_s", "wall_s", "wait_s",
          "data_s", "peak_memory", "skipped", "outer_steps", "across_bytes")
INDEX = {name: i for i, name in enumerate(FIELDS)}


def make_record(rows: list, *, lr: float | None = None, memory_kind: str = "rss", flops_per_sample: float | None = None,
                flops_per_token: float | None = None, peak_flops: float | None = None,
                now: float | None = None) -> dict:
    """The record of one window from each rank's row (rank r's row at index r).

    >>> rows = [[2, 10, 4.0, 4, 0, 0, 0.20, 0.30, 0.10, 0.0, 1e9], [2, 10, 12.0, 8, 0, 0, 0.30, 0.30, 0.0, 0.0, 2e9]]
    >>> r = make_record(rows, now=0.0)
    >>> r["loss"], r["samples_per_s"], r["step_time_median"], r["slowest_rank"], r["peak_memory_rank"]
    (1.3333333333333333, 40.0, 0.125, 1, 1)
    """
    col = dict(zip(FIELDS, zip(*rows)))  # a column per field, in rank order
    world = len(rows)
    steps = max(col["steps"]) or 1.0
    samples = sum(col["samples"])
    wall = max(col["wall_s"])  # every rank's window ends together, give or take a step's skew
    busy = [b / max(n, 1.0) for b, n in zip(col["busy_s"], col["steps"])]  # per step, per rank
    slowest = max(range(len(busy)), key=busy.__getitem__)
    tokens_known = all(g > 0 for g in col["tokens_given"])
    samples_per_s = samples / wall if wall > 0 else None
    tokens_per_s = sum(col["tokens"]) / wall if tokens_known and wall > 0 else None
    peak_rank = max(range(len(rows)), key=col["peak_memory"].__getitem__)
    denominator = peak_flops * world if peak_flops else None
    achieved = None
    if flops_per_token and tokens_per_s is not None:
        achieved = flops_per_token * tokens_per_s
    elif flops_per_sample and samples_per_s is not None:
        achieved = flops_per_sample * samples_per_s
    record = {
        "step": int(max(col["end_step"])),
        "steps": int(steps),
        "time": time.time() if now is None else now,
        "loss": _finite(sum(col["loss_sum"]) / samples) if samples > 0 else None,
        "samples": int(samples),
        "samples_per_s": samples_per_s,
        "tokens_per_s": tokens_per_s,
        "step_time": wall / steps,
        "step_time_min": min(busy),
        "step_time_median": statistics.median(busy),
        "step_time_max": busy[slowest],
        "slowest_rank": slowest,
        "exchange_exposed": sum(w / t if t > 0 else 0.0 for w, t in zip(col["wait_s"], col["wall_s"])) / world,
        "data_wait": sum(d / max(n, 1.0) for d, n in zip(col["data_s"], col["steps"])) / world,
        "peak_memory": int(col["peak_memory"][peak_rank]),
        "peak_memory_rank": peak_rank,
        "memory_kind": memory_kind,
        "lr": lr,
        "mfu": achieved / denominator if achieved is not None and denominator else None,
        "peak_flops": denominator,
        "world_size": world,
        "skipped_steps": int(max(col["skipped"])) if "skipped" in col else 0,  # every rank skips together
        "outer_steps": int(max(col["outer_steps"])) if "outer_steps" in col else 0,  # every rank's, together
        "bytes_across_hosts": int(sum(col["across_bytes"])) if "across_bytes" in col else 0,
    }
    return record


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: a diverged loss is written as null (and printed as nan)."""
    return value if math.isfinite(value) else None


def line(record: dict) -> str:
    """The one line rank 0 prints: 'step 40 | loss 0.5321 | 1,204 samples/s | 41.2 ms/step | busy ...'."""
    parts = [f"step {record['step']}"]
    parts.append(f"loss {record['loss']:.4g}" if record["loss"] is not None else "loss nan")
    if record["samples_per_s"] is not None:
        parts.append(f"{record['samples_per_s']:,.0f} samples/s")
    if record["tokens_per_s"] is not None:
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    ms = 1e3
    parts.append(f"{record['step_time'] * ms:.1f} ms/step")
    if record["world_size"] > 1:
        parts.append(f"busy {record['step_time_min'] * ms:.1f}/{record['step_time_median'] * ms:.1f}/"
                     f"{record['step_time_max'] * ms:.1f} ms, slowest rank {record['slowest_rank']}")
    parts.append(f"exchange {record['exchange_exposed']:.0%}")
    parts.append(f"data {record['data_wait'] * ms:.1f} ms")
    memory = f"{'mem' if record['memory_kind'] == 'rss' else 'cuda'} {record['peak_memory'] / 2 ** 30:.2f} GiB"
    if record["world_size"] > 1:
        memory += f" on rank {record['peak_memory_rank']}"
    parts.append(memory)
    if record["lr"] is not None:
        parts.append(f"lr {record['lr']:.3g}")
    if record["mfu"] is not None:
        parts.append(f"mfu {record['mfu']:.1%}")
    if record.get("outer_steps"):
        parts.append(f"outer {record['outer_steps']} ({record['bytes_across_hosts'] / 1e6:,.1f} MB across hosts)")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']} (non-finite gradients)")
    return " | ".join(parts)
