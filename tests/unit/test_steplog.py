"""StepLog in one process (a world of one, no init): the record's arithmetic, the busy time that leaves out
waits for peers and counts the loader's, steps.jsonl and TensorBoard written, trimmed and purged on resume,
tensorboardX optional, `phalanx report`'s PNG, and `phalanx run`'s status line. Three ranks:
tests/ranks/test_steplog.py; across SIGTERMs: tests/e2e/test_stop.py.
"""

import ast
import io
import json
import sys
import time
from collections import deque
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.diagnose import step_clock
from phalanx.launch import live_status
from phalanx.observe import outputs, report
from phalanx.observe.window import FIELDS, INDEX, line, make_record
from phalanx.world import step_count

ROOT = Path(__file__).resolve().parents[2]


def row(**values):
    out = [0.0] * len(FIELDS)
    for name, value in values.items():
        out[INDEX[name]] = value
    return out


class TestRecord:

    def test_fields_over_ranks(self):
        rows = [row(steps=4, end_step=8, loss_sum=4.0, samples=8, busy_s=0.4, wall_s=1.0, wait_s=0.6, data_s=0.04,
                    peak_memory=3e9),
                row(steps=4, end_step=8, loss_sum=30.0, samples=12, busy_s=1.0, wall_s=1.0, peak_memory=1e9),
                row(steps=4, end_step=8, loss_sum=6.0, samples=20, busy_s=0.5, wall_s=1.0, wait_s=0.5, peak_memory=2e9)]
        r = make_record(rows, lr=0.1, now=5.0)
        assert r["step"] == 8 and r["steps"] == 4 and r["samples"] == 40
        assert r["loss"] == pytest.approx(40.0 / 40)  # over samples, not the mean of the ranks' means
        assert r["samples_per_s"] == pytest.approx(40.0)
        assert (r["step_time_min"], r["step_time_median"], r["step_time_max"]) == pytest.approx((0.1, 0.125, 0.25))
        assert r["slowest_rank"] == 1 and r["peak_memory_rank"] == 0 and r["peak_memory"] == 3e9
        assert r["exchange_exposed"] == pytest.approx((0.6 + 0.0 + 0.5) / 3)
        assert r["data_wait"] == pytest.approx(0.01 / 3)
        assert r["tokens_per_s"] is None and r["mfu"] is None and r["peak_flops"] is None and r["lr"] == 0.1
        assert json.loads(json.dumps(r)) == r
        assert "slowest rank 1" in line(r) and "lr 0.1" in line(r)

    def test_mfu_only_with_model_flops_and_device_peak(self):
        rows = [row(steps=1, end_step=1, loss_sum=1.0, samples=2, tokens=100, tokens_given=1, wall_s=1.0)] * 2
        assert make_record(rows, flops_per_token=6e6)["mfu"] is None  # no peak: no guess
        assert make_record(rows, peak_flops=1e9)["mfu"] is None  # no model FLOPs
        assert make_record(rows, peak_flops=1e9)["peak_flops"] == 2e9  # the denominator, logged when known
        record = make_record(rows, flops_per_token=6e6, peak_flops=1e9)
        assert record["tokens_per_s"] == 200.0 and record["mfu"] == pytest.approx(6e6 * 200 / 2e9)
        assert make_record(rows, flops_per_sample=1e8, peak_flops=1e9)["mfu"] == pytest.approx(1e8 * 4 / 2e9)

    def test_tokens_per_s_needs_every_rank_to_pass_tokens(self):
        rows = [row(steps=1, samples=1, tokens=10, tokens_given=1, wall_s=1.0), row(steps=1, samples=1, wall_s=1.0)]
        assert make_record(rows)["tokens_per_s"] is None

    def test_a_diverged_loss_is_null_in_json(self):
        record = make_record([row(steps=1, samples=1, loss_sum=float("nan"), wall_s=1.0)])
        assert record["loss"] is None and "loss nan" in line(record)


