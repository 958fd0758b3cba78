"""A DDP model's state dict: torch DDP's keys, loadable from and into compiled and plain models alike.

`state_dict()` gives the keys torch's DDP gives ('module.x') without torch.compile's '_orig_mod.';
`load_state_dict()` takes this wrapper's keys or the bare module's, compiled or not, so checkpoints
move between torch's DDP, phalanx's and an unwrapped model in every direction.
"""

from __future__ import annotations

import torch

COMPILED_PREFIX = "_orig_mod."  # what torch.compile's OptimizedModule puts in front of the model's keys


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside torch.compile's wrapper (the same parameters), or `module` itself."""
    while isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
        module = module._orig_mod
    return module


class StateDictMixin:
    """`state_dict` and `load_state_dict`, mixed into DistributedDataParallel before torch.nn.Module; a
    front that holds its parameters otherwise (fully_sharded.py) overrides `_load_plain`."""

    def state_dict(self, *args, **kwargs):
        """torch DDP's keys ('module.x'), without torch.compile's '_orig_mod.' (so they load anywhere)."""
        state = super().state_dict(*args, **kwargs)  # a sharded model's pre-hook completes the all-gather
        if not any(COMPILED_PREFIX in key for key in state):
            return state
        renamed = type(state)((key.replace(COMPILED_PREFIX, ""), value) for key, value in state.items())
        renamed._metadata = getattr(state, "_metadata", None)
        return renamed

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load this wrapper's keys ('module.x') or the bare module's ('x'), compiled ('_orig_mod.') or not."""
        target = uncompiled(self.module)
        own = set(target.state_dict(keep_vars=True).keys())
        keys = {key: key.replace(COMPILED_PREFIX, "") for key in state_dict}
        bare = sum(plain in own for plain in keys.values())
        prefixed = sum(plain.startswith("module.") and plain[len("module."):] in own for plain in keys.values())
        strip = len("module.") if prefixed > bare else 0
        plain = {keys[key][strip:]: value for key, value in state_dict.items()}
        return self._load_plain(target, plain, strict, assign)

    def _load_plain(self, target: torch.nn.Module, plain: dict, strict: bool, assign: bool):
        return target.load_state_dict(plain, strict=strict, assign=assign)
