"""A training state with every kind of entry the Checkpointer saves, and one training step that draws
from every random generator it restores: shared by tests/unit/test_checkpoint.py and tests/ranks/test_checkpoint.py,
whose process killed in the middle of a save runs `save_and_die`.
"""

import os
import random
import signal
import time

import numpy as np
import torch


def make_net(hidden=8, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                               torch.nn.Linear(hidden, 2))


def make_state(hidden=8):
    net = make_net(hidden)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    return {"model": net, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2),
            "scaler": torch.amp.GradScaler("cpu"), "step": 0, "tag": "run-a", "history": [0.5, {"best": 1}]}


def train_step(state):
    """One step that draws from every generator the Checkpointer restores."""
    net, opt = state["model"], state["optimizer"]
    x = torch.randn(6, 4) + random.random() + float(np.random.rand())
    loss = net(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state["scheduler"].step()
    state["step"] += 1


def save_and_die(rank: int, where: str, directory: str, background: bool) -> None:
    """Save once, completely; train a step; then die of SIGKILL in the middle of the second save, at `where`:
    "mid_write" (half a file on disk), "before_rename" (a complete temporary file, not renamed) or
    "before_manifest_rename". A background writer, forked at the first save, inherits the patches and kills
    the training process (and so itself, PR_SET_PDEATHSIG). Run in a process of its own (phalanx.spawn)."""
    import phalanx as px
    from phalanx.checkpoint import atomic_files

    trainer = os.getpid()

    def die():
        os.kill(trainer, signal.SIGKILL)
        time.sleep(60)

    def second(name) -> bool:
        return "ckpt-00000002" in str(name)

    if where == "mid_write":
        write = atomic_files._HashingWriter.write

        def write_then_die(self, data):
            written = write(self, data)
            if self.size > 4096 and second(getattr(self.file, "name", "")):
                self.file.flush()
                die()
            return written
        atomic_files._HashingWriter.write = write_then_die
    else:
        replace = os.replace

        def die_before(src, dst):
            name = os.path.basename(dst)
            if where == "before_rename" and second(name):
                die()
            if where == "before_manifest_rename" and name == "manifest.json" and second(os.listdir(directory)):
                die()
            replace(src, dst)
        os.replace = die_before

    state = make_state(hidden=256)
    train_step(state)
    checkpointer = px.Checkpointer(directory, async_save=background)
    checkpointer.save(state)  # the complete checkpoint that must survive
    checkpointer.wait()
    train_step(state)
    checkpointer.save(state)
    checkpointer.wait()
    raise AssertionError(f"the crash at {where} was not injected")
