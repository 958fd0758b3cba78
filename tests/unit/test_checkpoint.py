"""Checkpointer in one process: round trip, exact resume, keep-last-k, corruption, unsafe files.

Every test here is single-process (world size 1, no process group); the multi-rank behaviour, and a
save killed half-way by SIGKILL (a child process), are in tests/ranks/test_checkpoint.py.
"""

import os
import pickle
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.checkpoint import atomic_files, unwrap
from tests.conftest import warnings_of
from tests.helpers.checkpoint_state import make_net, make_state, train_step


def scramble_random_states():
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def params(model):
    return [p.detach().clone() for p in unwrap(model).parameters()]


def save_states(directory, count, keep=2):
    """Save `count` checkpoints one training step apart (committed when it returns); returns the parameters
    at each save."""
    state, saved = make_state(), []
    ckpt = px.Checkpointer(directory, keep=keep)
    for _ in range(count):
        train_step(state)
        ckpt.save(state)
        saved.append(params(state["model"]))
    ckpt.wait()
    return saved


class TestRoundTrip:
    def test_restore_fills_objects_and_plain_values(self, tmp_path):
        state = make_state()
        for _ in range(3):
            train_step(state)
        state["history"].append("saved")
        px.Checkpointer(tmp_path).save(state)

        fresh = make_state()
        fresh["model"] = make_net(seed=7)
        fresh["optimizer"] = torch.optim.Adam(fresh["model"].parameters(), lr=0.01)
        fresh["scheduler"] = torch.optim.lr_scheduler.StepLR(fresh["optimizer"], step_size=2)
        assert px.Checkpointer(tmp_path).restore(fresh) is True
        assert fresh["step"] == 3 and fresh["tag"] == "run-a" and fresh["history"] == [0.5, {"best": 1}, "saved"]
        assert all(torch.equal(a, b) for a, b in zip(params(fresh["model"]), params(state["model"])))
        assert fresh["scheduler"].state_dict() == state["scheduler"].state_dict()
        assert fresh["scaler"].state_dict() == state["scaler"].state_dict()
        want, got = state["optimizer"].state_dict(), fresh["optimizer"].state_dict()
        assert got["param_groups"] == want["param_groups"]
        for index, moments in want["state"].items():
            assert all(torch.equal(moments[k], got["state"][index][k]) for k in moments)

    def test_restore_without_checkpoint_returns_false_and_leaves_state(self, tmp_path):
        state = make_state()
        before = params(state["model"])
        assert px.Checkpointer(tmp_path / "never-written").restore(state) is False
        assert px.Checkpointer(tmp_path).restore(state) is False
        assert state["step"] == 0 and all(torch.equal(a, b) for a, b in zip(before, params(state["model"])))

    def test_file_holds_only_safe_types_and_unprefixed_model_keys(self, tmp_path):
        state = make_state()
        ckpt = px.Checkpointer(tmp_path)
        path = ckpt.save(state)
        ckpt.wait()
        payload = torch.load(path, weights_only=True)
        assert list(payload["entries"]["model"]["state"]) == list(state["model"].state_dict())
        assert payload["random_states"][0]["torch"].dtype == torch.uint8

    def test_resumed_dropout_training_equals_uninterrupted_bitwise(self, tmp_path):
        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        straight = make_state()
        for _ in range(8):
            train_step(straight)

        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        first = make_state()
        for _ in range(3):
            train_step(first)
        px.Checkpointer(tmp_path).save(first)
        scramble_random_states()
        resumed = make_state()
        assert px.Checkpointer(tmp_path).restore(resumed)
        while resumed["step"] < 8:
            train_step(resumed)
        assert all(torch.equal(a, b) for a, b in zip(params(resumed["model"]), params(straight["model"])))

    def test_keeps_the_last_k_with_increasing_sequence_numbers(self, tmp_path):
        save_states(tmp_path, 5, keep=3)
        names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
        assert names == ["ckpt-00000003.pt", "ckpt-00000004.pt", "ckpt-00000005.pt"]
        assert [p.name for p in px.Checkpointer(tmp_path).checkpoints()] == names

    def test_unsafe_value_is_refused_at_save_naming_the_entry(self, tmp_path):
        state = {"loss": np.float64(0.5)}
        with pytest.raises(px.CheckpointValueError, match=r"state\['loss'\].*float64.*\.item\(\)"):
            px.Checkpointer(tmp_path).save(state)
        assert not list(tmp_path.glob("ckpt-*"))

    def test_keep_must_be_positive(self, tmp_path):
        with pytest.raises(ValueError, match="keep=0"):
            px.Checkpointer(tmp_path, keep=0)


