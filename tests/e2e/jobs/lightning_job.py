"""One Lightning run on 2 CPU ranks: `lightning_job.py fabric|trainer STRATEGY OUT_DIR` under `phalanx run` or torchrun.

The same small regression, trained with gradient accumulation (2 micro-batches per step, the first under
no_sync), checkpointed after the first half and resumed from that checkpoint in a fresh model. Rank 0
writes OUT_DIR/STRATEGY.pt: the parameters of the uninterrupted run and of the resumed one (the trainer
also those of a manual-optimization run, and of a run with torch's fp16 comm hook passed as
`ddp_comm_hook`, with the hook's call count), and how many backwards left the ranks' gradients apart
(under no_sync) or equal (synchronized).
"""

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import phalanx.integrations.lightning  # noqa: F401 -- registers strategy="phalanx_ddp"
from phalanx.integrations.lightning import PhalanxDDPStrategy

HALF, STEPS, ACCUMULATE, BATCH = 4, 8, 2, 4  # optimizer steps; 64 samples = 4 steps per epoch on 2 ranks


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(64, 1, generator=g))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def grads_agree(module: nn.Module) -> bool:
    """Whether every rank holds the same gradients now (collective)."""
    mine = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every[1:])


# -- Fabric ----------------------------------------------------------------------------------------

def fabric_run(strategy: str, out: Path) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    x_all, y_all = (tensor[fabric.global_rank::2] for tensor in data().tensors)  # this rank's half
    checkpoint, counts = out / f"fabric-{strategy}.ckpt", {"apart": 0, "equal": 0}

    def train(model, optimizer, start: int, stop: int) -> None:
        for step in range(start, stop):
            for micro in range(ACCUMULATE):
                first = (step * ACCUMULATE + micro) * BATCH % len(x_all)
                x, y = x_all[first:first + BATCH], y_all[first:first + BATCH]
                accumulating = micro < ACCUMULATE - 1
                with fabric.no_backward_sync(model, enabled=accumulating):
                    fabric.backward(nn.functional.mse_loss(model(x), y) / ACCUMULATE)
                counts["equal" if grads_agree(model) else "apart"] += 1
            optimizer.step()
            optimizer.zero_grad()
            if step + 1 == HALF and start == 0:
                fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": step + 1})

    model = fabric.setup_module(net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    wrapper = type(model._forward_module)  # what the strategy wrapped the model in
    train(model, optimizer, 0, STEPS)
    uninterrupted = flat(model)

    fresh = fabric.setup_module(net(seed=1))
    fresh_optimizer = fabric.setup_optimizers(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(checkpoint, state)
    train(fresh, fresh_optimizer, state["step"], STEPS)
    return {"uninterrupted": uninterrupted, "resumed": flat(fresh),
            "wrapper": f"{wrapper.__module__}.{wrapper.__name__}", **counts}


# -- the Trainer -----------------------------------------------------------------------------------

class Regression(L.LightningModule):
    def __init__(self, seed: int = 0, manual: bool = False):
        super().__init__()
        self.net, self.counts = net(seed), {"apart": 0, "equal": 0}
        self.automatic_optimization = not manual

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()

    def on_train_start(self):
        wrapper = type(self.trainer.strategy.model)  # what the strategy wrapped the module in
        self.wrapper = f"{wrapper.__module__}.{wrapper.__name__}"

    def on_after_backward(self):
        self.counts["equal" if grads_agree(self.net) else "apart"] += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


HOOK_CALLS = []


def counted_fp16_hook(state, bucket):
    """torch's fp16 compression hook, counted: Lightning's DDPStrategy registers it on GPUs only."""
    HOOK_CALLS.append(bucket.index())
    return default_hooks.fp16_compress_hook(state, bucket)


def trainer(strategy, manual: bool = False, callbacks=()) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                     accumulate_grad_batches=1 if manual else ACCUMULATE, callbacks=list(callbacks),
                     enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False)


def trainer_run(strategy: str, out: Path) -> dict:
    loader = DataLoader(data(), batch_size=BATCH)
    every_half = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, filename=f"trainer-{strategy}",
                                                     every_n_train_steps=HALF, save_top_k=1, monitor="step",
                                                     mode="min", save_weights_only=False)
    whole = Regression()
    trainer(strategy, callbacks=[every_half]).fit(whole, loader)
    resumed = Regression(seed=1)
    trainer(strategy).fit(resumed, loader, ckpt_path=out / f"trainer-{strategy}.ckpt")  # saved at step HALF
    manual = Regression(manual=True)
    trainer(strategy, manual=True).fit(manual, loader)
    hooked = Regression()
    with_hook = {"ddp": DDPStrategy, "phalanx_ddp": PhalanxDDPStrategy}[strategy](ddp_comm_hook=counted_fp16_hook)
    trainer(with_hook).fit(hooked, loader)
    return {"uninterrupted": flat(whole.net), "resumed": flat(resumed.net), "manual": flat(manual.net),
            "fp16_hook": flat(hooked.net), "hook_calls": len(HOOK_CALLS),
            "manual_equal": manual.counts["equal"], "manual_apart": manual.counts["apart"], "wrapper": whole.wrapper,
            **whole.counts}


if __name__ == "__main__":
    api, strategy, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    result = {"fabric": fabric_run, "trainer": trainer_run}[api](strategy, out)
    result["ranks"] = dist.get_world_size()
    if dist.get_rank() == 0:
        torch.save(result, out / f"{api}-{strategy}.pt")
    print(f"lightning_job: rank {dist.get_rank()} done ({api}, {strategy}, {result['wrapper']})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
