"""`phalanx bench --profile`: where the time of a phalanx DDP step goes, per rank and per bucket.

After the timed blocks, one more block of the phalanx variant runs with its exchange's phase timer
on (exchange/phase_timer.py): copy into buckets, reduction, waiting for peers (or a transport's
thread), copy out; the rest of the step is compute, the optimizer and the engine's bookkeeping.
Kept apart from the timed blocks, so switching the timers on never touches the headline figures.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..exchange.phase_timer import PHASES


def profile_block(module, optimizer, train_step, bench_model, batches, warmup: int, steps: int) -> dict:
    """Per-step milliseconds of each phase on this rank, gathered from every rank (collective)."""
    timer = module._reducer.exchange.timer
    for i in range(warmup):
        train_step(module, optimizer, batches[i % len(batches)], bench_model.loss)
    dist.barrier()
    timer.reset()
    timer.enabled = True
    started = time.perf_counter()
    try:
        for i in range(steps):
            train_step(module, optimizer, batches[(warmup + i) % len(batches)], bench_model.loss)
    finally:
        timer.enabled = False
    step_ms = (time.perf_counter() - started) * 1e3 / steps
    per_bucket: dict[int, dict[str, float]] = {}
    for (phase, bucket), seconds in timer.seconds.items():
        per_bucket.setdefault(bucket, dict.fromkeys(PHASES, 0.0))[phase] = seconds * 1e3 / steps
    phases = {phase: sum(b[phase] for b in per_bucket.values()) for phase in PHASES}
    mine = {"step_ms": step_ms, **phases, "rest": step_ms - sum(phases.values()),
            "buckets": [{"bucket": k, "numel": _numel(module, k), "mode": _mode(module, k), **per_bucket[k]}
                        for k in sorted(per_bucket)]}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"exchange": type(module._reducer.exchange).__name__, "ranks": everyone}


def _numel(module, index: int) -> int:
    return module._reducer.buckets[index].numel


def _mode(module, index: int) -> str:
    modes = getattr(module._reducer.exchange, "modes", None)
    return modes[index] if modes else "all-reduce"


def format_profile(models: list[dict]) -> str:
    """One line per model and rank: ms per step in each phase."""
    lines = ["", "where a phalanx DDP step goes (ms per step; --profile):",
             f"{'model':<8} {'rank':>4} {'step':>8} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'rest':>9}"]
    for model in models:
        profile = model.get("profile")
        if not profile:
            continue
        for rank, row in enumerate(profile["ranks"]):
            lines.append(f"{model['name']:<8} {rank:>4} {row['step_ms']:8.2f} "
                         + " ".join(f"{row[p]:9.2f}" for p in PHASES) + f" {row['rest']:9.2f}")
    return "\n".join(lines)


def write_profile_chart(models: list[dict], path) -> object | None:
    """Stacked bars per model (rank 0): the exchange's phases in ms, each bar labelled with the step time
    and the rest (compute, optimizer, bookkeeping), which would dwarf them on a common scale."""
    rows = [(m["name"], m["profile"]["ranks"][0]) for m in models if m.get("profile")]
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    names = [name for name, _ in rows]
    bottoms = [0.0] * len(rows)
    for phase in PHASES:
        heights = [row[phase] for _, row in rows]
        axes.bar(names, heights, bottom=bottoms, label=phase.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, (_, row), top in zip(range(len(rows)), rows, bottoms):
        axes.annotate(f"step {row['step_ms']:.1f} ms\nrest {row['rest']:.1f} ms", (x, top), ha="center",
                      va="bottom", fontsize="small")
    axes.set_ylim(0, max(bottoms) * 1.35 if max(bottoms) > 0 else 1)
    axes.set_ylabel("ms per step (rank 0)")
    axes.set_title("the gradient exchange of a phalanx DDP step, by phase")
    axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def maybe_profile(built: dict, train_step, bench_model, batches, warmup: int, steps: int) -> dict | None:
    """The profile of the phalanx variant, when it is among the variants built."""
    if "phalanx" not in built:
        return None
    module, optimizer = built["phalanx"]
    torch.manual_seed(0)
    return profile_block(module, optimizer, train_step, bench_model, batches, warmup, steps)
