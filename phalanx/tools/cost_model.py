"""An alpha-beta model of a DDP step across hosts: flat ring against hierarchical, buckets in order.

Each phase costs alpha + bytes / beta. Shared memory (this host's L ranks): `shm_alpha + S / shm_beta`
for a bucket of S bytes, half before the network phase (the reduce-scatter) and half after (the
all-gather). Network, a ring of n members on links of `link_bytes_per_s` each: 2(n-1) latencies of
`net_alpha` and 2(n-1)/n * S over each host's link; flat: n = P = N L ranks, hierarchical: n = N hosts
(its L flows of S/L share the link: the same bytes, the same time). Buckets go in order, each phase
one after the other and overlapping backward:

    host_b = max(ready_b, host_(b-1)) + T_rs(S_b)       # only hierarchical
    net_b  = max(host_b, net_(b-1)) + T_net(S_b)        # end_b = max(ready_b, end_(b-1)) + T(S_b)
    gather = max(backward, net_last) + sum_b T_ag(S_b)  # at the end of backward, bucket by bucket
    step   = compute-only step + (gather - backward)

Calibrated by microbenchmarks (`calibrate`): the shared-memory all-reduce of this host's ranks and the
network all-reduce of every local index at once, each at a few sizes, fitted to a line. The per-phase
formulas live in exchange/hierarchical.py, which picks each bucket's path with them.
"""

from __future__ import annotations

from ..exchange.hierarchical import Calibration, ring_seconds, shm_seconds
from ..exchange.hierarchical import path_seconds as plan  # noqa: F401 - one all-reduce, flat and hierarchical


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (intercept, slope) of y over x; the intercept is kept at 0 or more.

    >>> fit_line([(0, 1.0), (1, 3.0), (2, 5.0)])
    (1.0, 2.0)
    """
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # a latency cannot be negative: refit through the origin
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return intercept, slope


def calibrate(measured: dict, hosts: int) -> Calibration:
    """From the microbenchmarks: {"shm": [(S, seconds)], "network": [(S, seconds)]}, where "network" timed
    every local index's all-reduce of S/L at once across `hosts` hosts (S bytes in all)."""
    shm_a, shm_b = fit_line(measured["shm"])
    net_a, net_b = fit_line(measured["network"])
    steps = 2 * (hosts - 1)
    return Calibration(net_alpha=net_a / steps, link_bytes_per_s=steps / hosts / net_b, shm_alpha=shm_a,
                       shm_bytes_per_s=1.0 / shm_b)


def predict_step(buckets: list[tuple[float, float]], backward: float, compute: float, hosts: int, local: int,
                 cal: Calibration, kind: str) -> float:
    """Predicted step seconds for `kind` ("flat" or "hier") at `hosts` x `local` ranks.

    `buckets`: (bytes, seconds into backward at which the bucket is ready), in launch order; `backward`:
    seconds of the whole backward; `compute`: the step without DDP.

    >>> cal = Calibration(net_alpha=0.0, link_bytes_per_s=1e6, shm_alpha=0.0, shm_bytes_per_s=1e9)
    >>> round(predict_step([(1e6, 0.1)], 0.1, 0.2, 2, 2, cal, "flat"), 3)   # 2*3/4 MB at 1 MB/s
    1.7
    >>> round(predict_step([(1e6, 0.1)], 0.1, 0.2, 2, 2, cal, "hier"), 3)   # 2*1/2 MB, plus 1 ms of memory
    1.201
    """
    host_end = net_end = 0.0
    gathers = 0.0
    for nbytes, ready in buckets:
        if kind == "hier":
            shm = shm_seconds(nbytes, cal)
            host_end = max(ready, host_end) + shm / 2
            net_end = max(host_end, net_end) + ring_seconds(nbytes, hosts, cal)
            gathers += shm / 2
        else:
            net_end = max(ready, net_end) + ring_seconds(nbytes, hosts * local, cal)
    end = max(backward, net_end) + gathers
    return compute + end - backward
