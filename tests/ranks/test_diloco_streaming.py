"""DiLoCo's compression and streaming (docs/diloco.md) on 2 emulated hosts x 2 ranks, all in one spawn of 4 ranks.

Hosts are emulated by GROUP_RANK as in tests/ranks/test_diloco.py. The cases: an int8 or fp16 outer step equals a
one-process reference that simulates the hosts, the chunks, both quantizations and their error feedback; int8
sends about a quarter of fp32's bytes; 2 fragments synced at staggered steps and merged a step late equal the
reference that simulates that schedule; a save in mid-period resumes bitwise, the residuals with it, also with a
fragment's average on its way, and at 4 hosts x 1 the average on its way is merged when due; more fragments than
parameters is a typed error.
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

import phalanx as px
from phalanx.testing import run_ranks

LOCAL, HOSTS, ROW = 2, 2, 256  # ranks per emulated host, hosts, values per int8 scale


def _net(dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)  # 1,361 parameters: chunks of 681 per local rank, pieces of 341 per host (2 int8 rows)
    return torch.nn.Sequential(torch.nn.Linear(32, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)).to(dtype)


def _batch(rank: int, step: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 32, generator=g).to(dtype), torch.randn(5, 1, generator=g).to(dtype)


def _train(model, optimizer, rank: int, start: int, end: int, dtype=torch.float64) -> None:
    for step in range(start, end):
        x, y = _batch(rank, step, dtype)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# -- the one-process reference --------------------------------------------------------------------------------------

def _lossy(x: torch.Tensor, compress: str) -> torch.Tensor:
    """What the far side decodes: int8 with one fp32 scale (max |x| / 127) per row of 256 values, or fp16."""
    if compress == "fp16":
        return x.clamp(-65504, 65504).half().to(x.dtype)
    out = torch.empty_like(x)
    for start in range(0, x.numel(), ROW):
        row = x[start:start + ROW]
        scale = float((row.abs().max() / 127).float()) or 1.0
        out[start:start + ROW] = (row / scale).round().clamp(-127, 127) * scale
    return out


class _Averager:
    """The hosts' mean of their pseudo-gradients as the compressed exchange computes it: local rank j's chunk of
    each host, cut in one piece per host; piece k's mean taken on host k; both halves with error feedback."""

    def __init__(self, compress: str | None):
        self.compress, self.sent, self.mean = compress, {}, {}

    def __call__(self, deltas: list[torch.Tensor], key) -> torch.Tensor:
        n = deltas[0].numel()
        if self.compress is None:
            return sum(deltas) / HOSTS
        chunk, out = -(-n // LOCAL), []
        for j in range(LOCAL):
            piece = -(-chunk // HOSTS)
            decoded = []
            for h, delta in enumerate(deltas):
                x = torch.zeros(HOSTS * piece, dtype=delta.dtype)
                part = delta[j * chunk:(j + 1) * chunk]
                x[:part.numel()] = part
                x += self.sent.get((key, h, j), torch.zeros_like(x))
                lossy = torch.cat([_lossy(p, self.compress) for p in x.split(piece)])
                self.sent[key, h, j] = x - lossy
                decoded.append(lossy.split(piece))
            means = []
            for k in range(HOSTS):
                mean = (decoded[0][k] + decoded[1][k]) / HOSTS + self.mean.get((key, k, j), 0)
                means.append(_lossy(mean, self.compress))
                self.mean[key, k, j] = mean - means[-1]
            out.append(torch.cat(means)[:chunk])
        return torch.cat(out)[:n]


FRAGMENTS = [[0], [1, 2, 3]]  # fragments=2 of the test model's 1,280 + 40 + 40 + 1 values, whole parameters


def _reference(rank: int, steps: int, config: px.DiLoCo) -> list[torch.Tensor]:
    """Each host's inner run (SGD with momentum on the mean of its ranks' gradients) and each fragment's outer
    step: fragment k's averaged pseudo-gradient taken after the steps s = k*H/F (mod H), into a Nesterov SGD on
    its synced parameters `delay` steps later, each host's progress since the send kept on top. This rank's
    host's parameters."""
    hosts = [_net() for _ in range(HOSTS)]
    inner = [torch.optim.SGD(h.parameters(), lr=0.1, momentum=0.9) for h in hosts]
    synced = [p.detach().clone() for p in hosts[0].parameters()]
    outer = torch.optim.SGD(synced, lr=config.outer_lr, momentum=config.momentum, nesterov=config.nesterov)
    average, every, count = _Averager(config.compress), config.every, config.fragments
    parts = FRAGMENTS if count == 2 else [[0, 1, 2, 3]]
    on_the_way = []  # (fragment, merged after step, average, each host's parameters as sent)
    for step in range(1, steps + 1):
        for h, (model, optimizer) in enumerate(zip(hosts, inner)):
            optimizer.zero_grad()
            for r in range(h * LOCAL, (h + 1) * LOCAL):
                x, y = _batch(r, step - 1)
                (torch.nn.functional.mse_loss(model(x), y) / LOCAL).backward()
            optimizer.step()
        with torch.no_grad():
            for k, part in enumerate(parts):
                if (step - k * every // count) % every == 0:
                    mine = [[list(m.parameters())[i] for i in part] for m in hosts]
                    deltas = [_flat(synced[i] for i in part) - _flat(ps) for ps in mine]
                    sent = [[p.clone() for p in ps] for ps in mine] if config.delay else None
                    on_the_way.append((k, step + config.delay, average(deltas, k), sent))
            while on_the_way and on_the_way[0][1] <= step:
                k, _, mean, sent = on_the_way.pop(0)
                offset = 0
                for i in parts[k]:
                    synced[i].grad = mean[offset:offset + synced[i].numel()].view_as(synced[i])
                    offset += synced[i].numel()
                outer.step()
                for h, model in enumerate(hosts):
                    params = list(model.parameters())
                    for j, i in enumerate(parts[k]):
                        params[i].copy_(synced[i] if sent is None else synced[i] + (params[i] - sent[h][j]))
                for i in parts[k]:
                    synced[i].grad = None
    return _params(hosts[rank // LOCAL])


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# -- the ranks ------------------------------------------------------------------------------------------------------

def _resume(net, config, rank: int, directory: str, save_at: int, end: int) -> bool:
    """Trained to `end` without a stop, and again from a save at `save_at`: bitwise the same?"""
    def fresh():
        m = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=config)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, o, {"model": m, "optimizer": o, "outer": m.outer_step, "step": 0}

    m, o, state = fresh()
    checkpointer = px.Checkpointer(directory)
    _train(m, o, rank, 0, save_at)
    state["step"] = save_at
    checkpointer.save(state)
    _train(m, o, rank, save_at, end)
    checkpointer.wait()
    uninterrupted = _params(m)
    m, o, state = fresh()
    assert px.Checkpointer(directory).restore(state) and state["step"] == save_at
    _train(m, o, rank, save_at, end)
    return all(torch.equal(a, b) for a, b in zip(uninterrupted, _params(m)))


def _cases(rank: int, world: int, directory: str) -> dict:
    os.environ["GROUP_RANK"] = str(rank // LOCAL)  # 2 hosts of 2 ranks
    out = {}
    net = _net()

    # Compressed outer steps (every=2, 5 steps: the second outer step sends the first one's residuals).
    for compress in ("int8", "fp16"):
        config = px.DiLoCo(every=2, compress=compress)
        model = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=config)
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, 0, 5)
        out[f"{compress}_diff"] = _max_diff(_params(model), _reference(rank, 5, config))
        out[f"{compress}_moved"] = _max_diff(_params(net), _params(model))
        out[f"{compress}_after"] = _params(model)

    # The bytes across hosts of one outer step of a float32 model: int8 against the parameters' own dtype.
    for compress in (None, "int8"):
        single = _net(torch.float32)
        model = px.DistributedDataParallel(single, across_hosts=px.DiLoCo(every=1, compress=compress))
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0, 1, torch.float32)
        out[f"bytes_{compress}"] = model.outer_step.bytes_across_hosts

    # A save in mid-period (step 3 of every=2, residuals of one outer step kept) resumes bitwise.
    out["int8_resume_equal"] = _resume(net, px.DiLoCo(every=2, compress="int8"), rank, f"{directory}/int8", 3, 6)

    # Streaming: 2 fragments of every=4 (fragment 1 after steps 2, 6; fragment 0 after 4, 8), merged 1 step late.
    for name, compress in (("stream", None), ("stream_int8", "int8")):
        config = px.DiLoCo(every=4, fragments=2, delay=1, compress=compress)
        model = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(model, optimizer, rank, 0, 6)
        out[f"{name}_in_flight"] = [(s.fragment, s.due) for s in model.outer_step.in_flight]
        _train(model, optimizer, rank, 6, 9)
        out[f"{name}_diff"] = _max_diff(_params(model), _reference(rank, 9, config))
        out[f"{name}_outer_steps"] = model.outer_step.outer_steps
        out[f"{name}_fragments"] = model.outer_step.fragments
    # Saved after step 7 with fragment 1's average on its way (sent after step 6, merged after step 8): the resume
    # is bitwise, the host's parameters as sent with it.
    config = px.DiLoCo(every=4, fragments=2, delay=2, compress="int8")
    out["stream_resume_equal"] = _resume(net, config, rank, f"{directory}/stream", 7, 10)
    # The same checkpoint at 4 hosts x 1: the average on its way merges when due, the residuals start at zero.
    os.environ["GROUP_RANK"] = str(rank)
    model = px.DistributedDataParallel(copy.deepcopy(net), across_hosts=config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optimizer": optimizer, "outer": model.outer_step, "step": 0}
    out["four_hosts_restored"] = px.Checkpointer(f"{directory}/stream").restore(state) and state["step"] == 7
    out["four_hosts_in_flight_at_restore"] = [(s.fragment, s.due) for s in model.outer_step.in_flight]
    _train(model, optimizer, rank, 7, 10)
    out["four_hosts_after"] = (model.outer_step.outer_steps, [(s.fragment, s.due) for s in model.outer_step.in_flight])
    os.environ["GROUP_RANK"] = str(rank // LOCAL)

    # More fragments than parameters: a typed error on every rank, before any collective of the mode.
    try:
        px.DistributedDataParallel(copy.deepcopy(net), across_hosts=px.DiLoCo(every=8, fragments=8))
        out["too_many_fragments"] = None
    except Exception as exc:  # the type is what the test checks
        out["too_many_fragments"] = (type(exc).__name__, str(exc))
    out["cpu_s"] = time.process_time()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_ranks(_cases, 4, (4, str(tmp_path_factory.mktemp("diloco_streaming"))), timeout=120)
    print(f"CPU seconds of the 4 ranks: {sum(o['cpu_s'] for o in out):.1f}")
    return out


@pytest.mark.parametrize("compress", ["int8", "fp16"])
def test_compressed_outer_step_equals_one_process_reference(results, compress):
    """World size 4 (2 hosts x 2): 5 steps at every=2 with compress= equal the simulated hosts, chunks, pieces,
    quantizations and error feedback (the same operations in the same order: equal to fp64 rounding)."""
    for out in results:
        assert out[f"{compress}_moved"] > 1e-3
        assert out[f"{compress}_diff"] < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(results[0][f"{compress}_after"], results[1][f"{compress}_after"]))


def test_int8_sends_a_quarter_of_fp32s_bytes(results):
    """World size 4 (2 hosts x 2), a float32 model: the bytes this rank sends across hosts in one outer step."""
    for out in results:
        ratio = out["bytes_int8"] / out["bytes_None"]
        assert 0.25 <= ratio < 0.26, ratio  # int8 values plus one fp32 scale per 256 of them
        assert out["bytes_None"] == 681 * 4  # N = 2: a ring all-reduce sends the chunk once


def test_compressed_resume_in_mid_period_is_bitwise(results):
    """World size 4 (2 hosts x 2): int8, saved at step 3 of every=2 (residuals in the per-rank part), to step 6."""
    for out in results:
        assert out["int8_resume_equal"]


@pytest.mark.parametrize("name", ["stream", "stream_int8"])
def test_streaming_fragments_equal_one_process_reference(results, name):
    """World size 4 (2 hosts x 2): every=4, fragments=2, delay=1 (with and without int8), 9 steps: 4 fragment
    outer steps (after steps 3, 5, 7, 9), equal to the reference of the staggered, delayed schedule."""
    for out in results:
        assert out[f"{name}_fragments"] == [[0], [1, 2, 3]]
        assert out[f"{name}_in_flight"] == [(1, 7)]  # sent after step 6, merged after step 7
        assert out[f"{name}_outer_steps"] == 4
        assert out[f"{name}_diff"] < 1e-12


def test_streaming_resume_with_a_fragment_in_flight_is_bitwise(results):
    """World size 4 (2 hosts x 2): int8, every=4, fragments=2, delay=2, saved after step 7 with fragment 1 on its
    way (sent after step 6, merged after step 8), trained to step 10."""
    for out in results:
        assert out["stream_resume_equal"]


def test_more_fragments_than_parameters_is_typed(results):
    """World size 4: fragments=8 for the model's 4 parameters."""
    for out in results:
        kind, message = out["too_many_fragments"]
        assert kind == "AcrossHostsError" and "fragments=8 for 4 parameters" in message and "fragments=4" in message


def test_streaming_resume_at_another_host_count_merges_what_was_on_its_way(results):
    """World size 4: the checkpoint of 2 hosts x 2 (fragment 1 on its way, due after step 8), restored at 4 hosts
    x 1 and trained to step 10: it merges after step 8, fragment 0 (sent after 8) after 10."""
    for out in results:
        assert out["four_hosts_restored"]
        assert out["four_hosts_in_flight_at_restore"] == [(1, 8)]
        assert out["four_hosts_after"] == (4, [(1, 12)])  # 2 merged before the save, 2 since; fragment 1 sent at 10
