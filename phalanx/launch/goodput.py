"""The run summary `phalanx run` prints at the end of every run: where the wall time went (goodput).

Each attempt is cut from the workers' progress records (diagnose/progress.py): start-up (interpreter,
imports, rendezvous, building the model) up to the training loop, checkpoint restores and saves, the
time in steps, and what is left (evaluation after the loop, shutdown, or, after a failure, the time
until the group was torn down). Steps after a failed attempt's last save are redone by the next one:
their time is lost, not counted. The launcher's own rendezvous and the gaps between attempts count
as start-up and restarts (under `--nnodes MIN:MAX`, regroupings too; each node lost or joined is
listed with the seconds to the first step at the new size). `goodput = time in steps that counted /
wall time`. The summary of every invocation is added to `run-summary.json` in the checkpoint
directory, so a job stopped and resumed shows its whole goodput; it is also written to `--log-dir`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUMMARY_NAME = "run-summary.json"
FORMAT = "phalanx.run-summary/1"
LOST = ("startup", "restore", "save", "redone", "restart", "outside")
LABELS = {"startup": "start-up and rendezvous", "restore": "checkpoint restores", "save": "checkpoint saves",
          "redone": "steps redone (lost after the last save)", "restart": "restarts and regroupings",
          "outside": "outside the training loop"}


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


@dataclass
class Times:
    """Seconds of wall time by what they were spent on; `counted` is the goodput's numerator."""

    counted: float = 0.0
    startup: float = 0.0
    restore: float = 0.0
    save: float = 0.0
    redone: float = 0.0
    restart: float = 0.0
    outside: float = 0.0

    @property
    def wall(self) -> float:
        return sum(asdict(self).values())

    def add(self, other: Times) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class Invocation:
    """One `phalanx run` of the job, on this node."""

    outcome: str = "running"  # finished | stopped | failed | killed
    started_at: float = field(default_factory=time.time)  # wall clock, for the reader
    attempts: int = 0
    first_step: int | None = None
    last_step: int | None = None
    steps_redone: int = 0
    saves: int = 0
    # Of times.save (the time saves held the training): waiting for the previous background write; and
    # the seconds background writers spent writing beside the training (not in the wall time's split).
    save_waited: float = 0.0
    save_background: float = 0.0
    times: Times = field(default_factory=Times)
    # Elastic runs: each node lost or joined, the world sizes, the step resumed from, the seconds from the
    # change (a lost node named, a joining one seen) to the first step at the new size; a loss kept in-process
    # (--min-world-size) also has the ranks' regroup time and the step they redid (launch/regroup.py).
    changes: list = field(default_factory=list)
    # The replica audit's findings (a rank that differed, healed or not) and the steps every rank skipped for a
    # non-finite gradient (engine/replicas/): the workers' events, as the lowest rank recorded them.
    audit: list = field(default_factory=list)


class RunSummary:
    """Fed by the agent as attempts start and end; `finish()` prints and writes the summary."""

    def __init__(self, log_dir: str | None, writes_job_file: bool):
        self.log_dir, self.writes_job_file = log_dir, writes_job_file
        self.begun = time.monotonic()
        self.now = Invocation()
        self.attempt_began: float | None = None
        self.last_end: float | None = None  # end of the previous attempt
        self.failed_tail = False  # the previous attempt failed: the gap until the next one is a restart
        self.directory: str | None = None  # the Checkpointer's, from the workers' records

    def attempt_started(self) -> None:
        now = time.monotonic()
        gap_from = self.last_end if self.last_end is not None else self.begun
        if self.last_end is None:
            self.now.times.startup += now - gap_from  # the launcher's rendezvous
        else:
            self.now.times.restart += now - gap_from
        self.attempt_began, self.last_end = now, None
        self.now.attempts += 1

    def attempt_ended(self, records: dict, outcome: str) -> None:
        """The attempt's workers are gone; `records`: this node's progress records, by global rank. `outcome`:
        finished or stopped (every step counts), failed or killed (the steps after the last save are lost)."""
        lost, failed = outcome in ("failed", "killed"), outcome == "failed"
        if self.attempt_began is None:
            return
        now = time.monotonic()
        span, began = now - self.attempt_began, self.attempt_began
        self.attempt_began, self.last_end = None, now
        times = self.now.times
        record = records[min(records)] if records else None
        if record is None or not record.loop_start:  # no Checkpointer seen: the whole attempt is one block
            if record is not None and record.ready:
                times.startup += max(0.0, record.ready - began)
                span -= max(0.0, record.ready - began)
            if failed:
                times.restart += span
            else:
                times.outside += span
            return
        for event in record.events:
            if event.get("event") == "checkpointer" and not self.directory:
                self.directory = event.get("directory")
            if event.get("event") in ("replica_mismatch", "nonfinite_skipped"):
                self.now.audit.append({k: v for k, v in event.items() if k != "at_step"})
        startup = max(0.0, record.loop_start - began - record.restore_seconds)
        counted = record.loop_at_save if lost else record.loop_seconds
        redone = record.loop_seconds - counted
        rest = max(0.0, span - startup - record.restore_seconds - record.save_seconds - record.loop_seconds)
        times.startup += startup
        times.restore += record.restore_seconds
        times.save += record.save_seconds
        times.counted += counted
        times.redone += redone
        if lost:
            self.now.steps_redone += record.steps_unsaved
        # live recovery (world/generation.py): each step in flight at a loss was redone by the ranks left
        self.now.steps_redone += sum(1 for event in record.events
                                     if event.get("event") == "generation" and event.get("redone"))
        if failed:  # from the last step to the teardown: detecting the failure, stopping the group
            times.restart += rest
        else:
            times.outside += rest
        self.now.saves += record.saves
        self.now.save_waited += record.save_waited
        self.now.save_background += record.save_background
        if self.now.first_step is None:
            self.now.first_step = record.first_step
        self.now.last_step = max(record.saved_step, record.first_step) if lost else record.step

    def finish(self, outcome: str) -> None:
        """Print the summary (this run, then the whole job) and write it as JSON."""
        now = time.monotonic()
        tail_from = self.last_end if self.last_end is not None else (self.attempt_began or self.begun)
        self.now.times.outside += max(0.0, now - tail_from)
        self.now.outcome = outcome
        job = self._job()
        for line in summary_lines(self.now, job, self._job_path()):
            _say(line)
        document = {"format": FORMAT, "invocations": job, "total": _total(job)}
        for path in (self._job_path(), os.path.join(self.log_dir, SUMMARY_NAME) if self.log_dir else None):
            if path is not None:
                _write(Path(path), document)

    def _job_path(self) -> str | None:
        if self.writes_job_file and self.directory and os.path.isdir(self.directory):
            return os.path.join(self.directory, SUMMARY_NAME)
        return None

    def _job(self) -> list[dict]:
        """Every invocation of this job so far, this one last."""
        earlier = []
        path = self._job_path()
        if path is not None:
            try:
                data = json.loads(Path(path).read_text())
                if data.get("format") == FORMAT:
                    earlier = list(data["invocations"])
            except (OSError, ValueError, KeyError, TypeError):
                earlier = []
        return earlier + [_as_dict(self.now)]


