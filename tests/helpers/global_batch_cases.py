"""A global-batch training run shared by tests/unit/test_global_batch.py and tests/ranks/test_global_batch.py:
a dataset whose items carry their index (so each applied step's sample ids can be logged), a small model
without dropout, the loop of docs/data.md, and the reference: one process, each step on its whole batch.
"""

import torch
import torch.nn.functional as F
import torch.utils.data

SIZE, GLOBAL_BATCH, MICRO_BATCH, EPOCHS, SEED = 80, 26, 4, 2, 3
# 80 = 3 x 26 + 2: each epoch ends in a step of 2 samples; 26 splits evenly over 1 and 2 ranks, not over 3
# or 4 (8-9 and 6-7 samples per rank), and the last step leaves 1 (3 ranks) or 2 (4 ranks) ranks a padding
# micro-batch.


class Indexed(torch.utils.data.Dataset):
    """Item i is (i, x_i, y_i): a regression target from a fixed random linear map plus a bend."""

    def __init__(self, size=SIZE):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=generator)
        self.y = (self.x @ torch.tensor([[0.5], [-1.0], [2.0], [0.3]])).tanh() + 0.1 * self.x[:, :1] ** 2

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return index, self.x[index], self.y[index]


def make_model(hidden=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def make_optimizer(model, adam=False):
    """SGD with momentum (state per element); with `adam`, AdamW (a scalar step count per parameter besides)."""
    if adam:
        return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)


def epoch_order(epoch, size=SIZE, seed=SEED):
    """The epoch's global order, as torch's DistributedSampler draws it (independent of phalanx)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def reference_run(epochs=EPOCHS, global_batch=GLOBAL_BATCH, size=SIZE, drop_last=False, adam=False, hidden=8):
    """One process, no accumulation: step s of each epoch is the mean loss over entries [s*B, (s+1)*B) of its order.

    Returns (final parameters, {(epoch, step): sorted sample ids}).
    """
    data, model = Indexed(size), make_model(hidden)
    optimizer = make_optimizer(model, adam)
    steps = {}
    for epoch in range(epochs):
        order = epoch_order(epoch, size)
        for step, start in enumerate(range(0, size, global_batch)):
            ids = order[start:start + global_batch]
            if drop_last and len(ids) < global_batch:
                break
            optimizer.zero_grad()
            F.mse_loss(model(data.x[ids]), data.y[ids]).backward()
            optimizer.step()
            steps[(epoch, step)] = sorted(ids)
    return parameters(model), steps


def parameters(model):
    module = getattr(model, "module", model)
    return [p.detach().clone() for p in module.parameters()]


def micro_batches_ids(step, model) -> list[int]:
    """Run `step`'s micro-batches through `model` (an MSE loss, step.backward); the sample ids that weighed in, on
    this rank. Under live recovery the loop can start over on the ranks left (`step.attempt`): so do the ids."""
    ids, attempt = [], 0
    for index, x, y in step.micro_batches(model):
        if step.attempt != attempt:
            ids, attempt = [], step.attempt
        step.backward(F.mse_loss(model(x), y))
        if step.weight:
            ids += index.tolist()
    return ids


def train_epochs(loader, model, optimizer, log, *, start_epoch=0, epochs=EPOCHS, after_step=None):
    """The loop of docs/data.md. `log[(epoch, step)]` gets this rank's sample ids that weighed in the step;
    `after_step(state)` runs last in every step (a Checkpointer's step) and may return True to stop the run."""
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for step in loader:
            optimizer.zero_grad()
            ids = []
            for index, x, y in step.micro_batches(model):
                loss = F.mse_loss(model(x), y)
                step.backward(loss)
                if step.weight:
                    ids += index.tolist()
            optimizer.step()
            log[(epoch, step.index)] = ids
            if after_step is not None and after_step():
                return False
    return True
