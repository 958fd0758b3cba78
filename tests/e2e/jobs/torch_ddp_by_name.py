"""A script written for torch's DDP, untouched: it names `torch.nn.parallel.DistributedDataParallel`.

Each rank trains a small model 3 steps on its own batch and prints the class it got and a checksum of its
parameters: under `-m phalanx.integrations.with_phalanx_ddp` the class is phalanx's and the checksums agree.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import distributed

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    g = torch.Generator().manual_seed(10 * step + rank)
    optimizer.zero_grad()
    F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 2, generator=g)).backward()
    optimizer.step()
checksum = sum(float(p.double().sum()) for p in model.parameters())
built = f"{type(model).__module__}.{type(model).__name__}"
print(f"rank={rank} class={built} torch_name_is_it={distributed.DistributedDataParallel is type(model)} "
      f"checksum={checksum:.12f} argv={sys.argv[1:]}", flush=True)
dist.destroy_process_group()
