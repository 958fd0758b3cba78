"""A training state with every kind of entry the Checkpointer saves, and one training step that draws
from every random generator it restores: shared by tests/unit/test_checkpoint.py and the script that
tests/ranks/test_checkpoint.py kills in the middle of a save.
"""

import random

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
