"""How a PipelineModule's layers split over stages, and where each rank sits: DeepSpeed's rules
(runtime/utils.py's partition_uniform and partition_balanced, runtime/pipe/topology.py), held by
worked examples and, where DeepSpeed is installed (CI installs it), against DeepSpeed itself."""

from __future__ import annotations

import random
import warnings

import pytest

from autotuner.core.errors import ConfigError
from autotuner.runtime.pipeline.partition import partition_balanced, partition_uniform, parts_for
from autotuner.runtime.pipeline.topology import PipeDataParallelTopology, PipeModelDataParallelTopology


def test_worked_examples_of_each_split():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]  # the first stages take the extra layers
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    # Balanced minimises heaviest minus lightest (DeepSpeed since 0.12.5), the later cut on a tie.
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([1, 1, 1, 1, 1], 4) == [0, 2, 3, 4, 5]
    assert partition_balanced([0, 1, 1, 1, 1], 2) == [0, 3, 5]
    # DeepSpeedExamples' AlexNet pipeline: 22 layers; the first Linear 9216x4096 outweighs the rest.
    alexnet = [23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0, 0, 0, 0, 37752832, 0, 0,
               16781312, 0, 40970]
    assert partition_balanced(alexnet, 2) == [0, 19, 22]
    assert parts_for("TYPE:linear", ["Embedding", "Linear", "ReLU", "Linear", "LayerNorm"], [5, 3, 0, 3, 1], 2) \
        == [0, 3, 5]  # a Linear each side; the tie takes the later cut


def test_a_method_that_splits_nothing_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="'conv' matches no layer's class name") as caught:
        parts_for("type:conv", ["Linear", "ReLU"], [3, 0], 2)
    assert "\n" not in str(caught.value) and caught.value.exit_code == 2
    with pytest.raises(ConfigError, match="not a method; expected \"parameters\", \"uniform\" or \"type:REGEX\""):
        parts_for("profile", ["Linear"], [3], 1)


def test_stages_outermost_then_data_then_tensor_parallel():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert [topo.get_coord(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]] and topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    grid = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert grid.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # DeepSpeed's docstring's example
    assert grid.get_rank(pipe=1, data=0, model=1) == 5 and grid.get_dim("model") == 2 and grid.get_dim("seq") == 0
    assert grid.filter_match(pipe=0, model=0) == [0, 2] and grid.get_rank_repr(5) == "model_01"
    with pytest.raises(ValueError, match="coordinate on every axis"):
        grid.get_rank(pipe=0)


@pytest.fixture(scope="module")
def deepspeed_utils():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("deepspeed")
        from deepspeed.runtime import utils
        from deepspeed.runtime.pipe import topology
    return utils, topology


def test_the_splits_and_grids_are_deepspeeds_own(deepspeed_utils):
    utils, topology = deepspeed_utils
    draw = random.Random(5)
    for _ in range(200):
        layers, stages = draw.randint(1, 12), draw.randint(1, 6)
        weights = [draw.choice([0, 0, 1, 2, 3, 5, 8, 100]) for _ in range(layers)]
        assert partition_balanced(weights, stages) == [int(p) for p in utils.partition_balanced(weights, stages)], \
            (weights, stages)
        assert partition_uniform(layers, stages) == utils.partition_uniform(layers, stages)
    for pp, mp, dp in ((2, 1, 2), (2, 2, 2), (4, 1, 1), (1, 2, 3)):
        ours, theirs = PipeModelDataParallelTopology(pp, mp, dp), topology.PipeModelDataParallelTopology(pp, mp, dp)
        for axis in ("pipe", "data", "model"):
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)
        assert [tuple(ours.get_coord(r)) for r in range(pp * mp * dp)] == \
            [tuple(theirs.get_coord(r)) for r in range(pp * mp * dp)]
