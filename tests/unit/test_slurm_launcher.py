"""`phalanx run` under srun, one task per node: the node count, node rank, master and port read from SLURM
(world/meeting/slurm.py) where the flags are unset. One process, synthetic environments."""

import pytest

from phalanx.errors import WorldConfigError
from phalanx.launch import run as launch
from phalanx.world.discovery import discover
from phalanx.world.meeting.slurm import launcher_nodes

# What srun sets in the task of node 1 of a 2-node step with one task per node (seen on a real cluster).
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1",
        "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[007-008]"}


class TestLauncherNodes:
    def test_a_step_with_one_task_per_node(self):
        nodes = launcher_nodes(STEP)
        assert (nodes.nnodes, nodes.node_rank, nodes.master_addr) == (2, 1, "gpu007")
        assert nodes.master_port == 15000 + 4242 == discover({**STEP, "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}).master_port

    def test_outside_an_srun_step(self):
        """The batch script itself has SLURM_PROCID and SLURM_NTASKS, but no step."""
        batch = {name: value for name, value in STEP.items() if not name.startswith("SLURM_STEP")}
        assert launcher_nodes(batch) is None and launcher_nodes({}) is None

    def test_several_tasks_on_a_node_is_an_error_that_says_what_to_do(self):
        with pytest.raises(WorldConfigError) as error:
            launcher_nodes({**STEP, "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"})
        assert "SLURM_STEP_TASKS_PER_NODE=4(x2)" in str(error.value) and "--ntasks-per-node=1" in str(error.value)


@pytest.fixture
def in_an_srun_step(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('training')\n")
    monkeypatch.chdir(tmp_path)
    for name, value in STEP.items():
        monkeypatch.setenv(name, value)


def parse(*argv):
    args = launch.build_parser().parse_args([*argv, "train.py"])
    return args, launch.check_args(args)


class TestPhalanxRunUnderSrun:
    def test_unset_flags_come_from_the_step(self, in_an_srun_step):
        args, (_, min_nodes, max_nodes) = parse("--nproc-per-node", "2")
        assert (min_nodes, max_nodes, args.node_rank) == (2, 2, 1)
        assert (args.master_addr, args.master_port) == ("gpu007", 15000 + 4242)
        assert "node 1 of 2, master gpu007:19242" in args.from_slurm

    def test_given_flags_win(self, in_an_srun_step):
        args, (_, min_nodes, max_nodes) = parse("--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
                                               "--master-port", "29400")
        assert (max_nodes, args.node_rank, args.master_addr, args.master_port) == (2, 0, "10.0.0.1", 29400)

    def test_a_one_node_step_stays_on_loopback(self, in_an_srun_step, monkeypatch):
        monkeypatch.setenv("SLURM_STEP_NUM_NODES", "1")
        monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1")
        monkeypatch.setenv("SLURM_NODEID", "0")
        args, (_, _, max_nodes) = parse()
        assert (max_nodes, args.node_rank, args.master_addr, args.from_slurm) == (1, 0, None, None)

    def test_outside_slurm_one_node(self, tmp_path, monkeypatch):
        (tmp_path / "train.py").write_text("")
        monkeypatch.chdir(tmp_path)
        for name in STEP:
            monkeypatch.delenv(name, raising=False)
        args, (_, _, max_nodes) = parse()
        assert (max_nodes, args.node_rank, args.from_slurm) == (1, 0, None)
