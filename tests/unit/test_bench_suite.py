"""The benchmark suite's harness (phalanx/tools/bench_suite.py) and its registry (benchmarks/scenarios.py), without
running a benchmark.

World size: none (one process). No process starts: the scenarios' processes are stand-ins (FakeProcess).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from phalanx.errors import BenchConfigError
from phalanx.tools import bench_suite
from phalanx.tools.bench_compare import interleave, paired_ratio, rotated, write_figures
from phalanx.tools.bench_suite import NEEDS, in_suite

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = bench_suite.registry(ROOT)
SCENARIOS, Scenario = REGISTRY.SCENARIOS, REGISTRY.Scenario


def test_every_scenario_is_named_area_dot_what_once_and_writes_its_figures():
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names)), f"scenario names repeat: {sorted(n for n in names if names.count(n) > 1)}"
    for s in SCENARIOS:
        assert re.fullmatch(r"[a-z_]+\.[a-z0-9_]+", s.name), f"{s.name}: not area.what"
        assert any("{json}" in part for part in s.argv), f"{s.name}: its command writes no figures ({{json}})"
        assert set(s.needs) <= set(NEEDS), f"{s.name}: unknown needs {set(s.needs) - set(NEEDS)}"
        assert s.expect_s < s.timeout_s, f"{s.name}: expected {s.expect_s} s, timeout {s.timeout_s} s"


def test_every_scenario_runs_a_script_or_module_that_exists_and_defines_json():
    for s in SCENARIOS:
        if s.argv[0] == "-m":
            source = ROOT / (s.argv[1].replace(".", "/") + ".py")
        else:
            source = ROOT / s.argv[0]
        assert source.exists(), f"{s.name} runs {source}, which does not exist"
        flag = "--json" if s.argv[0] != "-m" else "--out"
        assert f'"{flag}"' in source.read_text() or (flag == "--json" and "add_json_flag" in source.read_text()), \
            f"{s.name}: {source.name} does not define {flag}"


def test_the_cpu_suite_fits_2_cores_in_20_minutes_and_the_gpu_suite_is_the_rest():
    cpu, gpu = in_suite(SCENARIOS, "cpu"), in_suite(SCENARIOS, "gpu")
    assert sum(s.expect_s for s in cpu) < 20 * 60, f"the CPU suite expects {sum(s.expect_s for s in cpu):.0f} s"
    assert {s.name for s in cpu} | {s.name for s in gpu} == {s.name for s in SCENARIOS}
    assert all("cuda" in s.needs for s in gpu) and not any("cuda" in s.needs for s in cpu)


def test_an_unknown_scenario_is_a_typed_error_listing_the_known_ones():
    with pytest.raises(BenchConfigError) as error:
        bench_suite.select(SCENARIOS, "cpu", "exchange.floor,exchange.nope")
    assert "exchange.nope" in str(error.value) and "host.overhead" in str(error.value)
    with pytest.raises(BenchConfigError, match="--suite all"):
        bench_suite.select(SCENARIOS, "cpu", "gpu.audit")
    assert [s.name for s in bench_suite.select(SCENARIOS, "cpu", "host.overhead, exchange.floor")] == \
        ["exchange.floor", "host.overhead"]  # the registry's order


def _scenario(name: str, needs=()) -> Scenario:
    return Scenario(name, (f"benchmarks/{name}.py", "--json", "{json}"), "a test", 0.1, needs, 30.0)


class FakeProcess:
    """Stands in for a scenario's process: prints `output`, writes `figures` to its --json path, exits with `code`;
    `hangs`: runs until signalled."""

    def __init__(self, command, cwd, env, log, code=0, output="", figures=None, hangs=False):
        self.code, self.hangs, self.signals, self.returncode = code, hangs, [], None
        self.env = env
        log.write(output)
        if figures is not None:
            Path(command[command.index("--json") + 1]).write_text(json.dumps({"figures": figures}))

    def wait(self, timeout):
        if self.hangs and not self.signals:
            raise subprocess.TimeoutExpired("scenario", timeout)
        self.returncode = -self.signals[0] if self.signals else self.code
        return self.returncode

    def signal_all(self, sig):
        self.signals.append(sig)


def fake(**behaviour):
    started = []

    def start(command, cwd, env, log):
        started.append(FakeProcess(command, cwd, env, log, **behaviour.get(Path(command[1]).stem, {})))
        return started[-1]
    start.started = started
    return start


def test_a_scenario_that_writes_figures_is_ok_and_its_figures_are_read(tmp_path):
    start = fake(ok={"figures": {"a/b": 0.5, "n": 3}})
    outcome = bench_suite.run_scenario(_scenario("ok"), tmp_path, tmp_path / "out", 30, start=start)
    assert (outcome.status, outcome.figures) == ("ok", {"a/b": 0.5, "n": 3}), outcome
    assert start.started[0].env["OMP_NUM_THREADS"] == "1"  # one intra-op thread per process


def test_a_failing_scenario_is_reported_with_its_output_not_raised(tmp_path):
    start = fake(fails={"code": 3, "output": "the model diverged\n"})
    outcome = bench_suite.run_scenario(_scenario("fails"), tmp_path, tmp_path / "out", 30, start=start)
    assert outcome.status == "failed" and outcome.reason == "exit code 3", outcome
    assert "the model diverged" in outcome.tail
    start = fake(quiet={"output": "done, but no figures"})
    outcome = bench_suite.run_scenario(_scenario("quiet"), tmp_path, tmp_path / "out", 30, start=start)
    assert outcome.status == "failed" and "no figures" in outcome.reason, outcome


def test_a_scenario_past_its_timeout_is_stopped_whole_and_reported(tmp_path):
    start = fake(slow={"hangs": True})
    outcome = bench_suite.run_scenario(_scenario("slow"), tmp_path, tmp_path / "out", 0.01, start=start)
    assert outcome.status == "timed out" and start.started[0].signals == [bench_suite.signal.SIGTERM], outcome


def test_a_scenario_whose_machine_is_missing_is_skipped_with_the_reason(tmp_path):
    start = fake()
    outcome = bench_suite.run_scenario(_scenario("root", needs=("root", "tc")), tmp_path, tmp_path / "out", 30,
                                       have=lambda need: need == "root", start=start)
    assert outcome.status == "skipped" and outcome.reason == f"needs {NEEDS['tc']}", outcome
    assert not start.started


def test_the_suite_goes_on_past_a_failure_and_writes_one_json_and_one_markdown(tmp_path):
    scenarios = [_scenario("fails"), _scenario("ok")]
    start = fake(fails={"code": 2}, ok={"figures": {"a/b": 0.5, "n": 3}})
    said: list[str] = []
    out = tmp_path / "suite"
    summary = bench_suite.run_suite(scenarios, tmp_path, out, "cpu", say=said.append, start=start)
    assert [row["status"] for row in summary["scenarios"]] == ["failed", "ok"]
    assert any("[suite 2/2] ok" in line and "ETA" in line for line in said), said
    assert json.loads(out.with_suffix(".json").read_text())["scenarios"][1]["figures"] == {"a/b": 0.5, "n": 3}
    table = out.with_suffix(".md").read_text()
    assert "| `ok` | a/b 0.5; n 3 |" in table and "| `fails` | - |" in table and "failed: exit code 2" in table
    # --only: the rerun replaces its own row and keeps the other's
    rerun = bench_suite.run_suite(scenarios[:1], tmp_path, out, "cpu", say=said.append, keep=bench_suite._earlier(out),
                                  order=["fails", "ok"], start=start)
    assert [row["name"] for row in rerun["scenarios"]] == ["fails", "ok"]


def test_the_command_line_lists_and_refuses_unknown_names(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert bench_suite.main(["--suite", "cpu", "--list"]) == 0
    assert "exchange.ddp_vs_torch" in capsys.readouterr().out
    assert bench_suite.main(["--suite", "cpu", "--only", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_interleaved_blocks_rotate_and_ratios_pair_rounds(tmp_path):
    order: list[str] = []
    interleave(["a", "b", "c"], 3, order.append)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rotated(["on", "off"], 1) == ["off", "on"]
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0
    write_figures(tmp_path / "f.json", {"x": 1}, raw=[1, 2])
    assert json.loads((tmp_path / "f.json").read_text()) == {"figures": {"x": 1}, "raw": [1, 2]}
    write_figures(None, {"x": 1})  # no path: nothing written, no error


def test_a_scenario_runs_with_the_checkout_on_the_path_and_none_of_the_callers_phalanx_settings(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("PHALANX_SHM", "0")
    env = bench_suite.scenario_env(tmp_path)
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path) and env["OMP_NUM_THREADS"] == "1"
    assert "PHALANX_SHM" not in env
