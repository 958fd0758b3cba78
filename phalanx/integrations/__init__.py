"""phalanx inside the trainers that build torch's DDP for their users.

`patch.py` is `patch_torch_ddp()`: code that constructs `torch.nn.parallel.DistributedDataParallel` by
name (Hugging Face Accelerate, so the Transformers Trainer) builds phalanx's class instead;
`with_phalanx_ddp.py` runs a script unmodified under that patch (`-m phalanx.integrations.with_phalanx_ddp
train.py` under any launcher). `lightning.py`
is the `phalanx_ddp` strategy for Lightning's Fabric and Trainer; it imports Lightning, so nothing imports
it but its users (`import phalanx.integrations.lightning`). Both libraries are the optional `trainers`
extra.

May import: engine, errors, log.
"""
