"""Membership changes under `--nnodes MIN:MAX`: a node lost, a node joining, and what the user is told; and
under `--min-world-size` a rank lost while the others go on in-process (KeptSurvivors).

A node is lost when it misses its heartbeats (world/meeting/membership.py): the survivors stop their workers and
meet again at the smaller world; the workers resume from the newest checkpoint. A node waiting to join
makes every node ask its workers for the agreed stop (the one a SIGTERM asks for: they agree on a step,
save, exit 75), then the group meets again at the larger world: nothing is redone. Neither counts against
--max-restarts. The launcher says who left or joined, the new world size, the step it resumes from and
how long the change took; the run summary keeps the changes.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ..diagnose.recorder import pid_alive
from ..world.joining import JOIN_ENV
from ..world.meeting.membership import KEEP_ALIVE_INTERVAL, KEEP_ALIVE_MISSES, ElasticRendezvous
from .failures import signal_name

POLL = 0.5  # seconds between looks at the rendezvous state (lost nodes, waiting ones: a node joins within it)
NOTE_WAIT = 2.0  # seconds a regroup of the workers waits for this launcher to see its own lost rank gone


def all_exited(records: dict) -> bool:
    """Whether this node's workers (their progress records) have all ended their run."""
    return bool(records) and all(record.state == "exited" for record in records.values())


def _say(text: str) -> None:
    print(f"phalanx run: {text}", file=sys.stderr, flush=True)


