"""DistributedSampler, single process (ranks simulated by passing rank/num_replicas): torch's order,
unpadded shards, resume at every offset, and the errors users see."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import DataConfigError, DistributedSampler, ResumeStateError, WorldConfigError

SETTINGS = settings(max_examples=150, deadline=None)

layouts = st.fixed_dictionaries({
    "n": st.integers(0, 50),
    "replicas": st.integers(1, 6),
    "seed": st.integers(-2**31, 2**31),
    "epoch": st.integers(0, 1000),
    "shuffle": st.booleans(),
    "drop_last": st.booleans(),
})


def shards(layout, **extra):
    """Every rank's sampler for the layout, epoch set."""
    samplers = [DistributedSampler(range(layout["n"]), layout["replicas"], rank, shuffle=layout["shuffle"],
                                   seed=layout["seed"], drop_last=layout["drop_last"], **extra)
                for rank in range(layout["replicas"])]
    for sampler in samplers:
        sampler.set_epoch(layout["epoch"])
    return samplers


def torch_shards(layout):
    samplers = [torch.utils.data.DistributedSampler(range(layout["n"]), layout["replicas"], rank,
                                                    shuffle=layout["shuffle"], seed=layout["seed"],
                                                    drop_last=layout["drop_last"])
                for rank in range(layout["replicas"])]
    for sampler in samplers:
        sampler.set_epoch(layout["epoch"])
    return samplers


@SETTINGS
@given(layouts)
def test_same_indices_and_length_as_torch(layout):
    for ours, theirs in zip(shards(layout), torch_shards(layout)):
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)
        assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


@SETTINGS
@given(layouts)
def test_unpadded_shards_cover_each_index_once_and_are_torch_shards_without_padding(layout):
    ours = shards(layout, pad=False)
    everything = sorted(i for sampler in ours for i in sampler)
    if layout["drop_last"]:  # nothing is padded then: pad=False changes nothing
        assert [list(s) for s in ours] == [list(s) for s in torch_shards(layout)]
        return
    assert everything == list(range(layout["n"]))
    lengths = [len(list(s)) for s in ours]
    assert lengths == [len(s) for s in ours]
    assert max(lengths) - min(lengths) <= 1
    for sampler, theirs in zip(ours, torch_shards(layout)):
        mine = list(sampler)
        assert mine == list(theirs)[:len(mine)]  # the same striding, minus the padded tail


@SETTINGS
@given(layouts, st.booleans())
def test_resume_at_every_offset_yields_exactly_the_rest(layout, pad):
    for rank, sampler in enumerate(shards(layout, pad=pad)):
        full = list(sampler)
        for k in range(len(full) + 1):
            it = iter(sampler)
            taken = [next(it) for _ in range(k)]
            state = sampler.state_dict()
            resumed = shards(layout, pad=pad)[rank]
            resumed.set_epoch(0)  # whatever epoch it had, the state restores the saved one
            resumed.load_state_dict(state)
            assert taken + list(resumed) == full
            assert list(resumed) == full  # the next pass is a whole epoch again


def test_state_is_primitives_and_survives_weights_only_load():
    sampler = DistributedSampler(range(17), num_replicas=3, rank=2, seed=5)
    sampler.set_epoch(4)
    it = iter(sampler)
    next(it), next(it)
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["epoch"] == 4 and state["consumed"] == 2
    resumed = DistributedSampler(range(17), num_replicas=3, rank=2, seed=5)
    resumed.load_state_dict(state)
    assert list(resumed) == sampler.epoch_indices()[2:]


def test_restored_position_is_kept_for_its_epoch_only():
    def fresh():
        return DistributedSampler(range(20), num_replicas=2, rank=1, seed=3)

    saved = fresh()
    saved.set_epoch(2)
    it = iter(saved)
    for _ in range(4):
        next(it)
    state = saved.state_dict()

    same_epoch = fresh()
    same_epoch.load_state_dict(state)
    same_epoch.set_epoch(2)
    assert list(same_epoch) == saved.epoch_indices()[4:]

    next_epoch = fresh()
    next_epoch.load_state_dict(state)
    next_epoch.set_epoch(3)
    expected = fresh()
    expected.set_epoch(3)
    assert list(next_epoch) == list(expected)
    assert next_epoch.state_dict()["consumed"] == len(expected)


