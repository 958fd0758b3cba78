"""DataLoader(global_batch_size=B) in one process (world size 1; 2-5 ranks simulated by passing rank and
num_replicas): the plan's arithmetic and weights, the typed errors, the state across world sizes, and
training with simulated ranks (gradients averaged by hand, as DDP does) against one process on whole batches.

The same with real Gloo ranks, phalanx's and torch's DDP, and Checkpointer resumes: tests/ranks/test_global_batch.py.
"""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

from phalanx import DataConfigError, DataLoader, DistributedSampler, ResumeStateError
from phalanx.data.global_plan import GlobalBatchPlan, entries_before
from phalanx.diagnose import progress
from tests.helpers.global_batch_cases import (
    EPOCHS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    SIZE,
    Indexed,
    epoch_order,
    make_model,
    make_optimizer,
    parameters,
    reference_run,
)
from tests.helpers.loader_cases import round_trip


def loaders(world, *, dataset=None, global_batch=GLOBAL_BATCH, micro=MICRO_BATCH, **options):
    dataset = Indexed() if dataset is None else dataset
    return [DataLoader(dataset, batch_size=micro, global_batch_size=global_batch,
                       sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, seed=SEED), **options)
            for rank in range(world)]


def step_ids(steps):
    """{step index: sorted ids that weighed in} over the simulated ranks' GlobalSteps of one step."""
    ids = []
    for step in steps:
        for index, _, _ in step.micro_batches():
            if step.weight:
                ids += index.tolist()
    return sorted(ids)


def epoch_steps(rank_loaders, epoch):
    for loader in rank_loaders:
        loader.set_epoch(epoch)
    return zip(*rank_loaders)


# -- the plan ----------------------------------------------------------------------------------------

def test_the_plan_names_ranks_micro_batches_and_their_size():
    plan = GlobalBatchPlan.build(global_batch_size=64, micro_batch_size=16, world_size=2, dataset_len=640)
    assert str(plan) == "global batch 64 = 2 ranks x 2 micro-batches x 16"
    assert (plan.world_size, plan.micro_batch_size, plan.micro_batches_per_rank, plan.global_batch_size) == \
        (2, 16, 2, 64)
    uneven = GlobalBatchPlan.build(global_batch_size=64, micro_batch_size=16, world_size=3, dataset_len=650)
    assert str(uneven).startswith("global batch 64 = 3 ranks x 2 micro-batches of at most 11 (21 or 22 samples")
    assert str(uneven).endswith("the epoch's last step averages its 10 samples")


