"""The `phalanx` command and `phalanx run`'s flags, checked in this process (unit tests, no workers)."""

import sys
import types

import pytest

from phalanx import cli
from phalanx.launch import run as launch
from phalanx.world.group import usable_cores


@pytest.fixture(autouse=True)
def in_a_folder_with_train_py(tmp_path, monkeypatch):
    for name in ("train.py", "x.py"):
        (tmp_path / name).write_text("print('training')\n")
    monkeypatch.chdir(tmp_path)


def parse(*argv):
    args = launch.build_parser().parse_args(list(argv))
    return args, launch.check_args(args)


class TestRunFlags:
    def test_torchrun_spellings_are_both_accepted(self):
        dashed, _ = parse("--nproc-per-node", "2", "--node-rank", "0", "--master-port", "1234", "--max-restarts", "3",
                          "train.py")
        underscored, _ = parse("--nproc_per_node", "2", "--node_rank", "0", "--master_port", "1234",
                               "--max_restarts", "3", "train.py")
        assert vars(dashed) == vars(underscored)
        assert (dashed.nproc_per_node, dashed.master_port, dashed.max_restarts) == ("2", 1234, 3)

    def test_script_arguments_are_passed_through_untouched(self):
        args, _ = parse("--nproc-per-node", "2", "train.py", "--lr", "0.1", "--nproc-per-node", "9")
        assert (args.target, args.args, args.module) == ("train.py", ["--lr", "0.1", "--nproc-per-node", "9"], False)

    def test_module_mode(self):
        args, _ = parse("-m", "pkg.train", "--epochs", "1")
        assert (args.module, args.target, args.args) == (True, "pkg.train", ["--epochs", "1"])
        assert launch._worker_command(args)[1][-4:] == ("-m", "pkg.train", "--epochs", "1")

    def test_auto_is_gpus_else_cores_at_most_eight(self):
        import torch

        expected = torch.cuda.device_count() if torch.cuda.is_available() else min(usable_cores(), 8)
        assert parse("--nproc-per-node", "auto", "x.py")[1][0] == expected

    def test_nnodes_range(self):
        assert parse("--nnodes", "1:4", "--master-addr", "h0", "x.py")[1][1:] == (1, 4)
        assert parse("--nnodes", "3", "--master-addr", "h0", "--node-rank", "2", "x.py")[1][1:] == (3, 3)

    def test_live_recovery_is_on_under_a_node_range_and_off_for_a_fixed_world(self):
        """--nnodes MIN:MAX already allows the run to go on smaller: MIN nodes' ranks is the default minimum."""
        ranged = ("--nnodes", "2:4", "--nproc-per-node", "3", "--master-addr", "h0", "x.py")
        assert parse(*ranged)[0].min_world_size == 6
        assert parse("--min-world-size", "4", *ranged)[0].min_world_size == 4
        assert parse("--min-world-size", "0", *ranged)[0].min_world_size is None  # off: the restart, as before
        assert parse("--nproc-per-node", "3", "x.py")[0].min_world_size is None
        assert parse("--nproc-per-node", "3", "--min-world-size", "2", "x.py")[0].min_world_size == 2

    def test_timeouts_nest_under_live_recovery(self, monkeypatch, capsys):
        """The launcher's stall watch outlasts the survivors' agreement, which outlasts DDP's stall timeout."""
        from phalanx.world.generation import membership_timeout

        monkeypatch.delenv("PHALANX_STALL_TIMEOUT", raising=False)
        monkeypatch.delenv("PHALANX_MEMBERSHIP_TIMEOUT", raising=False)
        monkeypatch.setenv("PHALANX_DDP_STALL_TIMEOUT", "300")
        assert membership_timeout() == 330
        ranged = ("--nnodes", "2:4", "--master-addr", "h0", "x.py")
        assert parse(*ranged)[0].stall_timeout == 360
        assert parse("--min-world-size", "0", *ranged)[0].stall_timeout == 300  # off: as before
        monkeypatch.setenv("PHALANX_DDP_STALL_TIMEOUT", "600")
        assert parse(*ranged)[0].stall_timeout == 660
        assert parse("--stall-timeout", "120", *ranged)[0].stall_timeout == 120  # given: kept, and warned about
        assert "--stall-timeout 120 s is not above the survivors' agreement" in capsys.readouterr().err
        monkeypatch.setenv("PHALANX_MEMBERSHIP_TIMEOUT", "50")
        assert membership_timeout() == 50

    @pytest.mark.parametrize("argv, named, seen", [
        (["--nproc-per-node", "0"], "--nproc-per-node", "'0'"),
        (["--nproc-per-node", "many"], "--nproc-per-node", "'many'"),
        (["--nnodes", "3:2", "--master-addr", "h"], "--nnodes", "'3:2'"),
        (["--nnodes", "2"], "--master-addr", "--nnodes 2"),
        (["--nnodes", "2", "--master-addr", "h", "--node-rank", "2"], "--node-rank", "2"),
        (["--max-restarts", "-1"], "--max-restarts", "-1"),
        (["--nproc-per-node", "2", "--min-world-size", "3"], "--min-world-size", "3"),
        (["--nproc-per-node", "2", "--min-world-size", "-1"], "--min-world-size", "-1"),
        (["--master-port", "70000"], "--master-port", "70000"),
        (["--rdzv-last-call", "0"], "--rdzv-last-call", "0"),
        (["--nproc-per-node", "2", "missing.py"], "script does not exist", "'missing.py'"),
    ])
    def test_bad_flag_names_flag_and_value(self, argv, named, seen):
        with pytest.raises(ValueError) as error:
            parse(*argv) if argv[-1].endswith(".py") else parse(*argv, "x.py")
        assert named in str(error.value) and seen in str(error.value)

    def test_bad_flag_exits_with_usage_error(self, capsys):
        with pytest.raises(SystemExit) as exit_info:
            launch.run(["--nproc-per-node", "zero", "x.py"])
        assert exit_info.value.code == 2
        assert "--nproc-per-node" in capsys.readouterr().err

    def test_help_explains_every_flag(self):
        text = launch.build_parser().format_help()
        for flag in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                     "--max-restarts", "--log-dir", "--monitor-interval", "--rdzv-last-call", "-m"):
            assert flag in text


