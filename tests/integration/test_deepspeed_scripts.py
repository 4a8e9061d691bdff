"""What real DeepSpeed scripts do that our own did not: forward through the raw module (a GAN's
`netD(x)`), and parameters that never get a gradient (an unused pooler). 2 gloo ranks, different
data on each, against plain torch SGD on both ranks' data in one process."""

import pytest

from conftest import assert_no_children_left, run_engine_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STAGES = ("0", "1", "2", "3")


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    """The three checks in one launch (each launch costs seconds of start-up on 2 cores)."""
    result = run_engine_check("raw_forward,unused,checkpoint_unused", tmp_path_factory.mktemp("script_checks"), 2)
    assert_no_children_left()
    return result["checks"]


def assert_parameters_equal(trained: dict, reference: dict, where: str) -> None:
    assert trained.keys() == reference.keys(), where
    for name in reference:
        assert trained[name] == pytest.approx(reference[name], abs=1e-5), f"{where}: {name}"


def test_gradients_are_reduced_when_forward_bypasses_the_engine(checks):
    result = checks["raw_forward"]
    reference = result["reference"]
    for stage in STAGES:
        for mode in ("engine", "raw"):
            run = result[stage][mode]
            assert run["ranks_agree"], f"stage {stage}, forward through the {mode} module: ranks differ"
            assert_parameters_equal(run["params"], reference, f"stage {stage}, forward through the {mode} module")


def test_gradients_are_reduced_when_only_the_boundarys_forward_bypasses_the_engine(checks):
    # Two micro-steps a step, the first through the engine: DDP's reduction is set up by the
    # boundary's forward alone, so counting the first as "through the engine" left it unreduced.
    result = checks["raw_forward"]
    for stage in STAGES:
        run = result[stage]["mixed"]
        assert run["ranks_agree"], f"stage {stage}: ranks differ"
        assert_parameters_equal(run["params"], result["reference_two_micro_steps"], f"stage {stage}, mixed")


def test_a_parameter_without_gradient_neither_stalls_nor_moves(checks):
    result = checks["unused"]
    reference = result["reference"]
    for stage in STAGES:
        run = result[stage]["engine"]
        assert run["ranks_agree"], f"stage {stage}: ranks differ"
        assert_parameters_equal(run["params"], reference, f"stage {stage}")


def test_save_load_and_resume_with_an_unused_parameter(checks):
    result = checks["checkpoint_unused"]
    for stage in STAGES:
        record = result[stage]
        assert record["resumed"] == record["continued"], f"stage {stage}"
        assert record["global_steps"] == 5