class Regroup:
    """The agent's view of an elastic group. `poll()` and `failed()` answer whether to regroup now."""

    def __init__(self, rendezvous: ElasticRendezvous, grace_period: float, changes: list,
                 survivors: KeptSurvivors | None = None):
        self.rendezvous, self.grace_period = rendezvous, grace_period
        self.survivors = survivors  # --min-world-size: a lost node's ranks are lost, the others go on in-process
        self.growing_since: float | None = None  # the workers were asked to save for a node that joins
        self.changed_at: float | None = None  # a change began (node lost, growth asked): timed to the first step
        self.change = ""  # "node 1 (10.0.0.2) left" ...
        self.world_before = 0
        self.world = 0
        self.resume_reported = True
        self.changes = changes  # the run summary's list
        self.run_ended = False  # the rendezvous closed (the run finished elsewhere): no more rounds to meet
        self._next_look = self._next_probe = 0.0

    # -- a new worker group -------------------------------------------------------------------------

    def starting(self, worker_group) -> None:
        """Before the workers of a new round start: keys of their own in the store; say who is in. A round that
        takes this node into workers in progress (live join): its workers join theirs, with ranks never used."""
        spec = worker_group.spec
        self.world_before, self.world = self.world, worker_group.group_world_size * spec.local_world_size
        nodes = ", ".join(str(node) for node in self.rendezvous.current)
        left, joined = self.rendezvous.changes()
        me = f"this is node {worker_group.group_rank}"
        attempt = self.rendezvous.joining_attempt() if self.rendezvous.round > 0 else None
        os.environ.pop(JOIN_ENV, None)
        if attempt is not None:
            os.environ["PHALANX_STORE_ATTEMPT"], os.environ[JOIN_ENV] = attempt, "1"
            ranks = self.rendezvous.draw_ranks(attempt, len(worker_group.workers))
            for worker, rank in zip(sorted(worker_group.workers, key=lambda w: w.local_rank), ranks):
                worker.global_rank, worker.world_size = rank, ranks[-1] + 1
            _say(f"joining the workers in progress ({nodes}; {me}): ranks {ranks} are taken in at their next step "
                 f"boundary, with the state the ranks that train hand over (no checkpoint read).")
            self.change, self.resume_reported = "", True
            return
        os.environ["PHALANX_STORE_ATTEMPT"] = f"round-{self.rendezvous.round}"
        if not self.rendezvous.previous:
            _say(f"elastic group of {len(self.rendezvous.current)} node(s) ({nodes}): world size {self.world}; {me}.")
            return
        what = "; ".join([f"{node} left" for node in left] + [f"{node} joined" for node in joined]) or "regrouped"
        _say(f"{what}: {len(self.rendezvous.current)} node(s) now ({nodes}), world size {self.world_before} -> "
             f"{self.world}; {me}.")
        self.change = what
        self.resume_reported = False
        self.growing_since = None

    # -- while the workers run ----------------------------------------------------------------------

    def check_store(self) -> None:
        """About once a POLL: StoreLostError when the store's host no longer answers (before anything waits on it)."""
        now = time.monotonic()
        if now >= self._next_probe:
            self._next_probe = now + POLL
            self.rendezvous.probe()

    def poll(self, pids, records_of) -> str | None:
        """'lost' (regroup now: a node is gone), 'grown' (the workers saved for a joining node and left), else
        None. Asks the workers to stop when a node waits to join. `records_of()`: this node's progress records
        (a worker already stopping, asked by another node's workers, makes it look at once)."""
        records = records_of()
        if all_exited(records) or self.run_ended:
            # This node's workers are done: a node lost now is no reason to start them again, and a node that asked
            # to join as they finished (they were asked to save for it, and ended instead) has no run left to join.
            self.growing_since = None
            return None
        self._report_resume(records)
        stopping = any(record.stop_step >= 0 for record in records.values())
        if self.growing_since is not None:
            alive = [pid for pid in pids if pid_alive(pid)]
            if not alive or time.monotonic() > self.growing_since + self.grace_period:
                return "grown"
            return None
        now = time.monotonic()
        if now < self._next_look and not stopping:
            return None
        self._next_look = now + POLL
        if self.survivors is not None and self.rendezvous.join_decided():
            return "join"  # another launcher took the waiting node(s) in: meet them in its round
        lost = self.rendezvous.lost()
        if self.survivors is not None:
            lost = [node for node in lost if not self.survivors.node_lost(node, self.world, records)]
        if lost:
            self._lost(lost)
            return "lost"
        waiting = self.rendezvous.waiting()
        if waiting and self._taken_in_live(records):
            _say(f"{len(waiting)} node(s) waiting to join ({', '.join(waiting)}): the workers in progress take them in "
                 f"at a step boundary, in-process.")
            return "join"
        if waiting:
            self.growing_since = self.changed_at = now
            why = f" ({self.survivors.why_not})" if self.survivors is not None and self.survivors.why_not else ""
            _say(f"{len(waiting)} node(s) waiting to join ({', '.join(waiting)}): asking the workers to save at a "
                 f"step they agree on, then regrouping at the larger world{why}.")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        return None

    def _taken_in_live(self, records: dict) -> bool:
        """Whether the node(s) waiting join the workers in progress: every launcher follows the first one's answer,
        which is yes when its workers all said they take joiners in (live recovery, an unsharded optimizer)."""
        if self.survivors is None:  # live recovery off (on every node: the same command)
            return False
        attempt = os.environ.get("PHALANX_STORE_ATTEMPT")
        able = self.survivors.workers_join(records) and attempt is not None
        return self.rendezvous.decide_join(attempt if able else None) is not None

    def taken_in(self, worker_group) -> None:
        """The node(s) that waited met this one in a new round, and its workers take theirs in (the workers' own
        regroup, at their next agreed step): say who is in now."""
        self.world_before = self.world - (self.survivors.ranks_lost() if self.survivors is not None else 0)
        self.world = worker_group.group_world_size * worker_group.spec.local_world_size
        _, joined = self.rendezvous.changes()
        nodes = ", ".join(str(node) for node in self.rendezvous.current)
        _say(f"{', '.join(str(node) for node in joined) or 'a node'} joined in-process: {len(self.rendezvous.current)} "
             f"node(s) now ({nodes}), world size {self.world_before} -> {self.world}; this is node "
             f"{worker_group.group_rank}.")
        if self.survivors is not None:
            self.survivors.nodes.clear()  # the nodes lost before are out of the round: the world counts who is in

    def failed(self) -> bool:
        """The workers failed: was it a node lost (True: regroup, not a failure)? Waits until a silent node's
        heartbeats count as missed, so that a worker's own error is told apart from a peer node's death."""
        if self.growing_since is not None:
            return True  # asked to stop for the growth: a worker that did not listen died of the SIGTERM
        deadline = time.monotonic() + KEEP_ALIVE_INTERVAL * (KEEP_ALIVE_MISSES + 1)
        while True:
            lost = self.rendezvous.lost()
            if lost:
                self._lost(lost)
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)

    def _lost(self, lost) -> None:
        self.changed_at = time.monotonic()
        why = f" ({self.survivors.why_not})" if self.survivors is not None and self.survivors.why_not else ""
        _say(f"{', '.join(str(node) for node in lost)} lost (no heartbeat for {KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MISSES}"
             f" s): stopping this node's workers to regroup without it (not counted against --max-restarts){why}.")

    def _report_resume(self, records: dict) -> None:
        """Once the first step at the new world size is done: from which step, and how long the change took."""
        if self.resume_reported:
            return
        first = records.get(min(records)) if records else None
        if first is None or first.state == "exited":
            return
        restored = first.last("restored")
        if first.last_step_at <= first.loop_start or first.step <= first.first_step:
            return
        self.resume_reported = True
        resumed = restored["step"] if restored else first.first_step
        seconds = first.last_step_at - self.changed_at if self.changed_at is not None else None
        took = f"; {seconds:.1f} s from the change to the first step at world size {self.world}" if seconds else ""
        plan = first.last("plan")
        batches = f"; {plan['text']}" if plan and plan.get("text") else ""
        _say(f"resumed from step {resumed} at world size {self.world}{batches}{took}.")
        self.changes.append({"change": self.change, "world": [self.world_before, self.world], "step": resumed,
                             "seconds": round(seconds, 3) if seconds else None})
        self.changed_at = None



