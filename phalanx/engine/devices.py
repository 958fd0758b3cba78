"""Which device a DDP model runs on, and moving its inputs there (torch's `device_ids` contract)."""

from __future__ import annotations

import torch

from ..errors import explain


def check_device_ids(device_ids, devices: set) -> list | None:
    if not device_ids:
        return None
    if len(devices) > 1 or next(iter(devices)).type == "cpu" or len(device_ids) != 1:
        raise ValueError(explain(
            "device_ids only applies to a module on a single GPU", seen=f"device_ids={device_ids}, "
            f"parameters on {sorted(str(d) for d in devices)}", expected="device_ids=None or [the GPU index]",
            fix="Leave device_ids=None for CPU and multi-device modules."))
    return [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]


def move_to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move_to(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    return value