PLANS = [(world, global_batch, micro, size) for world in (1, 2, 3, 4, 5)
         for global_batch, micro, size in [(26, 4, 80), (64, 16, 650), (7, 1, 30), (12, 2, 12), (12, 3, 11)]
         if micro <= -(-global_batch // world)]  # a larger micro-batch is an error: test_the_errors_name_values_and_fix


@pytest.mark.parametrize("world, global_batch, micro, size", PLANS)
def test_each_step_splits_its_global_entries_over_the_ranks_with_weights_that_make_the_mean(
        world, global_batch, micro, size):
    plan = GlobalBatchPlan.build(global_batch_size=global_batch, micro_batch_size=micro, world_size=world,
                                 dataset_len=size)
    for step in range(plan.steps_per_epoch):
        layouts = [plan.step(step, rank) for rank in range(world)]
        samples = min(global_batch, size - step * global_batch)
        assert {len(layout.sizes) for layout in layouts} == {plan.micro_batches(step)}  # the same on every rank
        assert sum(sum(layout.sizes) for layout in layouts) == samples
        for rank, layout in enumerate(layouts):
            assert all(size <= micro for size in layout.sizes)
            assert layout.weights == tuple(world * m / samples for m in layout.sizes)
            first = plan.consumed_before(step, rank)
            assert first + sum(layout.sizes) == plan.consumed_before(step + 1, rank)
        # the mean over the step's samples: DDP's average over ranks of the weighted micro-batch means
        assert sum(w for layout in layouts for w in layout.weights) == pytest.approx(world)
    assert plan.micro_batches_per_rank == plan.micro_batches(0)
    assert plan.micro_batches_per_epoch() == sum(plan.micro_batches(s) for s in range(plan.steps_per_epoch))


def test_entries_before_counts_the_rank_strided_shard():
    for world in range(1, 6):
        for stop in range(0, 20):
            assert [entries_before(stop, r, world) for r in range(world)] == \
                [len(range(r, stop, world)) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_step_is_the_same_samples_at_every_world_size_and_every_sample_is_used_once(world):
    _, expected = reference_run()
    rank_loaders = loaders(world)
    assert {len(loader) for loader in rank_loaders} == {4}
    seen = {}
    for epoch in range(EPOCHS):
        for index, steps in enumerate(epoch_steps(rank_loaders, epoch)):
            assert {step.index for step in steps} == {index}
            seen[(epoch, index)] = step_ids(steps)
    assert seen == expected
    for epoch in range(EPOCHS):
        used = [i for (e, _), ids in seen.items() if e == epoch for i in ids]
        assert sorted(used) == list(range(SIZE))


def test_torchs_set_epoch_idiom_reaches_the_sampler():
    rank_loaders = loaders(2)
    for loader in rank_loaders:
        assert isinstance(loader.sampler, DistributedSampler)
        loader.sampler.set_epoch(1)
    _, expected = reference_run()
    seen = {(1, steps[0].index): step_ids(steps) for steps in zip(*rank_loaders)}
    assert seen == {key: ids for key, ids in expected.items() if key[0] == 1}


def test_drop_last_drops_the_epochs_last_partial_global_batch():
    rank_loaders = loaders(3, drop_last=True)
    assert len(rank_loaders[0]) == SIZE // GLOBAL_BATCH
    seen = {index: step_ids(steps) for index, steps in enumerate(epoch_steps(rank_loaders, 0))}
    order = epoch_order(0)
    assert seen == {s: sorted(order[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]) for s in range(SIZE // GLOBAL_BATCH)}
    assert "the epoch's last 2 samples are dropped" in str(rank_loaders[0].plan)


# -- training with simulated ranks -----------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_simulated_ranks_train_as_one_process_on_whole_batches(world):
    """The weights end to end: each simulated rank's weighted micro-batch losses, its gradient averaged over
    the ranks by hand (DDP's average), against one process that takes each step's mean loss at once."""
    expected, _ = reference_run()
    model = make_model()
    optimizer = make_optimizer(model)
    rank_loaders = loaders(world)
    for epoch in range(EPOCHS):
        for steps in epoch_steps(rank_loaders, epoch):
            grads, losses = [], []
            for step in steps:
                optimizer.zero_grad()
                for _, x, y in step.micro_batches(model if world == 1 else None):
                    step.backward(F.mse_loss(model(x), y))
                grads.append([p.grad.clone() for p in model.parameters()])
                losses.append(step.loss)
            for p, *per_rank in zip(model.parameters(), *grads):
                p.grad = torch.stack(per_rank).mean(0)
            optimizer.step()
    for ours, theirs in zip(parameters(model), expected):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_the_loss_parts_of_the_ranks_sum_to_the_steps_mean_loss():
    model, data = make_model(), Indexed()
    steps = next(epoch_steps(loaders(3), 0))
    for step in steps:
        for _, x, y in step.micro_batches():
            step.backward(F.mse_loss(model(x), y))
    ids = epoch_order(0)[:GLOBAL_BATCH]
    whole = F.mse_loss(model(data.x[ids]), data.y[ids])
    torch.testing.assert_close(sum(step.loss for step in steps), whole.detach())


def test_a_plain_model_on_several_ranks_and_misuse_of_a_step_are_typed_errors():
    step = next(iter(loaders(2)[0]))
    with pytest.raises(DataConfigError, match=r"\[rank 0\].*Linear without no_sync\(\) on 2 ranks.*wrapped model"):
        next(step.micro_batches(torch.nn.Linear(4, 1)))
    step = next(iter(loaders(2)[1]))
    with pytest.raises(DataConfigError, match="outside step.micro_batches"):
        step.backward(torch.ones((), requires_grad=True))
    for _ in step.micro_batches():
        pass
    with pytest.raises(DataConfigError, match="micro_batches\\(\\) was called twice for step 0"):
        next(step.micro_batches())


def test_a_step_left_unfinished_is_skipped_and_counts_as_done():
    loader = loaders(1)[0]
    it = iter(loader)
    next(it)
    assert loader.state_dict()["steps"] == 0
    second = next(it)  # the first step's micro-batches were never taken: skipped
    assert second.index == 1 and loader.state_dict()["steps"] == 1
    ids = [i for index, _, _ in second.micro_batches() for i in index.tolist()]
    assert sorted(ids) == sorted(epoch_order(0)[GLOBAL_BATCH:2 * GLOBAL_BATCH])
    assert loader.state_dict()["steps"] == 2


# -- errors ------------------------------------------------------------------------------------------

def test_the_errors_name_values_and_fix():
    data = Indexed()

    def sampler(world=2, **options):
        return DistributedSampler(data, num_replicas=world, rank=0, **options)

    cases = [
        (dict(batch_size=4, global_batch_size=26), r"needs a phalanx.DistributedSampler.*sampler=None"),
        (dict(batch_size=4, global_batch_size=26, sampler=torch.utils.data.SequentialSampler(data)),
         r"sampler=SequentialSampler.*Pass sampler=phalanx.DistributedSampler"),
        (dict(global_batch_size=26, sampler=sampler()), r"needs batch_size, the micro-batch.*Pass batch_size="),
        (dict(batch_size=None, global_batch_size=26, sampler=sampler()), r"batch_size=None.*an int >= 1"),
        (dict(batch_size=16, global_batch_size=26, sampler=sampler()),
         r"\[rank 0\] DataLoader batch_size is larger than a rank's share of the global batch: seen batch_size=16, "
         r"global_batch_size=26 over 2 ranks = 13 samples per rank, expected batch_size <= 13.*micro-batch"),
        (dict(batch_size=1, global_batch_size=3, sampler=sampler(4)),
         r"global_batch_size=3 over 4 ranks.*expected global_batch_size >= 4"),
        (dict(batch_size=4, global_batch_size=0, sampler=sampler()), r"global_batch_size=0.*an int >= 1"),
        (dict(batch_size=4, global_batch_size=26, sampler=sampler(drop_last=True)),
         r"DistributedSampler\(drop_last=True\).*Pass drop_last=True to the DataLoader instead"),
        (dict(batch_size=4, global_batch_size=26, sampler=sampler(), shuffle=True), r"shuffle=True.*Drop shuffle="),
        (dict(batch_sampler=torch.utils.data.BatchSampler(sampler(), 4, False), global_batch_size=26),
         r"batch_sampler=BatchSampler"),
    ]
    for options, message in cases:
        with pytest.raises(DataConfigError, match=message):
            DataLoader(data, **options)


# -- state across world sizes ------------------------------------------------------------------------

@pytest.mark.parametrize("saved_world", [1, 2, 3, 4])
def test_a_state_saved_at_one_world_size_resumes_the_next_step_at_any_other(saved_world):
    _, expected = reference_run(epochs=1)
    for done in range(len(expected) + 1):
        rank_loaders = loaders(saved_world)
        iterators = [iter(loader) for loader in rank_loaders]
        for _ in range(done):
            step_ids([next(it) for it in iterators])
        states = [round_trip(loader.state_dict()) for loader in rank_loaders]
        plain = [{k: v for k, v in state.items() if k != "seed_state"} for state in states]
        assert all(state == plain[0] for state in plain[1:]), "the state is the same on every rank"
        assert (states[0]["steps"], states[0]["samples"]) == (done, min(done * GLOBAL_BATCH, SIZE))
        for world in (1, 2, 3, 4):
            resumed = loaders(world)
            for loader in resumed:
                loader.load_state_dict(states[0])
            seen = {index: step_ids(steps) for index, steps in enumerate(epoch_steps(resumed, 0), start=done)}
            assert seen == {s: ids for (_, s), ids in expected.items() if s >= done}, (saved_world, done, world)
            if done < len(expected):  # saved again after a resumed step: a chain of world sizes works too
                chained = resumed[0].state_dict()
                assert chained["steps"] == len(expected) and chained["num_replicas"] == world


def test_a_resumed_loader_starts_the_next_epoch_whole():
    rank_loaders = loaders(4)
    first = iter(rank_loaders[0])
    step_ids([next(first)])
    resumed = loaders(3)
    for loader in resumed:
        loader.load_state_dict(round_trip(rank_loaders[0].state_dict()))
    list(zip(*resumed))
    seen = {index: step_ids(steps) for index, steps in enumerate(epoch_steps(resumed, 1))}
    _, expected = reference_run()
    assert seen == {s: ids for (e, s), ids in expected.items() if e == 1}


def test_a_state_of_another_global_batch_or_a_plain_loader_is_refused():
    state = loaders(2)[0].state_dict()
    with pytest.raises(ResumeStateError, match=r"global_batch_size=26 in the state.*global_batch_size=24"):
        loaders(2, global_batch=24)[0].load_state_dict(state)
    plain = DataLoader(Indexed(), batch_size=4, sampler=DistributedSampler(Indexed(), num_replicas=2, rank=0))
    with pytest.raises(ResumeStateError, match=r"global_batch_size=None as in this run"):
        plain.load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"global_batch_size=None in the state"):
        loaders(2)[0].load_state_dict(plain.state_dict())
    with pytest.raises(ResumeStateError, match="another seed"):
        loaders(2)[0].load_state_dict({**state, "seed": 99})


class Recorder(torch.nn.Module):
    """Notes, for each micro-batch handed out, whether gradient sync was off (no_sync, or FSDP2's switch)."""

    def __init__(self, fsdp_style=False):
        super().__init__()
        self.sync = True
        self.seen = []
        if fsdp_style:
            self.set_requires_gradient_sync = lambda on: setattr(self, "sync", on)
        else:
            self.no_sync = self._no_sync

    @contextlib.contextmanager
    def _no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


@pytest.mark.parametrize("fsdp_style", [False, True], ids=["no_sync", "set_requires_gradient_sync"])
def test_all_micro_batches_but_the_last_run_without_gradient_sync(fsdp_style):
    """World size 1 (2 ranks simulated): 4 micro-batches per step, the last one synchronized."""
    model = Recorder(fsdp_style)
    step = next(iter(loaders(2)[0]))
    for _ in step.micro_batches(model):
        model.seen.append(model.sync)
    assert model.seen == [False, False, False, True] and model.sync


def test_the_plan_is_logged_once_by_rank_0_and_recorded_for_the_launcher(tmp_path, caplog):
    progress.start(str(tmp_path), 0)
    try:
        with caplog.at_level(logging.INFO, logger="phalanx"):
            loaders(2)
    finally:
        progress._record = None
    logged = [r.getMessage() for r in caplog.records if "global batch" in r.getMessage()]
    assert logged == [str(loaders(2)[0].plan)]  # rank 0's, once
    (record,) = progress.read(str(tmp_path)).values()
    events = [e for e in record.events if e["event"] == "plan"]
    assert events[0] == {"event": "plan", "world_size": 2, "micro_batch_size": MICRO_BATCH,
                         "micro_batches_per_rank": 4, "global_batch_size": GLOBAL_BATCH, "steps_per_epoch": 4,
                         "text": logged[0]}
    assert record.last("plan") == events[-1]


# -- a live re-split: DataLoader.regroup --------------------------------------------------------------

@pytest.mark.parametrize("before, after", [(3, 2), (4, 1), (2, 3)], ids=["3-to-2", "4-to-1", "2-to-3"])
def test_regroup_re_splits_the_pass_in_progress_from_the_step_in_flight(before, after):
    """`before` simulated ranks take steps 0 and 1 and the first micro-batch of step 2 (its loss counted);
    then the world becomes `after` ranks: the first of them regroup their loaders in place, a rank that
    joins loads their position. Step 2 starts its micro-batch loop over on the new split (its loss
    back at zero) and every step of the epoch averages the reference's samples, each sample once."""
    _, expected = reference_run(epochs=1)
    model = make_model()
    rank_loaders = loaders(before)
    iterators = [iter(loader) for loader in rank_loaders]
    seen = {index: step_ids([next(it) for it in iterators]) for index in range(2)}
    in_flight = [next(it) for it in iterators]
    loops = [step.micro_batches() for step in in_flight]
    for step, loop in zip(in_flight, loops):
        _, x, y = next(loop)
        step.backward(F.mse_loss(model(x), y))
    kept = min(before, after)
    for rank in range(kept):
        rank_loaders[rank].regroup(rank, after)
    joined = loaders(after)[kept:]
    for loader in joined:  # a new rank takes the position from the ranks it joins (their state, not a file)
        loader.load_state_dict(round_trip(rank_loaders[0].state_dict()))
    plan = GlobalBatchPlan.build(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, world_size=after,
                                 dataset_len=SIZE)
    ids = []
    for rank, (step, loop) in enumerate(zip(in_flight[:kept], loops[:kept])):
        offset = rank_loaders[rank].sampler.offset  # step 2's first entry: the rest of the epoch is re-dealt
        assert offset == 2 * GLOBAL_BATCH
        assert (step.index, step.sizes, step.loss) == (2, plan.step(2, rank, offset).sizes, 0.0), rank
        ids += [i for index, _, _ in loop if step.weight for i in index.tolist()]
    joined_iterators = [iter(loader) for loader in joined]
    joined_steps = [next(it) for it in joined_iterators]
    assert [step.index for step in joined_steps] == [2] * len(joined)
    seen[2] = sorted(ids + step_ids(joined_steps))
    live = iterators[:kept] + joined_iterators
    for index in range(3, len(expected)):
        seen[index] = step_ids([next(it) for it in live])
    for it in live:
        with pytest.raises(StopIteration):
            next(it)
    assert seen == {step: ids for (_, step), ids in expected.items()}
    assert rank_loaders[0].state_dict()["num_replicas"] == after and rank_loaders[0].plan.world_size == after


def test_regroup_refuses_what_it_cannot_re_split_exactly():
    plain = DataLoader(Indexed(), batch_size=MICRO_BATCH,
                       sampler=DistributedSampler(Indexed(), num_replicas=2, rank=0, seed=SEED))
    with pytest.raises(DataConfigError, match="needs a global batch"):
        plain.regroup(0, 1)
    loader = loaders(2)[0]
    with pytest.raises(DataConfigError, match="rank outside the world"):
        loader.regroup(2, 2)
    steps = iter(loader)  # the pass under way: `for step in loader` holds it as this does
    next(next(steps).micro_batches())
    with pytest.raises(DataConfigError, match="another step than the one in flight"):
        loader.regroup(0, 1, step=1)
