"""From the ranks' rings and stacks to one verdict: who is stuck, where, and who waits for it in what.

Ranks number their collectives in the order they issue them, so the same number must mean the same
collective everywhere. Three findings, first match wins: a rank that died; a desync (at one number,
ranks issued different collectives, or the same one from different steps); a stall (some ranks
wait in collective #n, the others never entered it, and their stacks say where they are instead).
Pure functions of their inputs, so every case is testable without processes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from .record import Entry, Snapshot
from .stacks import main_frames, user_location

_FAMILY = {"shadow": "bucket"}  # join()'s shadow exchange pairs with the others' bucket exchange


@dataclass
class Verdict:
    """What `phalanx run` (or a worker's watchdog) prints and writes as JSON after a stall or failure."""

    kind: str  # "stall", "desync", "dead" or "none"
    headline: str
    lines: list[str] = field(default_factory=list)
    culprits: list[dict] = field(default_factory=list)
    waiting: list[dict] = field(default_factory=list)
    collective: dict | None = None
    desync: dict | None = None
    ranks: dict = field(default_factory=dict)

    def text(self, with_stacks: bool = True) -> str:
        out = [f"verdict: {self.headline}", *("  " + line for line in self.lines)]
        if with_stacks:
            for rank, info in sorted(self.ranks.items()):
                if info.get("main_thread"):  # innermost first, as faulthandler prints; all threads in the JSON
                    out.append(f"--- main thread of rank {rank} (pid {info.get('pid')}), most recent call first ---")
                    out += [f"  {frame}" for frame in info["main_thread"]]
                elif info.get("stack"):
                    out.append(f"--- rank {rank} (pid {info.get('pid')}) ---")
                    out.append(info["stack"].rstrip())
        return "\n".join(out) + "\n"

    def as_json(self) -> dict:
        return {"kind": self.kind, "verdict": self.headline, "details": self.lines, "culprits": self.culprits,
                "waiting": self.waiting, "collective": self.collective, "desync": self.desync,
                "ranks": {str(r): info for r, info in sorted(self.ranks.items())}}

    def write(self, path: str) -> None:
        with open(path + ".tmp", "w") as handle:
            json.dump(self.as_json(), handle, indent=1)
        os.replace(path + ".tmp", path)


def entry_json(entry: Entry | None) -> dict | None:
    if entry is None:
        return None
    return {"seq": entry.seq, "kind": entry.kind, "bucket": entry.bucket, "numel": entry.numel,
            "dtype": entry.dtype, "state": entry.state, "step": entry.step, "site": entry.site}


def find_desync(snapshots: dict[int, Snapshot]) -> dict | None:
    """The first collective number at which ranks disagree: {seq, entries by rank, odd ranks, reason}."""
    by_rank = {rank: {e.seq: e for e in snap.entries} for rank, snap in snapshots.items() if snap.entries}
    if len(by_rank) < 2:
        return None
    common = set.intersection(*(set(entries) for entries in by_rank.values()))
    for seq in sorted(common):
        entries = {rank: by_rank[rank][seq] for rank in sorted(by_rank)}
        shapes = {rank: (_FAMILY.get(e.kind, e.kind), *e.descriptor()[1:]) for rank, e in entries.items()}
        if len(set(shapes.values())) > 1:
            counts = Counter(shapes.values())
            # The majority is right; on a tie, the side of the lowest rank.
            majority = max(counts, key=lambda shape: (counts[shape], -min(r for r, s in shapes.items() if s == shape)))
            odd = [rank for rank, shape in shapes.items() if shape != majority]
            return {"seq": seq, "entries": entries, "odd": odd, "reason": "different collectives"}
        steps = {rank: e.step for rank, e in entries.items() if e.kind == "bucket"}
        if len(steps) == len(entries) and len(set(steps.values())) > 1:
            # A rank that issues a step's exchange while its peers issue an earlier step's one skipped
            # a backward (or ran an extra synchronized forward) in between.
            low = min(steps.values())
            return {"seq": seq, "entries": entries, "odd": [r for r, s in steps.items() if s != low],
                    "reason": "the same collective from different steps"}
    return None


def _main_stack(snapshot: Snapshot | None, stack: str | None) -> list:
    return main_frames(stack, snapshot.main_thread if snapshot else 0) if stack else []


def _ago(now_ns: int, then_ns: int) -> str:
    return f"{max(0.0, (now_ns - then_ns) / 1e9):.1f}s" if then_ns else "?"


def _rank_info(rank, snap, stack, pid, now_ns) -> dict:
    frames = _main_stack(snap, stack)
    info = {"pid": snap.pid if snap else pid, "stack": stack, "location": user_location(frames) if frames else None,
            "main_thread": [f"{file}:{line} in {function}" for file, line, function in frames]}
    if snap is not None:
        info.update(phase=snap.phase, step=snap.step, phase_for_s=round((now_ns - snap.phase_since_ns) / 1e9, 2),
                    last=entry_json(snap.last))
    else:
        info.update(phase="startup", step=0, last=None)
    return info


def judge(snapshots: dict[int, Snapshot], expected: list[int], stacks: dict[int, str], now_ns: int, *,
          dead: dict[int, str] | None = None, pids: dict[int, int] | None = None,
          elsewhere: list[int] | None = None) -> Verdict:
    """The verdict on ranks `expected` (this host's): their rings, stacks, and `dead` ({rank: how it ended})."""
    pids = pids or {}
    ranks = {r: _rank_info(r, snapshots.get(r), stacks.get(r), pids.get(r), now_ns) for r in expected}
    desync = find_desync({r: s for r, s in snapshots.items() if r in ranks})
    if desync is not None:  # the cause; a rank that then died (Gloo aborts on a size mismatch) is its effect
        verdict = _desync_verdict(desync, snapshots, ranks)
        verdict.lines += [f"then rank {r} {how}." for r, how in sorted((dead or {}).items())]
        return verdict
    if dead:
        return _dead_verdict(snapshots, dead, ranks, now_ns)
    return _stall_verdict(snapshots, expected, ranks, now_ns, elsewhere or [])


def _phase_text(info: dict) -> str:
    """'data (before step 5)': a rank in its data phase is loading the next step's batch."""
    if info["phase"] == "data":
        return f"data (before step {info['step'] + 1})"
    return f"{info['phase']} (step {info['step']})"


def _describe_rank(rank: int, info: dict) -> str:
    where = f" at {info['location']}" if info.get("location") else ""
    return f"rank {rank} is in phase {_phase_text(info)}{where}"


def _dead_verdict(snapshots, dead, ranks, now_ns) -> Verdict:
    lines, culprits = [], []
    for rank, how in sorted(dead.items()):
        snap = snapshots.get(rank)
        last = snap.last if snap else None
        record = (f"its last record: {last.describe()} {last.state}, issued at {last.site}, in phase {snap.phase} "
                  f"of step {snap.step}") if last else "it left no record (it died before phalanx.init())"
        lines.append(f"rank {rank} (pid {ranks[rank]['pid']}) {how}; {record}.")
        culprits.append({"rank": rank, "how": how, "phase": ranks[rank]["phase"], "step": ranks[rank]["step"],
                         "last": entry_json(last)})
    # The first dead rank is the headline; more than one dead rank get a line each.
    return Verdict("dead", lines[0].rstrip("."), lines[1:], culprits, ranks=ranks)


def _desync_verdict(desync, snapshots, ranks) -> Verdict:
    seq, entries, odd = desync["seq"], desync["entries"], desync["odd"]
    lines = [f"rank {r} issued {e.describe()} in step {e.step} at {e.site}; it is now in phase "
             f"{_phase_text(ranks[r])}" + (f" at {ranks[r]['location']}" if ranks[r].get("location") else "")
             for r, e in entries.items()]
    named = ", ".join(map(str, odd))
    if desync["reason"] == "different collectives":
        headline = (f"desync at collective #{seq}: rank(s) {named} issued a different collective than the others "
                    f"(kind, bucket, size or dtype differ); see both call sites below")
        hint = ("Ranks must build the same model and the same DDP arguments (bucket_cap_mb, find_unused_parameters) "
                "and run the same code path around each backward.")
    else:
        headline = (f"desync at collective #{seq}: rank(s) {named} issued it from a later step than the others: "
                    f"they skipped a backward (or ran an extra synchronized forward)")
        hint = "Look for a condition around loss.backward() that differs between ranks."
    culprits = [{"rank": r, "phase": ranks[r]["phase"], "step": ranks[r]["step"], "entry": entry_json(entries[r]),
                 "why": desync["reason"]} for r in odd]
    collective = entry_json(next(e for r, e in entries.items() if r not in odd))
    return Verdict("desync", headline, lines + [hint], culprits, collective=collective,
                   desync={"seq": seq, "reason": desync["reason"], "odd": odd,
                           "entries": {str(r): entry_json(e) for r, e in entries.items()}}, ranks=ranks)


def _waiting_in(snap: Snapshot) -> Entry | None:
    """The collective a rank waits in: its first unfinished entry after its last finished one (buckets
    are delivered in launch order, so a rank waits in the earliest one it launched)."""
    waiting = None
    for entry in reversed(snap.entries):
        if entry.state == "done":
            break
        waiting = entry
    return waiting


def _stall_verdict(snapshots, expected, ranks, now_ns, elsewhere) -> Verdict:
    open_entries = {r: e for r, s in snapshots.items() if r in ranks and (e := _waiting_in(s)) is not None}
    waiting, culprits, lines = [], [], []
    target = min(open_entries.values(), key=lambda e: e.seq) if open_entries else None
    for rank in expected:
        snap, info = snapshots.get(rank), ranks[rank]
        if snap is None:
            culprits.append({"rank": rank, "phase": "startup", "why": "never reached phalanx.init()",
                             "location": info["location"]})
            lines.append(f"rank {rank} never reached phalanx.init()" +
                         (f": it is at {info['location']}" if info["location"] else ""))
            continue
        entry = open_entries.get(rank)
        if entry is not None and target is not None and entry.seq == target.seq:
            since = entry.started_ns or entry.entered_ns
            waiting.append({"rank": rank, "seq": entry.seq, "since_s": round((now_ns - since) / 1e9, 2),
                            "state": entry.state, "site": entry.site})
            lines.append(f"rank {rank} waits in {entry.describe()} ({entry.state}) since {_ago(now_ns, since)}, "
                         f"issued at {entry.site}")
        else:
            why = (f"never entered #{target.seq}" if target is not None and (snap.last is None or snap.last.seq <
                                                                              target.seq) else "not in a collective")
            culprits.append({"rank": rank, "phase": snap.phase, "step": snap.step, "why": why,
                             "location": info["location"], "last": entry_json(snap.last)})
            lines.append(f"{_describe_rank(rank, info)} since {_ago(now_ns, snap.phase_since_ns)}: {why}" +
                         (f"; its last collective was {snap.last.describe()}" if snap.last else ""))
    collective = entry_json(target)
    if culprits:
        first = culprits[0]
        where = f" at {first['location']}" if first.get("location") else ""
        if target is not None:
            headline = (f"rank {first['rank']} never entered collective {target.describe()}: it is in phase "
                        f"{_phase_text(ranks[first['rank']])}{where}; rank(s) "
                        f"{', '.join(str(w['rank']) for w in waiting)} wait for it")
        else:
            headline = (f"no rank is in a collective; rank {first['rank']} is in phase "
                        f"{_phase_text(ranks[first['rank']])}{where}")
        if first["why"] == "never reached phalanx.init()":
            headline = f"rank {first['rank']} never reached phalanx.init(){where}; the others wait at the rendezvous"
    elif elsewhere:
        headline = (f"every rank on this host waits in collective {target.describe()}; the missing rank is on "
                    f"another host (ranks {elsewhere[0]}..{elsewhere[-1]}): see that host's report")
    else:
        headline = (f"every rank waits in collective {target.describe() if target else '?'}, and it does not "
                    f"complete: the transport itself is stuck")
    return Verdict("stall", headline, lines, culprits, waiting, collective, ranks=ranks)
