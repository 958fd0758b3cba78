"""World discovery from synthetic environments (unit tests: pure functions, no processes, no network)."""

import pytest

from phalanx.errors import WorldConfigError
from phalanx.world.discovery import WorldSpec, discover, parse_nodelist, parse_tasks_per_node


class TestSlurmNodeList:
    @pytest.mark.parametrize("nodelist, hosts", [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("a[01-02],b5", ["a01", "a02", "b5"]),
        ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
        ("gpu[001-002,010],cpu7", ["gpu001", "gpu002", "gpu010", "cpu7"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ])
    def test_expands_compressed_lists(self, nodelist, hosts):
        assert parse_nodelist(nodelist) == hosts

    @pytest.mark.parametrize("nodelist", ["n[3-1]", "n[1-2", "n[a-b]", ""])
    def test_malformed_lists_are_reported_with_the_list(self, nodelist):
        with pytest.raises(WorldConfigError) as error:
            parse_nodelist(nodelist)
        assert repr(nodelist) in str(error.value) or "empty" in str(error.value)

    @pytest.mark.parametrize("spec, counts", [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])])
    def test_tasks_per_node(self, spec, counts):
        assert parse_tasks_per_node(spec) == counts

    def test_malformed_tasks_per_node(self):
        with pytest.raises(WorldConfigError, match="tasks per node"):
            parse_tasks_per_node("2(3)")


SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "gpu[001-002]", "SLURM_JOB_ID": "4242",
         "SLURM_STEP_ID": "0"}


class TestSlurmWorld:
    def test_srun_task_becomes_a_rank(self):
        spec = discover(SLURM)
        assert (spec.rank, spec.world_size, spec.local_rank, spec.local_world_size) == (3, 4, 1, 2)
        assert (spec.master_addr, spec.source) == ("gpu001", "slurm")

    def test_the_batch_script_outside_srun_is_a_world_of_one(self):
        """sbatch's shell has the job's SLURM_PROCID=0 and SLURM_NTASKS, but no step: `python train.py` there is
        one process, not rank 0 of 4 waiting for three that never come."""
        batch = {name: value for name, value in SLURM.items() if name != "SLURM_STEP_ID"}
        assert discover({**batch, "SLURM_PROCID": "0"}).world_size == 1

    def test_every_task_of_a_job_derives_the_same_valid_port(self):
        ports = {discover({**SLURM, "SLURM_PROCID": str(r), "SLURM_NODEID": str(r // 2), "SLURM_LOCALID": str(r % 2)})
                 .master_port for r in range(4)}
        assert len(ports) == 1 and 1024 < ports.pop() <= 65535

    def test_uneven_tasks_per_node(self):
        env = {**SLURM, "SLURM_NTASKS": "7", "SLURM_PROCID": "6", "SLURM_NODEID": "3", "SLURM_LOCALID": "0",
               "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "n[1-4]"}
        assert discover(env).local_world_size == 1

    def test_explicit_master_wins(self):
        spec = discover({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "12345"})
        assert (spec.master_addr, spec.master_port) == ("head", 12345)

    def test_rank_outside_the_job_is_named(self):
        with pytest.raises(WorldConfigError) as error:
            discover({**SLURM, "SLURM_PROCID": "4"})
        assert "SLURM_PROCID" in str(error.value) and "4" in str(error.value)


LAUNCHER = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


class TestLauncherWorld:
    def test_torchrun_variables(self):
        assert discover(LAUNCHER) == WorldSpec(1, 4, 1, 2, "10.0.0.1", 29500, "launcher")

    def test_agent_hosted_store_is_noticed(self):
        assert discover({**LAUNCHER, "TORCHELASTIC_USE_AGENT_STORE": "True"}).agent_store

    def test_launcher_variables_win_over_slurm(self):
        # `srun torchrun ...`: the workers see both, and torchrun's are the ones that describe them.
        assert discover({**SLURM, **LAUNCHER}).source == "launcher"

    def test_nothing_is_a_world_of_one(self):
        assert discover({}) == WorldSpec(0, 1, 0, 1, None, None, "single")

    @pytest.mark.parametrize("changes, variable, seen", [
        ({"RANK": "4"}, "RANK", "RANK=4"),
        ({"RANK": "-1"}, "RANK", "-1"),
        ({"WORLD_SIZE": "-2"}, "WORLD_SIZE", "-2"),
        ({"RANK": "one"}, "RANK", "'one'"),
        ({"WORLD_SIZE": "4.0"}, "WORLD_SIZE", "'4.0'"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK", "LOCAL_RANK=2"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR", "nothing"),
        ({"MASTER_PORT": None}, "MASTER_PORT", "nothing"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT", "70000"),
        ({"WORLD_SIZE": None}, "WORLD_SIZE", "RANK='1'"),
    ])
    def test_bad_environment_names_variable_value_and_fix(self, changes, variable, seen):
        env = {k: v for k, v in {**LAUNCHER, **changes}.items() if v is not None}
        with pytest.raises(WorldConfigError) as error:
            discover(env)
        message = str(error.value)
        assert variable in message and seen in message and "expected" in message
