"""Datasets and loaders shared by tests/unit/test_loader.py and tests/ranks/test_loader.py, and the
resume contract both check: a loader restored from its state after k batches yields batches k+1, ...
"""

import io

import torch
import torch.utils.data

from phalanx import DataLoader, DistributedSampler

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


def assert_resume_keeps_the_global_random_stream(workers: int) -> None:
    """A resumed pass leaves the global random stream as the uninterrupted run had it, with `workers`
    DataLoader workers."""
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
