"""phalanx.DataLoader in one process: the resume contract at every batch for 2 and 3 ranks, simulated
(rank/num_replicas passed explicitly), without DataLoader workers.

The same contract with worker processes, and on spawned Gloo ranks whose samplers take rank and world
size from phalanx.init(), is in tests/ranks/test_loader.py.
"""

import pytest
import torch
import torch.utils.data

from phalanx import DataConfigError, DataLoader, DistributedSampler
from tests.helpers.loader_cases import (
    Squares,
    as_lists,
    assert_resume_contract,
    assert_resume_keeps_the_global_random_stream,
    make_loader,
    round_trip,
)


@pytest.mark.parametrize("num_workers", [0])  # with 2 workers: tests/ranks/test_loader.py
@pytest.mark.parametrize("replicas", [2, 3])
def test_resume_contract_at_every_batch_on_every_rank(replicas, num_workers):
    for rank in range(replicas):
        assert_resume_contract(rank, replicas, num_workers=num_workers)


@pytest.mark.parametrize("options", [
    {"pad": False},
    {"drop_last": True},
    {"batch_size": None},
], ids=["unpadded", "loader-drop-last", "no-batching"])  # persistent workers: tests/ranks/test_loader.py
def test_resume_contract_holds_for_loader_variants(options):
    for rank in range(3):
        assert_resume_contract(rank, 3, **options)


def test_resume_contract_with_a_batch_sampler():
    def loader_for(rank):
        dataset = Squares()
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=1)
        batches = torch.utils.data.BatchSampler(sampler, batch_size=4, drop_last=True)
        return DataLoader(dataset, batch_sampler=batches)

    for rank in range(2):
        reference = as_lists(loader_for(rank))
        for k in range(len(reference) + 1):
            interrupted = loader_for(rank)
            it = iter(interrupted)
            for _ in range(k):
                next(it)
            resumed = loader_for(rank)
            resumed.load_state_dict(round_trip(interrupted.state_dict()))
            assert as_lists(resumed) == reference[k:]


def test_skipped_batches_are_never_loaded():
    interrupted = make_loader(0, 2)
    it = iter(interrupted)
    next(it), next(it)
    state = interrupted.state_dict()
    resumed = make_loader(0, 2)
    resumed.load_state_dict(state)
    rest = as_lists(resumed)
    assert sorted(resumed.dataset.loaded) == sorted(row[0] for batch in rest for row in batch)


def test_position_follows_the_epoch():
    loader = make_loader(1, 3, epoch=2)
    it = iter(loader)
    next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (2, 1)
    loader.set_epoch(2)  # same epoch: keeps the position (a checkpoint now still resumes after batch 1)
    assert loader.state_dict()["batches"] == 1
    loader.set_epoch(3)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"], loader.state_dict()["consumed"]) == (3, 0, 0)


def test_restored_state_for_another_epoch_starts_that_epoch_from_the_top():
    saved = make_loader(0, 2, epoch=2)
    it = iter(saved)
    next(it)
    resumed = make_loader(0, 2, epoch=0)
    resumed.load_state_dict(saved.state_dict())
    resumed.set_epoch(3)
    assert as_lists(resumed) == as_lists(make_loader(0, 2, epoch=3))


def test_a_second_pass_is_a_whole_epoch_and_len_is_the_whole_epoch():
    saved = make_loader(0, 2)
    it = iter(saved)
    next(it)
    resumed = make_loader(0, 2)
    resumed.load_state_dict(saved.state_dict())
    whole = as_lists(make_loader(0, 2))
    assert len(resumed) == len(whole)
    assert len(as_lists(resumed)) == len(whole) - 1
    assert as_lists(resumed) == whole


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(7))


@pytest.mark.parametrize("dataset, options", [
    (Squares(), {"batch_size": 4}),
    (Squares(), {"batch_size": None}),
    (Counting(), {"batch_size": 3}),
], ids=["map", "no-batching", "iterable"])  # with workers: tests/ranks/test_loader.py
def test_a_drop_in_for_torchs_loader(dataset, options):
    ours, theirs = DataLoader(dataset, **options), torch.utils.data.DataLoader(dataset, **options)
    assert as_lists(ours) == as_lists(theirs)
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        assert len(ours) == len(theirs)


def test_state_needs_a_phalanx_sampler():
    loader = DataLoader(Squares(), batch_size=2, shuffle=True)
    with pytest.raises(DataConfigError, match="DistributedSampler"):
        loader.state_dict()


def test_set_epoch_also_reaches_a_torch_sampler():
    sampler = torch.utils.data.DistributedSampler(Squares(), num_replicas=2, rank=0)
    DataLoader(Squares(), sampler=sampler).set_epoch(5)
    assert sampler.epoch == 5


@pytest.mark.parametrize("workers", [0])  # with 2 workers: tests/ranks/test_loader.py
def test_a_resumed_pass_leaves_the_global_random_stream_as_the_uninterrupted_run_had_it(workers):
    assert_resume_keeps_the_global_random_stream(workers)
