"""Placing experiments on a cluster, as data (autotuner/execution/placement.py): no Ray needed."""

from __future__ import annotations

import pytest

from autotuner.execution.placement import (EXCLUSIVE, SHARED, ClusterNode, Layout, RankShape, concurrency, feasible,
                                         place, rank_variables, taken)

CPU = RankShape(cpus=1.0)


def nodes(*cpus: float, gpus: float = 0.0) -> list[ClusterNode]:
    return [ClusterNode(f"n{i}", f"10.0.0.{i}", c, gpus) for i, c in enumerate(cpus)]


def test_a_two_node_layout_takes_two_nodes_with_rendezvous_on_the_first_ranks_node():
    placement = place(nodes(1, 1), {}, Layout(2, 1), CPU)
    assert [(r.rank, r.local_rank, r.node_rank, r.node_id) for r in placement.ranks] == [
        (0, 0, 0, "n0"), (1, 0, 1, "n1")]
    assert placement.master.address == "10.0.0.0"


def test_ranks_of_one_node_stay_together_and_a_node_too_small_is_skipped():
    placement = place(nodes(1, 4, 4), {}, Layout(1, 2), CPU)
    assert [r.node_id for r in placement.ranks] == ["n1", "n1"]
    assert [r.local_rank for r in placement.ranks] == [0, 1]


def test_exclusive_nodes_are_not_shared_even_with_free_slots():
    cluster = nodes(4, 4)
    first = place(cluster, {}, Layout(1, 1), CPU)
    used = taken(first, EXCLUSIVE, cluster, CPU)
    assert used == {"n0": 4}  # the whole node
    second = place(cluster, used, Layout(1, 1), CPU)
    assert second.node_ids == ("n1",)
    used = {**used, **taken(second, EXCLUSIVE, cluster, CPU)}
    assert place(cluster, used, Layout(1, 1), CPU) is None  # waits


def test_shared_nodes_take_free_slots_fullest_node_first():
    cluster = nodes(4, 4)
    used = {"n1": 2}
    placement = place(cluster, used, Layout(1, 2), CPU, SHARED)
    assert placement.node_ids == ("n1",)  # n1 has exactly 2 free: whole n0 stays free
    assert taken(placement, SHARED, cluster, CPU) == {"n1": 2}


def test_gpu_slots_come_from_gpus_and_a_bundle_names_them():
    shape = RankShape(cpus=2.0, gpus=1.0)
    assert shape.slots(ClusterNode("a", "h", 16, 8)) == 8
    assert shape.slots(ClusterNode("a", "h", 1, 8)) == 0  # not even one rank's CPUs
    assert shape.bundle() == {"CPU": 2.0, "GPU": 1.0}
    assert CPU.bundle() == {"CPU": 1.0}


def test_concurrency_counts_what_the_empty_cluster_holds_at_once():
    assert concurrency(nodes(1, 1), Layout(1, 1), CPU, EXCLUSIVE, None) == 2
    assert concurrency(nodes(1, 1), Layout(2, 1), CPU, EXCLUSIVE, None) == 1
    assert concurrency(nodes(4, 4), Layout(1, 1), CPU, SHARED, None) == 8
    assert concurrency(nodes(4, 4), Layout(1, 1), CPU, SHARED, 3) == 3
    assert concurrency(nodes(4, 4), Layout(1, 1), CPU, EXCLUSIVE, None) == 2


def test_feasible_says_why_a_layout_cannot_be_placed():
    assert feasible(nodes(1, 1), Layout(2, 1), CPU) is None
    why = feasible(nodes(1, 1), Layout(1, 2), CPU)
    assert why == ("1 node(s) with 2 rank slot(s) of 1 CPU each are needed; the cluster has 0 such node(s) of 2 "
                   "(the largest holds 1 rank(s))")
    assert "3 node(s)" in feasible(nodes(1, 1), Layout(3, 1), CPU)


def test_rank_variables_are_torch_elastics_with_rank_zero_hosting_the_store():
    placement = place(nodes(2, 2), {}, Layout(2, 2), CPU)
    env = rank_variables(placement.ranks[3], Layout(2, 2), "10.0.0.0", 29500, "none")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                                "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")} == {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.0", "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "2"}


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="placement policy"):
        place(nodes(1), {}, Layout(1, 1), CPU, "greedy")


def test_a_clusters_node_kinds_name_what_the_nodes_are_not_how_many_or_how_full():
    # The fingerprint's device on --backend ray: a cluster of other GPUs differs, more nodes of the
    # same kind or their free memory do not.
    from autotuner.execution.placement import node_kinds

    h100 = {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H100": 1.0, "memory": 5e11,
                                         "node:10.0.0.1": 1.0}}
    dead = {"Alive": False, "Resources": {"CPU": 2.0}}
    assert node_kinds([h100, dead]) == "ray nodes: CPU=64 GPU=8 accelerator_type:H100"
    other = {**h100, "Resources": {**h100["Resources"], "memory": 4e11, "node:10.0.0.2": 1.0}}
    assert node_kinds([h100, other]) == node_kinds([h100])
    a100 = {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0, "accelerator_type:A100": 1.0}}
    assert node_kinds([a100]) != node_kinds([h100])


def test_a_ray_tune_over_several_nodes_writes_a_c10d_command_for_each_node():
    from autotuner.execution.placement import rendezvous_flags

    assert rendezvous_flags(1, "10.0.0.1") == ()  # one node: the command runs where it is typed
    assert rendezvous_flags(2, "10.0.0.1") == ("--num_nodes", "2", "--rdzv_endpoint", "10.0.0.1:29400",
                                               "--rdzv_id", "autotuner-optimal")
