"""The replica audit's pure parts (engine/replicas/): fingerprints that catch one changed element, the verdict
over every rank's fingerprints, the checkpoints it vouches for and sets aside, and what the StepLog and the run
summary say of it. World size 1, in-process: no process group."""

from __future__ import annotations

import json

import pytest
import torch

from phalanx.checkpoint import atomic_files
from phalanx.checkpoint.audit_trail import set_aside
from phalanx.checkpoint.background.writer import commit
from phalanx.checkpoint.restoring import choose
from phalanx.engine.replicas.audit import check_settings
from phalanx.engine.replicas.fingerprint import combine, compare, fingerprint, state_fingerprint, wrap
from phalanx.launch.goodput import Invocation, summary_lines
from phalanx.observe.window import FIELDS, line, make_record

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


def _values(dtype, n):
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 7, 64, 1001])
def test_one_flipped_bit_anywhere_changes_the_fingerprint(dtype, n):
    t = _values(dtype, n)
    before = int(fingerprint(t))
    assert int(fingerprint(t.clone())) == before
    raw = t.view(torch.uint8)
    for byte in {0, raw.numel() // 2, raw.numel() - 1}:
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert int(fingerprint(flipped.view(dtype))) != before, (dtype, n, byte, bit)


def test_one_element_off_by_a_little_or_by_an_ulp_changes_the_fingerprint():
    t = torch.randn(5, 7)
    for delta in (1e-3, None):
        changed = t.clone()
        changed[3, 4] = changed[3, 4] + delta if delta else torch.nextafter(changed[3, 4], torch.tensor(9.0))
        assert int(fingerprint(changed)) != int(fingerprint(t))


def test_views_at_any_offset_and_strided_tensors_are_fingerprinted_by_their_values():
    base = torch.randn(11, 6)
    assert int(fingerprint(base[1:])) == int(fingerprint(base[1:].clone()))  # a 4-byte misaligned start
    assert int(fingerprint(base.t())) == int(fingerprint(base.t().contiguous()))
    assert int(fingerprint(torch.tensor(2.5))) != int(fingerprint(torch.tensor(2.25)))  # 0-dim
    assert int(fingerprint(torch.empty(0))) == 0


def test_what_the_fingerprint_misses_changes_that_cancel_out():
    """Said in docs/audit.md: two 8-byte words swapped, or two words changed by opposite amounts."""
    t = torch.arange(8, dtype=torch.float32)
    swapped = t.clone()
    swapped[[2, 4]] = swapped[[4, 2]]  # each the first half of its 8-byte word
    assert int(fingerprint(swapped)) == int(fingerprint(t))
    words = t.clone().view(torch.int64)
    words[0] += 1
    words[3] -= 1
    assert int(fingerprint(words.view(torch.float32))) == int(fingerprint(t))


def test_combined_fingerprints_change_when_any_part_does():
    parts = [torch.tensor(v, dtype=torch.int64) for v in (5, -7, 2 ** 62)]
    weights = [3, 5, 7]
    whole = int(combine(parts, weights, torch.device("cpu")))
    assert whole == wrap(3 * 5 + 5 * -7 + 7 * 2 ** 62)
    for i in range(3):
        changed = list(parts)
        changed[i] = changed[i] + 1
        assert int(combine(changed, weights, torch.device("cpu"))) != whole


def test_state_fingerprint_sees_values_keys_and_structure():
    cpu = torch.device("cpu")
    state = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.zeros(4)}
    same = {k: v.clone() for k, v in state.items()}
    reference = int(state_fingerprint(state, cpu))
    assert int(state_fingerprint(same, cpu)) == reference
    assert int(state_fingerprint({**state, "step": torch.tensor(4.0)}, cpu)) != reference
    assert int(state_fingerprint({"exp_avg": torch.ones(4), "exp_avg_sq": torch.zeros(4)}, cpu)) != reference
    swapped = {"step": state["step"], "exp_avg": state["exp_avg_sq"], "exp_avg_sq": state["exp_avg"]}
    assert int(state_fingerprint(swapped, cpu)) != reference  # the same tensors under each other's keys
    assert int(state_fingerprint({**state, "momentum": 0.9}, cpu)) != reference


