"""phalanx.DataLoader: the resume contract at every batch for 2 and 3 ranks, with 0 and 2 workers.

Unit tests simulate ranks in one process (rank/num_replicas passed explicitly); TestRealRanks runs
the same contract on spawned Gloo ranks whose samplers take rank and world size from phalanx.init().
"""

import io

import pytest
import torch
import torch.utils.data

from phalanx import DataConfigError, DataLoader, DistributedSampler
from phalanx.testing import run_ranks

SIZE = 23  # not a multiple of 2, 3 or the batch sizes: padding, short shards and short last batches occur


class Squares(torch.utils.data.Dataset):
    """Item i is (i, i*i); remembers which items this process loaded."""

    def __init__(self, size=SIZE):
        self.size = size
        self.loaded = []

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.loaded.append(index)
        return torch.tensor([index, index * index])


def make_loader(rank, replicas, *, pad=True, epoch=3, num_workers=0, batch_size=3, drop_last=False, seed=7,
                **kwargs):
    dataset = Squares()
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, seed=seed, pad=pad)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        drop_last=drop_last, **kwargs)
    loader.set_epoch(epoch)
    return loader


def round_trip(state):
    """What a checkpoint does to the state: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def as_lists(batches):
    return [batch.tolist() for batch in batches]


def assert_resume_contract(rank, replicas, **options):
    """For every k: a loader restored from the state after k batches yields exactly batches k+1, ..."""
    epoch = options.pop("epoch", 3)
    reference = as_lists(make_loader(rank, replicas, epoch=epoch, **options))
    assert reference, "the test needs at least one batch"
    for k in range(len(reference) + 1):
        interrupted = make_loader(rank, replicas, epoch=epoch, **options)
        it = iter(interrupted)
        seen = [next(it).tolist() for _ in range(k)]
        state = round_trip(interrupted.state_dict())
        del it  # the interrupted run ends here (workers and all)
        resumed = make_loader(rank, replicas, epoch=0, **options)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)  # the training loop's call at the top of the resumed epoch
        assert seen + as_lists(resumed) == reference, f"rank {rank}/{replicas}, resumed after {k} batches"


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("replicas", [2, 3])
def test_resume_contract_at_every_batch_on_every_rank(replicas, num_workers):
    for rank in range(replicas):
        assert_resume_contract(rank, replicas, num_workers=num_workers)


@pytest.mark.parametrize("options", [
    {"pad": False},
    {"drop_last": True},
    {"batch_size": None},
    {"pad": False, "num_workers": 2, "persistent_workers": True, "prefetch_factor": 3},
], ids=["unpadded", "loader-drop-last", "no-batching", "persistent-workers"])
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


def test_prefetched_batches_do_not_count_as_consumed():
    loader = make_loader(0, 2, num_workers=2, batch_size=2, prefetch_factor=2)
    it = iter(loader)
    next(it)
    assert loader.sampler.state_dict()["consumed"] > 2  # the workers were handed more than one batch
    assert (loader.state_dict()["batches"], loader.state_dict()["consumed"]) == (1, 2)


def test_position_follows_the_epoch():
    loader = make_loader(1, 3, epoch=2)
    it = iter(loader)
    next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"]) == (2, 1)
    loader.set_epoch(2)  # same epoch: keeps the position (a checkpoint now still resumes after batch 1)
    assert loader.state_dict()["batches"] == 1
    loader.set_epoch(3)
    assert (loader.state_dict()["epoch"], loader.state_dict()["batches"], loader.state_dict()["consumed"]) == (3, 0, 0)


def test_a_pass_broken_off_with_persistent_workers_does_not_leak_into_the_next():
    loader = make_loader(0, 2, num_workers=2, persistent_workers=True, batch_size=2)
    whole = as_lists(make_loader(0, 2, batch_size=2))
    for _, _ in zip(loader, range(2)):  # break off after two batches, workers keep prefetched ones
        pass
    it = iter(loader)
    assert next(it).tolist() == whole[0]
    assert (loader.state_dict()["batches"], loader.state_dict()["consumed"]) == (1, 2)
    assert [next(it).tolist() for _ in range(len(whole) - 1)] == whole[1:]


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
    (Squares(), {"batch_size": 4, "drop_last": True, "num_workers": 2}),
    (Squares(), {"batch_size": None}),
    (Counting(), {"batch_size": 3}),
], ids=["map", "map-workers", "no-batching", "iterable"])
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


# -- real ranks ------------------------------------------------------------------------------------

def resume_on_this_rank(rank, state_dir):
    """On a spawned rank: the contract for every k, with the world's own rank and size, 0 and 2 workers."""
    results = {}
    for num_workers in (0, 2):
        def loader(num_workers=num_workers):
            dataset = Squares()
            # fork, as under torchrun: a rank started by spawn would otherwise spawn its workers too
            # (each re-imports torch, seconds apiece on a loaded machine)
            return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, seed=11),
                              num_workers=num_workers, multiprocessing_context="fork" if num_workers else None)

        reference = loader()
        reference.set_epoch(1)
        reference = as_lists(reference)
        for k in range(len(reference) + 1):
            interrupted = loader()
            interrupted.set_epoch(1)
            it = iter(interrupted)
            for _ in range(k):
                next(it)
            path = f"{state_dir}/rank{rank}-{num_workers}-{k}.pt"
            torch.save(interrupted.state_dict(), path)
            del it
            resumed = loader()
            resumed.load_state_dict(torch.load(path, weights_only=True))
            resumed.set_epoch(1)
            results[(num_workers, k)] = (reference[:k] + as_lists(resumed), reference)
    return results


class TestRealRanks:
    def test_resume_contract_on_three_spawned_ranks(self, tmp_path):  # world size 3
        per_rank = run_ranks(resume_on_this_rank, 3, args=(str(tmp_path),))
        for rank, results in enumerate(per_rank):
            # the sampler took rank and world size from phalanx.init(): the shards are rank r of 3
            assert results[(0, 0)][1] == as_lists(make_loader(rank, 3, epoch=1, batch_size=2, seed=11))
            for (num_workers, k), (resumed, reference) in results.items():
                assert resumed == reference, f"rank {rank}, {num_workers} workers, after {k} batches"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_pass_leaves_the_global_random_stream_as_the_uninterrupted_run_had_it(workers):
    # Dropout after a mid-epoch resume is exact only if starting the resumed pass does not draw from
    # the restored global generator (torch's iterator draws its workers' base seed from it).
    def make():
        sampler = DistributedSampler(range(24), num_replicas=2, rank=1, seed=5)
        return DataLoader(range(24), batch_size=3, sampler=sampler, num_workers=workers,
                          multiprocessing_context="fork" if workers else None)

    torch.manual_seed(0)
    loader = make()
    loader.set_epoch(1)
    draws, state, rng = [], None, None
    for step, batch in enumerate(loader):
        draws.append((batch.tolist(), torch.rand(1).item()))
        if step == 1:
            state, rng = loader.state_dict(), torch.get_rng_state()
    resumed = make()
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    resumed.set_epoch(1)
    assert [(b.tolist(), torch.rand(1).item()) for b in resumed] == draws[2:]
