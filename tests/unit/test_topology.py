"""Host topology (world/topology.py): a host is the launcher's node, and when the two-level exchange applies.

Single process, synthetic environments and gathered keys."""

import pytest

from phalanx.errors import WorldConfigError
from phalanx.shm.segment import new_segment_name, segment_host
from phalanx.world.topology import host_key, topology_from_keys, xhost_choice


def test_host_is_the_launchers_node_not_the_machine_name():
    assert host_key({"GROUP_RANK": "1", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == "node1"
    assert host_key({"SLURM_NODEID": "2", "SLURM_PROCID": "5", "SLURM_STEP_ID": "0"}) == "node2"
    assert host_key({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6"}) == "first-rank4"
    assert host_key({"RANK": "5", "WORLD_SIZE": "6"}) == "first-rank0"  # LOCAL_RANK defaults as in discovery
    assert host_key({}) == "node0"


def _keys(hosts, choice="auto"):
    return [(f"node{h}", choice) for h in hosts]


def test_ranks_grouped_by_host_in_order_of_their_lowest_rank():
    topology = topology_from_keys(_keys([1, 1, 0, 0]), 3)
    assert topology.hosts == ((0, 1), (2, 3))
    assert (topology.host, topology.local, topology.key) == (1, 1, "node0")
    assert topology.spans_hosts and topology.uniform and topology.hierarchical()


@pytest.mark.parametrize("hosts, choice, expected", [
    ([0, 0, 1, 1], "auto", True),
    ([0, 0, 1, 1], "hier", True),
    ([0, 0, 1, 1], "flat", False),
    ([0, 0, 0, 0], "auto", False),   # one host: shared memory alone
    ([0, 1], "auto", False),         # one rank per host: nothing to share
    ([0, 0, 1], "auto", False),      # unequal hosts: flat
])
def test_when_the_two_level_exchange_applies(hosts, choice, expected):
    assert topology_from_keys(_keys(hosts, choice), 0).hierarchical() is expected


def test_ranks_must_agree_on_phalanx_xhost():
    with pytest.raises(WorldConfigError, match="PHALANX_XHOST"):
        topology_from_keys([("node0", "auto"), ("node1", "flat")], 0)


def test_an_unknown_phalanx_xhost_is_a_typed_error():
    assert xhost_choice({}) == "auto"
    assert xhost_choice({"PHALANX_XHOST": "Hier"}) == "hier"
    with pytest.raises(WorldConfigError, match="flat"):
        xhost_choice({"PHALANX_XHOST": "tree"})


def test_segment_names_carry_their_host():
    assert segment_host(new_segment_name("node3")) == "node3"
    assert segment_host(new_segment_name()) is None
    with pytest.raises(ValueError):
        new_segment_name("../x")