class TestCommand:
    def test_help_lists_the_subcommands(self, capsys):
        assert cli.main(["--help"]) == 0
        out = capsys.readouterr().out
        assert all(name in out for name in ("run", "demo", "bench"))

    def test_unknown_command_is_a_usage_error(self, capsys):
        assert cli.main(["train"]) == 2
        assert "unknown command 'train'" in capsys.readouterr().err

    @pytest.mark.parametrize("name, module", [("demo", "phalanx.tools.demo.command"), ("bench", "phalanx.tools.bench")])
    def test_demo_and_bench_dispatch_lazily_with_their_arguments(self, monkeypatch, name, module):
        calls = []
        fake = types.ModuleType(module)
        fake.main = lambda argv: calls.append(argv) or 0
        monkeypatch.setitem(sys.modules, module, fake)
        assert cli.main([name, "--steps", "3"]) == 0
        assert calls == [["--steps", "3"]]


class TestForkServerEnvironment:
    """launch/worker_entry.read_at_import: which differences from the fork server's environment make a worker
    start a fresh interpreter instead of a fork."""

    def test_the_names_torch_elastic_and_phalanx_set_per_worker_keep_the_fork(self):
        from phalanx.launch.worker_entry import read_at_import
        server = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
        worker = {**server, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "1234",
                  "TORCHELASTIC_ERROR_FILE": "/tmp/e.json", "PHALANX_ATTEMPT": "2", "CUDA_VISIBLE_DEVICES": "1",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
        assert read_at_import(worker, server) == []

    def test_a_variable_read_at_import_that_differs_appears_added_or_removed(self):
        from phalanx.launch.worker_entry import read_at_import
        server = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}
        worker = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "LD_PRELOAD": "/lib/libtcmalloc.so"}
        assert read_at_import(worker, server) == ["LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH"]