def test_len_is_the_whole_epoch_after_a_resume():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    sampler.load_state_dict({"epoch": 0, "consumed": 3})
    assert len(sampler) == 5
    assert len(list(sampler)) == 2


def test_consumed_past_an_uneven_shard_means_the_epoch_is_done():
    short = DistributedSampler(range(5), num_replicas=2, rank=1, pad=False)  # shard [1, 3]
    short.load_state_dict({"epoch": 0, "consumed": 3})  # rank 0 had consumed 3 of [0, 2, 4]
    assert list(short) == []


def test_without_a_world_the_error_says_what_to_pass():
    with pytest.raises(WorldConfigError, match="num_replicas=1, rank=0"):
        DistributedSampler(range(4))


def test_without_phalanx_init_the_defaults_come_from_torch_distributed():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = DistributedSampler(range(4))
    finally:
        dist.destroy_process_group()
    assert (sampler.rank, sampler.num_replicas) == (0, 1)


@pytest.mark.parametrize("replicas, rank, named", [(2, 2, "rank=2"), (2, -1, "rank=-1"), (0, 0, "num_replicas=0"),
                                                   (2, 1.0, "rank=1.0")])
def test_bad_rank_or_world_is_a_value_error_naming_the_value(replicas, rank, named):
    with pytest.raises(DataConfigError, match=named) as info:
        DistributedSampler(range(4), num_replicas=replicas, rank=rank)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("key, value", [("dataset_len", 99), ("seed", 1), ("pad", False)])
def test_a_state_from_another_layout_is_refused(key, value):
    sampler = DistributedSampler(range(12), num_replicas=3, rank=0)
    state = {**sampler.state_dict(), key: value}
    with pytest.raises(ResumeStateError, match=key):
        sampler.load_state_dict(state)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 40), old=st.integers(1, 4), new=st.integers(1, 4), seed=st.integers(0, 5),
       data=st.data())
def test_a_state_from_another_world_size_is_resharded_over_the_rest_of_the_epoch(n, old, new, seed, data):
    # An elastic restart with another number of ranks: every old rank had consumed k samples (lockstep).
    k = data.draw(st.integers(0, -(-n // old)))
    saved = DistributedSampler(range(n), num_replicas=old, rank=0, seed=seed, pad=False)
    saved.set_epoch(2)
    state = {**saved.state_dict(), "consumed": k}
    rest = saved.global_order()[min(k * old, n):].tolist()
    resumed = []
    for rank in range(new):
        sampler = DistributedSampler(range(n), num_replicas=new, rank=rank, seed=seed, pad=False)
        sampler.load_state_dict(state)
        resumed.append(list(sampler))
        assert sampler.state_dict()["offset"] == (min(k * old, n) if old != new else 0)  # same world: no re-shard
    # The rest of the epoch, each sample exactly once, dealt out over the new ranks in order.
    assert sorted(i for shard in resumed for i in shard) == sorted(rest)
    assert [rest[r::new] for r in range(new)] == resumed
    # The next epoch has the normal layout again.
    sampler.set_epoch(3)
    assert list(sampler) == _fresh_epoch_indices(n, new, new - 1, seed, 3)


def _fresh_epoch_indices(n, replicas, rank, seed, epoch):
    sampler = DistributedSampler(range(n), num_replicas=replicas, rank=rank, seed=seed, pad=False)
    sampler.set_epoch(epoch)
    return sampler.epoch_indices()


def test_resharded_padded_shards_are_even():
    saved = DistributedSampler(range(11), num_replicas=2, rank=0)
    state = {**saved.state_dict(), "consumed": 2}  # 4 of 11 consumed by the old world
    shards = []
    for rank in range(3):
        sampler = DistributedSampler(range(11), num_replicas=3, rank=rank)
        sampler.load_state_dict(state)
        shards.append(list(sampler))
    assert [len(s) for s in shards] == [3, 3, 3]  # 7 left, padded to 9 as torch pads
    assert set(i for s in shards for i in s) == set(saved.global_order()[4:11].tolist())  # unpadded rest