class KeptSurvivors:
    """`--min-world-size N` (live recovery, world/generation.py): a worker killed by a signal is lost, not a
    failure, while at least N ranks are left. Its peers are not touched: they notice the loss themselves (the
    shared-memory exchange or Gloo sees it gone), agree on the ranks left, and go on in-process. The launcher
    says so, keeps the others running, and times the change to the next step the ranks left make (the run
    summary keeps it). A worker that fails otherwise (an exception: a bug that would recur) fails the group
    as before."""

    def __init__(self, min_world_size: int, changes: list):
        self.min_world_size, self.changes = min_world_size, changes
        self.local_world_size = 1  # set by the agent: ranks per node
        self.why_not = ""  # why the last loss could not be kept in-process (workers_recover)
        self.new_attempt()

    def new_attempt(self) -> None:
        """A new worker group (a restart, a regroup at another world size): every rank and node is in again."""
        self.lost: dict[int, int] = {}  # global rank -> exit code (minus the signal), this attempt
        self.nodes: dict[tuple, int] = {}  # (address, pid) of each node lost this attempt -> its ranks
        self._timing: tuple[float, int, dict] | None = None  # (when, survivors' step then, its note) to time
        self._notes: dict[int, dict] = {}  # a rank of this node lost: how, and the seconds to the next step
        self._regroups_told = 0  # the workers' regroups (their "generation" events) made into the summary's changes
        self._nodes_said: set[int] = set()  # fixed --nnodes: nodes said to be left behind at the end

    def workers_recover(self, records: dict) -> bool:
        """Whether this node's running workers recover a loss in-process: each one's loop said so (a global-batch
        loader under live recovery, world/generation.py say_mode). Else a loss fails the group, as without
        --min-world-size, and `why_not` says why."""
        running = {rank: record for rank, record in records.items() if record.state != "exited"}
        modes = {rank: (record.last("recovery") or {}).get("live") for rank, record in running.items()}
        off = sorted(rank for rank, live in modes.items() if live is False)
        unsaid = sorted(rank for rank, live in modes.items() if live is None)
        if not running:
            self.why_not = "no worker of this node is running"
        elif off:
            self.why_not = f"the loop of rank(s) {off} cannot regroup in-process (no global batch)"
        elif unsaid:
            self.why_not = f"rank(s) {unsaid} had not reached a global-batch loop"
        else:
            self.why_not = ""
        return not self.why_not

    def monitor(self, pcontext, worker_group, records: dict):
        """The group's state while ranks may be lost: None to let torch judge (nothing lost, or a survivor
        failed), else HEALTHY while survivors run, SUCCEEDED once they all exited 0."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        handlers = getattr(pcontext, "subprocess_handlers", None) or {}
        codes = {worker_group.workers[local].global_rank: handler.proc.poll() for local, handler in handlers.items()}
        for rank, code in sorted(codes.items()):
            if code is not None and code < 0 and rank not in self.lost:
                self._note(rank, code, worker_group.workers[0].world_size, codes, records)
        self._time_the_change(records)
        self.tell_the_regroups(records)
        if not self.lost:
            return None
        others = [code for rank, code in codes.items() if rank not in self.lost]
        if any(code not in (None, 0) for code in others):
            return None  # a survivor failed: torch's verdict (a failure, a restart under --max-restarts)
        if any(code is None for code in others):
            return RunResult(state=WorkerState.HEALTHY)
        return RunResult(state=WorkerState.SUCCEEDED, return_values={rank: None for rank in codes})

    def workers_join(self, records: dict) -> bool:
        """Whether this node's running workers take a joining node's ranks in at a step boundary (world/joining.py):
        each recovers in-process and said it takes joiners in (its loop reached checkpointer.step(), and nothing in
        it refused: a sharded model with its shard copies off)."""
        if not self.workers_recover(records):
            return False
        running = [record for record in records.values() if record.state != "exited"]
        said = {record.rank: record.last("joins") or {} for record in running}
        refused = [event["why"] for event in said.values() if event and not event.get("taken")]
        unsaid = sorted(rank for rank, event in said.items() if not event)
        self.why_not = (refused[0] if refused else
                        f"rank(s) {unsaid} had not reached checkpointer.step(), where joiners are taken in" if unsaid
                        else "")
        return not self.why_not

    def ranks_lost(self) -> int:
        return len(self.lost) + sum(self.nodes.values())

    def node_lost(self, node, world_size: int, records: dict | None) -> bool:
        """A node missed its heartbeats: True when its ranks count as lost and the others go on (said once).
        `records`: this node's workers' (None: they are done, and only the count of nodes left matters)."""
        key = (node.addr, node.pid)
        if key in self.nodes:
            return True
        if records is not None and all_exited(records):
            records = None  # this node's workers are done (the others finished first): only the count matters
        left = world_size - self.ranks_lost() - self.local_world_size
        if left < self.min_world_size:  # the elastic regroup from the newest checkpoint, as before
            self.why_not = f"{left} rank(s) would be left, fewer than --min-world-size {self.min_world_size}"
            return False
        if records is not None and not self.workers_recover(records):
            return False  # a loop that cannot regroup in-process: the elastic regroup, as before
        self.nodes[key] = self.local_world_size
        _say(f"{node} lost (no heartbeat for {KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MISSES} s): its ranks are lost, the "
             f"{left} ranks left go on in-process (--min-world-size {self.min_world_size}).")
        return True

    def exit_barrier_size(self, nodes: int, records: dict | None = None) -> int:
        """How many nodes' launchers meet at the end: those not lost. `records` (a fixed --nnodes N, which has no
        heartbeats): this node's workers', whose last regroup says which nodes' ranks all left."""
        gone = self._nodes_left_behind(nodes, records) if records is not None else 0
        return nodes - max(len(self.nodes), gone)

    def _nodes_left_behind(self, nodes: int, records: dict) -> int:
        """The nodes none of whose ranks (node k: ranks k x local world size onwards) are in the last generation
        the workers regrouped into (said once for each)."""
        regroups = [event for record in records.values() for event in record.events
                    if event.get("event") == "generation"]
        if not regroups:
            return 0
        members, per = set(max(regroups, key=lambda event: event["number"])["members"]), self.local_world_size
        gone = [node for node in range(nodes) if not members & set(range(node * per, (node + 1) * per))]
        for node in gone:
            if node not in self._nodes_said:
                self._nodes_said.add(node)
                _say(f"node {node} is not waited for at the end: its ranks {list(range(node * per, (node + 1) * per))}"
                     f" were lost, and the ranks left went on without them.")
        return len(gone)

    def _note(self, rank: int, code: int, world_size: int, codes: dict, records: dict) -> None:
        left = world_size - self.ranks_lost() - 1
        if left < self.min_world_size:
            return  # too few would be left: the group fails (and restarts under --max-restarts) as before
        if not self.workers_recover({k: r for k, r in records.items() if k != rank and k not in self.lost}):
            return  # the others' loop cannot regroup in-process: the group fails, as before
        self.lost[rank] = code
        how = signal_name(code)
        _say(f"rank {rank} was lost ({how}): the {left} ranks left go on in-process, from the step in flight "
             f"(--min-world-size {self.min_world_size}).")
        steps = [r.step for k, r in records.items() if k not in self.lost and codes.get(k) is None]
        note = self._notes[rank] = {"how": how, "seconds": None}
        self._timing = (time.monotonic(), min(steps) if steps else 0, note)

    def _time_the_change(self, records: dict) -> None:
        """Once every rank left has made a step past the one in flight at the loss: how long that took."""
        if self._timing is None:
            return
        since, step, note = self._timing
        alive = [r for k, r in records.items() if k not in self.lost and r.state != "exited"]
        if alive and all(r.step > step for r in alive):
            note["seconds"] = round(max(r.last_step_at for r in alive) - since, 3)
            if "change" in note:
                note["change"]["seconds"] = note["seconds"]
            _say(f"the {len(alive)} ranks left made step {step + 1} {note['seconds']:.2f} s after the loss.")
            self._timing = None

    def tell_the_regroups(self, records: dict) -> None:
        """Each regroup of the workers (their "generation" events: the same on every node) becomes a change of the
        run summary: who was lost, the world sizes, the last step applied, the regroup's time, the step redone;
        for a rank of this node, also how it was lost and the seconds to the next step."""
        record = next((r for k, r in sorted(records.items()) if k not in self.lost), None)
        if record is None:
            return
        regroups = [event for event in record.events if event.get("event") == "generation"]
        for event in regroups[self._regroups_told:]:
            lost, members = event.get("lost", []), event.get("members", [])
            if event.get("joined"):
                self._regroups_told += 1
                self.changes.append(self._joined(event))
                continue
            unnoted = [rank for rank in lost if rank in records and rank not in self._notes]
            if unnoted and time.monotonic() < event.get("at", 0) + NOTE_WAIT:
                return  # a rank of this node: its workers may regroup before this launcher sees it gone
            self._regroups_told += 1
            notes = [self._notes[rank] for rank in lost if rank in self._notes]
            named = (", ".join(f"rank {rank} lost ({self._notes[rank]['how']})" for rank in lost)
                     if len(notes) == len(lost) else f"rank(s) {lost} lost")
            change = {"change": f"{named}, kept in-process", "world": [len(members) + len(lost), len(members)],
                      "step": event.get("step"), "seconds": notes[0]["seconds"] if len(notes) == 1 else None,
                      "regroup_seconds": event.get("seconds"),
                      "redone": event.get("step") if event.get("redone") else None}
            for note in notes:
                note["change"] = change
            self.changes.append(change)

    @staticmethod
    def _joined(event: dict) -> dict:
        """A regroup that took ranks in (world/joining.py), as a change of the run summary."""
        joined, members = event["joined"], event.get("members", [])
        size, seconds = event.get("healed") or (0, 0.0)
        return {"change": f"rank(s) {joined} joined in-process", "world": [len(members) - len(joined), len(members)],
                "step": event.get("step"), "seconds": None, "regroup_seconds": event.get("seconds"),
                "healed": [size, seconds], "redone": None}