def test_the_verdict_names_the_majority_or_says_there_is_none():
    agree = compare([[1, 2, 3]] * 3)
    assert agree.agree and agree.columns == [] and agree.differing == []
    one_off = compare([[1, 2, 3], [1, 9, 3], [1, 2, 3], [1, 2, 3]])
    assert one_off.majority == [0, 2, 3] and one_off.differing == [1] and one_off.columns == [1]
    two = compare([[1, 2], [1, 3]])
    assert two.majority is None and two.sides == [[0], [1]] and two.differing == [0, 1]
    even = compare([[1], [1], [2], [2]])
    assert even.majority is None and even.sides == [[0, 1], [2, 3]]
    three_ways = compare([[1, 5], [2, 5], [3, 6]])
    assert three_ways.majority is None and three_ways.columns == [0, 1]


def test_the_settings_are_checked_with_what_they_take():
    assert check_settings(10, "heal", "skip", 0) == 10
    assert check_settings(0, "raise", "off", 0) == 0
    for bad in ({"every": -1}, {"every": 2.5}, {"every": True}, {"mode": "fix"}, {"on_nonfinite": "ignore"}):
        settings = {"every": 10, "mode": "heal", "on_nonfinite": "raise", **bad}
        with pytest.raises(ValueError, match="audit_every|audit|on_nonfinite"):
            check_settings(settings["every"], settings["mode"], settings["on_nonfinite"], 0)


def test_the_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PHALANX_AUDIT_EVERY", "1")
    assert check_settings(None, "heal", "raise", 0) == 1
    monkeypatch.delenv("PHALANX_AUDIT_EVERY")
    assert check_settings(None, "heal", "raise", 0) == 200


def _commit(directory, sequence, keep, protect=None):
    return commit(directory, {"format": 1, "sequence": sequence, "steps": sequence * 5, "entries": {},
                              "random_states": [], "world_size": 1, "parts": []}, keep, protect)


def test_pruning_keeps_the_checkpoint_the_audit_vouches_for(tmp_path):
    for sequence in range(1, 6):
        _commit(tmp_path, sequence, keep=2, protect=2)
    listed = [e.sequence for e in atomic_files.read_manifest(tmp_path)]
    assert listed == [2, 4, 5]
    assert sorted(atomic_files.checkpoint_files(tmp_path)) == [2, 4, 5]


def test_suspect_checkpoints_are_set_aside_and_restore_picks_the_one_before_them(tmp_path):
    for sequence in range(1, 5):
        _commit(tmp_path, sequence, keep=3, protect=1)
    set_aside(tmp_path, [3, 4])
    assert [e.sequence for e in atomic_files.read_manifest(tmp_path)] == [1, 2]
    assert (tmp_path / "ckpt-00000003.pt.suspect").exists() and (tmp_path / "ckpt-00000004.pt.suspect").exists()
    path, payload = choose(tmp_path, "cpu")
    assert path.name == "ckpt-00000002.pt" and payload["steps"] == 10
    _commit(tmp_path, 5, keep=3, protect=2)  # a later save prunes as usual and leaves the suspect files alone
    assert (tmp_path / "ckpt-00000004.pt.suspect").exists()


def test_a_steplog_record_counts_the_steps_skipped():
    def row(**values):
        out = [0.0] * len(FIELDS)
        for name, value in values.items():
            out[FIELDS.index(name)] = value
        return out
    record = make_record([row(steps=10, end_step=80, samples=40, wall_s=1.0, skipped=1)] * 3, now=0.0)
    assert record["skipped_steps"] == 1 and "skipped 1 (non-finite gradients)" in line(record)
    assert make_record([row(steps=10, end_step=70, samples=40, wall_s=1.0)], now=0.0)["skipped_steps"] == 0
    json.dumps(record)


def test_the_run_summary_lists_heals_stops_and_skipped_steps():
    now = Invocation(outcome="finished", attempts=1, first_step=0, last_step=100)
    now.audit = [
        {"event": "replica_mismatch", "step": 60, "agreed_at": 50, "ranks": [1], "healed": True, "source": 0,
         "entry": "rank 1 differs from ranks [0, 2] at parameter '0.weight'"},
        {"event": "nonfinite_skipped", "step": 80, "ranks": [2], "parameter": "0.weight", "micro_batch": 0}]
    text = "\n".join(summary_lines(now, [{}], None))
    assert "replica audit after step 60: rank 1 differs from ranks [0, 2] at parameter '0.weight'" in text
    assert "all agreed at step 50; healed" in text
    assert "step 80 skipped on every rank: a non-finite gradient on rank(s) [2] (0.weight)" in text
