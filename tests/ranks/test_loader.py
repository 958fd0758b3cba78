"""phalanx.DataLoader with processes: the resume contract with DataLoader worker processes (ranks
simulated in this process, rank/num_replicas passed explicitly), and on 3 spawned Gloo ranks whose
samplers take rank and world size from phalanx.init().

The same contract without workers, in one process, is in tests/unit/test_loader.py.
"""

import pytest
import torch
import torch.utils.data

from phalanx import DataLoader, DistributedSampler
from phalanx.testing import run_ranks
from tests.helpers.loader_cases import (
    Squares,
    as_lists,
    assert_resume_contract,
    assert_resume_keeps_the_global_random_stream,
    make_loader,
)

# -- DataLoader workers ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [2])  # without workers: tests/unit/test_loader.py
@pytest.mark.parametrize("replicas", [2, 3])
def test_resume_contract_at_every_batch_on_every_rank(replicas, num_workers):
    """World size 1 (2 and 3 ranks simulated), 2 DataLoader workers."""
    for rank in range(replicas):
        assert_resume_contract(rank, replicas, num_workers=num_workers)


@pytest.mark.parametrize("options", [
    {"pad": False, "num_workers": 2, "persistent_workers": True, "prefetch_factor": 3},
], ids=["persistent-workers"])
def test_resume_contract_holds_for_loader_variants(options):
    """World size 1 (3 ranks simulated), 2 persistent DataLoader workers."""
    for rank in range(3):
        assert_resume_contract(rank, 3, **options)


@pytest.mark.smoke
def test_prefetched_batches_do_not_count_as_consumed():
    """World size 1 (ranks simulated), 2 DataLoader workers."""
    loader = make_loader(0, 2, num_workers=2, batch_size=2, prefetch_factor=2)
    it = iter(loader)
    next(it)
    assert loader.sampler.state_dict()["consumed"] > 2  # the workers were handed more than one batch
    assert (loader.state_dict()["batches"], loader.state_dict()["consumed"]) == (1, 2)


def test_a_pass_broken_off_with_persistent_workers_does_not_leak_into_the_next():
    """World size 1 (ranks simulated), 2 persistent DataLoader workers."""
    loader = make_loader(0, 2, num_workers=2, persistent_workers=True, batch_size=2)
    whole = as_lists(make_loader(0, 2, batch_size=2))
    for _, _ in zip(loader, range(2)):  # break off after two batches, workers keep prefetched ones
        pass
    it = iter(loader)
    assert next(it).tolist() == whole[0]
    assert (loader.state_dict()["batches"], loader.state_dict()["consumed"]) == (1, 2)
    assert [next(it).tolist() for _ in range(len(whole) - 1)] == whole[1:]


@pytest.mark.parametrize("dataset, options", [
    (Squares(), {"batch_size": 4, "drop_last": True, "num_workers": 2}),
], ids=["map-workers"])
def test_a_drop_in_for_torchs_loader(dataset, options):
    """World size 1, 2 DataLoader workers."""
    ours, theirs = DataLoader(dataset, **options), torch.utils.data.DataLoader(dataset, **options)
    assert as_lists(ours) == as_lists(theirs)
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        assert len(ours) == len(theirs)


@pytest.mark.parametrize("workers", [2])  # without workers: tests/unit/test_loader.py
def test_a_resumed_pass_leaves_the_global_random_stream_as_the_uninterrupted_run_had_it(workers):
    """World size 1, 2 DataLoader workers (forked)."""
    assert_resume_keeps_the_global_random_stream(workers)


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
    def test_resume_contract_on_three_spawned_ranks(self, tmp_path):
        """World size 3 (run_ranks), 0 and 2 DataLoader workers per rank."""
        per_rank = run_ranks(resume_on_this_rank, 3, args=(str(tmp_path),))
        for rank, results in enumerate(per_rank):
            # the sampler took rank and world size from phalanx.init(): the shards are rank r of 3
            assert results[(0, 0)][1] == as_lists(make_loader(rank, 3, epoch=1, batch_size=2, seed=11))
            for (num_workers, k), (resumed, reference) in results.items():
                assert resumed == reference, f"rank {rank}, {num_workers} workers, after {k} batches"
