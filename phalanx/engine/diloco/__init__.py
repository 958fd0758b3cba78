"""`across_hosts=px.DiLoCo(every=H)`: exact DDP inside each host, an outer optimizer step across hosts every H steps.

`config.py` is `DiLoCo` and its checks; `hosts.py` cuts the model's process group to its host and makes its
outer step; `outer.py` is `OuterStep` (the schedule, the outer optimizer, the checkpoint state); `fragments.py`
cuts the parameters into Streaming DiLoCo's fragments and staggers them; `exchange.py` averages a pseudo-
gradient's chunk across hosts, exact or compressed with error feedback (`codec.py`), at once or in the background;
`live.py` follows live recovery (groups made again for each generation, an outer step redone on the hosts left).
"""

from .config import DiLoCo
from .hosts import OneHost, split_across_hosts
from .outer import OuterStep

__all__ = ["DiLoCo", "OneHost", "OuterStep", "split_across_hosts"]