class TestDamagedFiles:
    @pytest.mark.parametrize("damage", ["truncate", "flip_byte", "delete"])
    def test_damaged_latest_falls_back_with_a_warning_naming_it(self, tmp_path, damage, log_records):
        saved = save_states(tmp_path, 2)
        latest = tmp_path / "ckpt-00000002.pt"
        data = latest.read_bytes()
        if damage == "truncate":
            latest.write_bytes(data[:len(data) // 2])
        elif damage == "flip_byte":
            latest.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
        else:
            latest.unlink()

        state = make_state()
        assert px.Checkpointer(tmp_path).restore(state) is True
        assert state["step"] == 1
        assert all(torch.equal(a, b) for a, b in zip(params(state["model"]), saved[0]))
        warnings = warnings_of(log_records)
        assert len(warnings) == 1 and str(latest) in warnings[0]
        assert {"truncate": "truncated", "flip_byte": "corrupted", "delete": "missing"}[damage] in warnings[0]

    def test_no_complete_checkpoint_left_is_an_error_not_a_fresh_start(self, tmp_path, log_records):
        save_states(tmp_path, 1, keep=1)
        latest = tmp_path / "ckpt-00000001.pt"
        latest.write_bytes(latest.read_bytes()[:100])
        with pytest.raises(px.CheckpointCorruptError, match="ckpt-00000001.pt: truncated"):
            px.Checkpointer(tmp_path).restore(make_state())

    def test_without_manifest_the_newest_loadable_file_is_used(self, tmp_path, log_records):
        save_states(tmp_path, 2)
        (tmp_path / "manifest.json").unlink()
        latest = tmp_path / "ckpt-00000002.pt"
        latest.write_bytes(latest.read_bytes()[:1000])
        state = make_state()
        assert px.Checkpointer(tmp_path).restore(state) and state["step"] == 1
        assert any(str(latest) in w for w in warnings_of(log_records))


class CreateMarker:
    """Unpickling this runs `touch marker`: what a planted checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(directory: Path, name: str, write) -> Path:
    """Put a file in the checkpoint directory and list it in the manifest, as an attacker could."""
    path = directory / name
    write(path)
    entries = atomic_files.read_manifest(directory)
    data = path.read_bytes()
    entries.append(atomic_files.ManifestEntry(name, atomic_files.sequence_of(name), len(data), zlib.crc32(data)))
    atomic_files.write_manifest(directory, entries)
    return path


class TestUnsafeFiles:
    @pytest.mark.parametrize("container", ["torch_zip", "raw_pickle"])
    def test_file_that_would_run_code_is_refused_and_nothing_runs(self, tmp_path, container):
        save_states(tmp_path, 1)
        marker = tmp_path / "code-ran"
        payload = {"format": 1, "entries": {}, "x": CreateMarker(marker)}
        if container == "torch_zip":
            path = plant(tmp_path, "ckpt-00000002.pt", lambda p: torch.save(payload, p))
        else:
            path = plant(tmp_path, "ckpt-00000002.pt", lambda p: p.write_bytes(pickle.dumps(payload, protocol=2)))

        with pytest.raises(px.UnsafeCheckpointError, match="system") as caught:
            px.Checkpointer(tmp_path).restore(make_state())
        assert caught.value.path == str(path) and "Nothing from the file was executed" in str(caught.value)
        assert not marker.exists()
        # The planted file is live: an unsafe load does run it (this is what was prevented above).
        if container == "torch_zip":
            torch.load(path, weights_only=False)
        else:
            pickle.loads(path.read_bytes())
        assert marker.exists()


class TestWrongModel:
    def test_other_model_gives_typed_error_with_key_lists(self, tmp_path):
        px.Checkpointer(tmp_path).save({"model": make_net(hidden=8), "step": 3})
        other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(16, 2), torch.nn.Linear(2, 2))
        with pytest.raises(px.CheckpointMismatchError) as caught:
            px.Checkpointer(tmp_path).restore({"model": other, "step": 0})
        error = caught.value
        assert error.entry == "model" and error.missing == ["4.weight", "4.bias"] and error.unexpected == []
        assert ("0.weight", (8, 4), (16, 4)) in error.mismatched and len(error.mismatched) == 3
        assert "4.weight" in str(error) and "0.weight: (8, 4) in the checkpoint, (16, 4) in the model" in str(error)

    def test_other_entries_give_typed_error_naming_them(self, tmp_path):
        px.Checkpointer(tmp_path).save({"model": make_net(), "step": 3})
        with pytest.raises(px.CheckpointMismatchError, match=r"missing entries \['epoch'\]") as caught:
            px.Checkpointer(tmp_path).restore({"model": make_net(), "epoch": 0})
        assert caught.value.missing == ["epoch"] and caught.value.unexpected == ["step"]

    def test_optimizer_of_another_model_gives_typed_error(self, tmp_path):
        net = make_net()
        px.Checkpointer(tmp_path).save({"optimizer": torch.optim.SGD(net.parameters(), lr=0.1)})
        lone = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        with pytest.raises(px.CheckpointMismatchError, match=r"state\['optimizer'\]"):
            px.Checkpointer(tmp_path).restore({"optimizer": lone})