def _as_dict(invocation: Invocation) -> dict:
    data = asdict(invocation)
    data["times"] = {name: round(value, 3) for name, value in data["times"].items()}
    data["save_waited"], data["save_background"] = round(data["save_waited"], 3), round(data["save_background"], 3)
    data["wall"] = round(invocation.times.wall, 3)
    return data


def _total(job: list[dict]) -> dict:
    times = Times()
    for item in job:
        times.add(Times(**item["times"]))
    wall = times.wall
    return {"invocations": len(job), "wall": round(wall, 3),
            "times": {k: round(v, 3) for k, v in asdict(times).items()},
            "steps_redone": sum(item["steps_redone"] for item in job),
            "goodput": round(times.counted / wall, 4) if wall > 0 else 0.0}


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole > 0 else "-"


def summary_lines(now: Invocation, job: list[dict], job_path: str | None) -> list[str]:
    t = now.times
    wall = t.wall
    steps = ""
    if now.first_step is not None:
        steps = f"; steps {now.first_step} -> {now.last_step}, {now.steps_redone} to redo"
    lost = ", ".join(f"{LABELS[name]} {getattr(t, name):.1f} s" for name in LOST if getattr(t, name) >= 0.05)
    lines = [f"run summary: {wall:.1f} s wall, {now.attempts} attempt(s), {now.outcome}{steps}; goodput "
             f"{_percent(t.counted, wall)} ({t.counted:.1f} s in steps that counted)",
             f"  time lost: {lost or 'none'}"]
    if now.first_step is None:
        lines[-1] += " (no checkpointer.step() seen: the steps' time is not known)"
    if now.saves and (now.save_background or now.save_waited):
        lines.append(f"  checkpoints: {now.saves} save(s) held the training {t.save:.1f} s (of which "
                     f"{now.save_waited:.1f} s waiting for a write in flight), written in the background in "
                     f"{now.save_background:.1f} s")
    for change in now.changes:
        took = f", {change['seconds']:.1f} s to the first step there" if change.get("seconds") else ""
        before, after = change["world"]
        if change.get("healed"):  # ranks taken in (world/joining.py): the state they were handed, and its time
            size, seconds = change["healed"]
            lines.append(f"  {change['change']}: world size {before} -> {after}, taken in after step {change['step']}, "
                         f"regrouped in {change['regroup_seconds']:.3f} s, {size / 1e6:.1f} MB of state healed in "
                         f"{seconds:.2f} s, no step redone")
            continue
        if "regroup_seconds" in change:  # kept in-process: how long the ranks left took to regroup
            redone = f"step {change['redone'] + 1} redone" if change.get("redone") is not None else "no step redone"
            took += f", regrouped in {change['regroup_seconds']:.3f} s, {redone}"
        lines.append(f"  {change['change']}: world size {before} -> {after}, resumed from step {change['step']}{took}")
    for event in now.audit:
        if event["event"] == "nonfinite_skipped":
            lines.append(f"  step {event['step']} skipped on every rank: a non-finite gradient on rank(s) "
                         f"{event['ranks']} ({event.get('parameter') or 'parameter unknown'})")
        else:
            lines.append(f"  replica audit after step {event['step']}: {event['entry']}; all agreed at step "
                         f"{event['agreed_at']}; {'healed' if event['healed'] else 'the run stopped'}")
    if len(job) > 1:
        total = _total(job)
        lines.append(f"  the whole job, {len(job)} runs: {total['wall']:.1f} s wall, goodput "
                     f"{100 * total['goodput']:.1f} %, {total['steps_redone']} step(s) redone")
    if job_path:
        lines.append(f"  kept in {job_path}")
    return lines


def _write(path: Path, document: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # readers see the old file or the new one
        temp.write_text(json.dumps(document, indent=1))
        os.replace(temp, path)
    except OSError as exc:
        _say(f"could not write {path}: {exc}")
