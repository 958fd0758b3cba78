"""`import phalanx.metrics` and `from phalanx.metrics import Mean`: the module lives in phalanx/data/metrics.py;
this name is the same module object, not a copy."""

import sys

from .data import metrics

sys.modules[__name__] = metrics