def train(log, steps, sleep=0.0, waited=0.0):
    model = torch.nn.Linear(3, 1)
    for _ in range(steps):
        time.sleep(sleep)
        if waited:
            with step_clock.waiting_for_peers():  # as the step guard times its waits
                time.sleep(waited)
        loss = model(torch.randn(4, 3)).pow(2).mean()
        log.step(loss=loss, samples=4)


class TestWorldOfOne:

    def test_records_every_n_and_a_shorter_one_at_close(self, tmp_path, capsys):
        log = px.StepLog(tmp_path, every=3, tensorboard=False)
        train(log, 7)
        log.close()
        records = outputs.read_records(tmp_path / "steps.jsonl")
        assert [(r["step"], r["steps"], r["samples"]) for r in records] == [(3, 3, 12), (6, 3, 12), (7, 1, 4)]
        assert capsys.readouterr().out.count("step ") >= 3

    def test_busy_time_leaves_out_waits_for_peers(self, tmp_path):
        log = px.StepLog(tmp_path, every=4, tensorboard=False)
        train(log, 4, sleep=0.005)
        train(log, 4, sleep=0.005, waited=0.1)  # each step also waits 100 ms for (imagined) peers
        log.close()
        first, second = outputs.read_records(tmp_path / "steps.jsonl")
        assert second["step_time"] >= 0.1 > first["step_time"]  # the wall time per step includes the wait
        assert second["exchange_exposed"] > 0.6 > first["exchange_exposed"]
        assert second["step_time_max"] < 0.1  # the busy time does not: the rank did its own work as fast

    def test_data_wait_is_time_in_phalanx_loader(self, tmp_path):
        class Slow(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                time.sleep(0.01)
                return torch.ones(3)

        sampler = px.DistributedSampler(Slow(), num_replicas=1, rank=0, shuffle=False)
        log = px.StepLog(tmp_path, every=4, tensorboard=False)
        for x in px.DataLoader(Slow(), batch_size=2, sampler=sampler):
            log.step(loss=float(x.sum()), samples=len(x))
        log.close()
        (record,) = outputs.read_records(tmp_path / "steps.jsonl")
        assert record["data_wait"] >= 0.015  # 2 samples x 10 ms per step
        assert record["loss"] == pytest.approx(3.0 * 2)  # a float loss: the sum of its batch, per sample 6.0

    def test_resume_trims_jsonl_and_purges_tensorboard(self, tmp_path):
        pytest.importorskip("tensorboardX")
        from phalanx.observe.tb_events import read_scalars

        log = px.StepLog(tmp_path, every=2)
        train(log, 10)
        saved = {"steps": 6}  # as if a checkpoint was taken at step 6, and 4 more steps were run before a kill
        log.close()
        resumed = px.StepLog(tmp_path, every=2)
        resumed.load_state_dict(saved)
        assert [r["step"] for r in outputs.read_records(tmp_path / "steps.jsonl")] == [2, 4, 6]
        train(resumed, 4)
        resumed.close()
        assert [r["step"] for r in outputs.read_records(tmp_path / "steps.jsonl")] == [2, 4, 6, 8, 10]
        shown = read_scalars(tmp_path)["train/loss"]
        assert sorted(shown) == [2, 4, 6, 8, 10] and all(len(v) == 1 for v in shown.values())
        jsonl = {r["step"]: r["loss"] for r in outputs.read_records(tmp_path / "steps.jsonl")}
        assert all(shown[s][0] == pytest.approx(jsonl[s], rel=1e-6) for s in shown)  # the resumed run's values

    def test_a_log_not_told_its_step_keeps_the_records_and_starts_a_file_beside_them(self, tmp_path, caplog):
        """A fresh run in the same folder, with no checkpoint restored and the log in no state: it cannot know its
        step, so it never rewrites the earlier records under its own numbers (one warning names the file)."""
        first = px.StepLog(tmp_path, every=1, tensorboard=False)
        train(first, 3)
        first.close()
        log = px.StepLog(tmp_path, every=1, tensorboard=False)
        train(log, 2)
        log.close()
        assert [r["step"] for r in outputs.read_records(tmp_path / "steps.jsonl")] == [1, 2, 3]
        assert [r["step"] for r in outputs.read_records(tmp_path / "steps.2.jsonl")] == [1, 2]
        warned = [r.getMessage() for r in caplog.records if "holds the records of an earlier run" in r.getMessage()]
        assert len(warned) == 1 and str(tmp_path / "steps.jsonl") in warned[0], warned
        assert report.find_jsonl(tmp_path) == tmp_path / "steps.2.jsonl"  # `phalanx report` draws the newest

    def test_a_line_cut_by_a_kill_is_skipped(self, tmp_path):
        (tmp_path / "steps.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
        assert outputs.read_records(tmp_path / "steps.jsonl") == [{"step": 1, "loss": 1.0}]
        assert outputs.trim(tmp_path / "steps.jsonl", 5) == 0
        assert (tmp_path / "steps.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'

    def test_lr_from_the_optimizer(self, tmp_path):
        model = torch.nn.Linear(2, 1)
        log = px.StepLog(tmp_path, every=1, optimizer=torch.optim.SGD(model.parameters(), lr=0.25), tensorboard=False)
        log.step(loss=torch.tensor(1.0), samples=1)
        log.close()
        assert outputs.read_records(tmp_path / "steps.jsonl")[0]["lr"] == 0.25

    def test_wrong_arguments_are_typed_errors(self, tmp_path):
        with pytest.raises(px.StepLogError, match="every"):
            px.StepLog(tmp_path, every=0)
        log = px.StepLog(tmp_path, every=1, tensorboard=False)
        with pytest.raises(px.StepLogError, match="samples"):
            log.step(loss=1.0, samples=-1)
        with pytest.raises(px.StepLogError, match="loss"):
            log.step(loss="high", samples=1)


def without_tensorboardx(monkeypatch):
    """Every tensorboardX module unimportable, as on an install without the log extra."""
    for name in [n for n in sys.modules if n.startswith("tensorboardX")] + ["tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)


class TestTensorBoardIsOptional:

    def test_import_phalanx_does_not_import_tensorboardx(self):
        for path in (ROOT / "phalanx").rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            names = [a.name for n in top for a in n.names]
            names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
            assert not any(name.startswith("tensorboard") for name in names), path

    def test_asked_for_without_it_is_a_typed_error(self, tmp_path, monkeypatch):
        without_tensorboardx(monkeypatch)
        with pytest.raises(px.TensorBoardUnavailableError, match="pip install"):
            px.StepLog(tmp_path, every=1, tensorboard=True)

    def test_by_default_without_it_a_warning_once_and_the_rest_works(self, tmp_path, monkeypatch, caplog):
        without_tensorboardx(monkeypatch)
        monkeypatch.setattr(outputs, "_warned", False)
        px.logger.propagate = True  # caplog listens at the root
        try:
            for _ in range(2):
                log = px.StepLog(tmp_path, every=1)
                log.step(loss=1.0, samples=1)
                log.close()
        finally:
            px.logger.propagate = False
        assert caplog.text.count("tensorboardX is not installed") == 1
        assert not list(tmp_path.glob("events.out.tfevents.*"))
        assert len(outputs.read_records(tmp_path / "steps.jsonl")) == 1


class TestReport:

    def test_draws_a_png_from_steps_jsonl(self, tmp_path, capsys):
        pytest.importorskip("matplotlib")
        log = px.StepLog(tmp_path / "run" / "log", every=2, tensorboard=False)
        train(log, 8)
        log.close()
        assert report.main([str(tmp_path / "run")]) == 0
        assert (tmp_path / "run" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "4 records" in capsys.readouterr().out

    def test_clear_errors(self, tmp_path, monkeypatch, capsys):
        assert report.main([str(tmp_path)]) == 2
        assert "no steps.jsonl" in capsys.readouterr().err
        (tmp_path / "steps.jsonl").write_text(json.dumps(make_record([row(steps=1, samples=1, wall_s=1.0)])) + "\n")
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        assert report.main([str(tmp_path)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err


class TestLiveStatus:

    def test_text(self):
        assert live_status.describe(10, 0, deque()) == "phalanx: step 10"
        assert live_status.describe(20, 0, deque([(0.0, 10), (20.0, 20)])) == "phalanx: step 20 | 2.0 s/step"
        assert live_status.describe(150, 1000, deque([(0.0, 100), (10.0, 150)])).endswith("ETA 2m50s")

    def test_lines_written_clear_the_status_and_draw_it_again(self):
        terminal = io.StringIO()
        status = live_status.LiveStatus(terminal)
        keeper = live_status._Keeper(terminal, status)
        status.text = "phalanx: step 5"
        status._draw()
        keeper.write("[rank 0] hello\n")
        assert terminal.getvalue() == ("\r\x1b[Kphalanx: step 5" "\r\x1b[K" "[rank 0] hello\n"
                                       "\r\x1b[Kphalanx: step 5")

    def test_only_on_a_terminal(self, monkeypatch):
        assert not live_status.wanted(io.StringIO())


def covered_steps(directory) -> list[int]:
    """Every step the records of steps.jsonl cover, in order: a record covers `steps` steps ending at `step`."""
    return [step for record in outputs.read_records(Path(directory) / "steps.jsonl")
            for step in range(record["step"] - record["steps"] + 1, record["step"] + 1)]


class TestFollowsTheCheckpointer:
    """A StepLog that is not in the checkpoint's state follows Checkpointer.restore() and its saves (world of one)."""

    @staticmethod
    def run(directory, steps, *, log_every=10, save_every=50, stop=False, log_after_restore=False):
        """Train until `steps` steps are done, resuming from the newest checkpoint; `stop`: save and close at the
        end (an agreed stop), else end as a kill would (nothing flushed or saved)."""
        step_count.forget()  # a new process: nothing restored yet
        model = torch.nn.Linear(3, 1)
        state = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}
        make_log = lambda: px.StepLog(directory / "log", every=log_every, tensorboard=False, print_every=0)
        log = None if log_after_restore else make_log()
        checkpointer = px.Checkpointer(directory / "ckpt", every=save_every, async_save=False)
        checkpointer.restore(state)
        log = log or make_log()
        assert log.steps == checkpointer.steps
        while checkpointer.steps < steps:
            loss = model(torch.randn(4, 3)).pow(2).mean()
            loss.backward()
            state["optimizer"].step()
            state["optimizer"].zero_grad()
            log.step(loss=loss, samples=4)
            checkpointer.step(state)
        if stop:
            checkpointer.save(state)
            log.close()
        else:
            log._closed = True  # killed: what was not written is lost, as in a process that ends here

    def test_a_stop_and_resume_logs_every_step_once_under_its_number(self, tmp_path):
        """The issue's case: stopped at step 153, resumed to 300, the log not in the state."""
        self.run(tmp_path, 153, stop=True)
        first = [r["step"] for r in outputs.read_records(tmp_path / "log" / "steps.jsonl")]
        assert first[-2:] == [150, 153], first
        self.run(tmp_path, 300)
        records = outputs.read_records(tmp_path / "log" / "steps.jsonl")
        assert [r["step"] for r in records][:len(first)] == first  # the first run's records are all there
        assert covered_steps(tmp_path / "log") == list(range(1, 301))

    @pytest.mark.parametrize("log_after_restore", [False, True], ids=["made-before-restore", "made-after-restore"])
    def test_a_kill_and_resume_trims_what_is_redone_and_logs_every_step_once(self, tmp_path, log_after_restore):
        """Saves every 25 steps, a record every 10: killed at step 37 (records to 30 written), resumed from 25. The
        save ended a window at 25, so the records kept end there and the resumed run's begin after it."""
        self.run(tmp_path, 37, save_every=25)
        assert [r["step"] for r in outputs.read_records(tmp_path / "log" / "steps.jsonl")] == [10, 20, 25, 30]
        self.run(tmp_path, 60, save_every=25, stop=True, log_after_restore=log_after_restore)
        assert covered_steps(tmp_path / "log") == list(range(1, 61))
        assert [r["step"] for r in outputs.read_records(tmp_path / "log" / "steps.jsonl")] == [
            10, 20, 25, 30, 40, 50, 60]
