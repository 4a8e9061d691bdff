"""The experiment's tuned values: laid over a script's own config on our engine, checked against what
the ranks reported building, and carried to the pick's training (issue 67)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotuner.config.tuned_values import TUNED_VALUES_ENV, lay_tuned_values, tuned_values_from_env
from autotuner.core.boundary import Measurement, MeasurementRequest, RecordError
from autotuner.tuning.reports.outcome import tuned_values_env
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.trials.trial import built_mismatch
from autotuner.tuning.space.records import Objective
from autotuner.tuning.trials.trial import ExperimentSettings


def make_settings() -> ExperimentSettings:
    return ExperimentSettings(script="train.py", script_args=("--deepspeed", "ds.json"), base_config={},
                              nproc_per_node=2, data_parallel_size=2, objective=Objective("throughput"), timeout_s=30.0)


def ran(stage=0, micro=2, gas=1, **fields) -> Measurement:
    return Measurement(throughput=10.0, latency=0.1, zero_stage=stage, micro_batch_size=micro,
                       gradient_accumulation_steps=gas, **fields)


def test_an_experiment_names_its_stage_batch_and_dimensions_by_config_key():
    experiment = Experiment(2, 4, 8, (("activation_checkpointing", "full"), ("overlap_comm", True)))
    assert experiment.tuned_values() == (
        ("zero_optimization.stage", 2), ("train_micro_batch_size_per_gpu", 4), ("gradient_accumulation_steps", 8),
        ("activation_checkpointing.policy", "full"), ("zero_optimization.overlap_comm", True))


def test_the_tuned_values_replace_exactly_the_scripts_own_and_the_batch_is_derived_again():
    script = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0,
              "overlap_comm": True}, "gradient_clipping": 1.0}
    laid, changes = lay_tuned_values(script, {"zero_optimization.stage": 1, "train_micro_batch_size_per_gpu": 2,
                                              "gradient_accumulation_steps": 1})
    assert laid == {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                    "zero_optimization": {"stage": 1, "overlap_comm": True}, "gradient_clipping": 1.0}
    assert changes == ["zero_optimization.stage: 0 -> 1", "train_micro_batch_size_per_gpu: 4 -> 2",
                       "gradient_accumulation_steps: unset -> 1"]
    assert script["zero_optimization"]["stage"] == 0  # the script's dict is not changed
    # A config that says what the experiment says is left as it is, train_batch_size included.
    same = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1}}
    assert lay_tuned_values(same, dict(Experiment(1, 2, 1).tuned_values())) == (same, [])


def test_a_stage_the_ranks_did_not_build_fails_the_experiment_naming_the_mapping():
    settings = make_settings()
    message = built_mismatch(Experiment(1, 2, 1), ran(stage=0), settings)
    assert message == ("the ranks built zero_optimization.stage = 0, not the experiment's 1 (the script's own config "
                       "set it; map the key to the script's flag in autotuning.arg_mappings, e.g. "
                       "\"zero_optimization.stage\": \"--zero_stage\")")
    assert built_mismatch(Experiment(0, 2, 1), ran(stage=0), settings) is None
    # A mapped key the script did not apply says so.
    mapped = replace(settings, arg_mappings={"train_micro_batch_size_per_gpu": "--batch"})
    assert built_mismatch(Experiment(0, 4, 1), ran(micro=2), mapped) == (
        "the ranks built train_micro_batch_size_per_gpu = 2, not the experiment's 4 (the script did not apply its "
        "mapped flag --batch)")


def test_a_dimension_is_judged_by_what_the_ranks_read_back():
    settings = make_settings()
    experiment = Experiment(0, 2, 1, (("activation_checkpointing", "full"),))
    assert built_mismatch(experiment, ran(built=(("activation_checkpointing.policy", "full"),)), settings) is None
    assert built_mismatch(experiment, ran(built=(("activation_checkpointing.policy", "none"),)), settings) == (
        "the ranks built activation_checkpointing.policy = 'none', not the experiment's 'full' (the script's own "
        "config set it; map the key to the script's flag in autotuning.arg_mappings, e.g. "
        "\"activation_checkpointing.policy\": \"--gradient_checkpointing\")")
    # On DeepSpeed's engine the script applies it through its mapped flag; the config cannot say.
    on_deepspeed = replace(settings, engine="deepspeed")
    on_its_engine = ran(built=(("activation_checkpointing.policy", None),), engine="deepspeed")
    assert built_mismatch(experiment, on_its_engine, on_deepspeed) is None
    # Judged by the engine the ranks built: a script importing both settles it only at the profile.
    assert built_mismatch(experiment, on_its_engine, settings) is None
    # A section the script left out is the engine's default: off (no offload).
    offload = Experiment(2, 2, 1, (("offload_optimizer", "none"),))
    left_out = ran(stage=2, built=(("zero_optimization.offload_optimizer.device", None),), engine="deepspeed")
    assert built_mismatch(offload, left_out, on_deepspeed) is None
    assert built_mismatch(replace(offload, knobs=(("offload_optimizer", "cpu"),)), left_out,
                          on_deepspeed).startswith("the ranks built zero_optimization.offload_optimizer.device = 'none'")


def test_the_pick_carries_its_values_only_where_a_launch_laid_them_over_the_scripts_config():
    pick = Experiment(1, 2, 1)
    plain = TrialResult(experiment=pick, state=TrialState.OK, value=1.0, measurement=ran(stage=1))
    assert tuned_values_env(pick, (plain,)) == ()
    laid = replace(plain, measurement=ran(stage=1, tuned_over_script=("zero_optimization.stage",)))
    (name, value), = tuned_values_env(pick, (plain, laid))
    assert name == TUNED_VALUES_ENV
    assert json.loads(value) == {"zero_optimization.stage": 1, "train_micro_batch_size_per_gpu": 2,
                                 "gradient_accumulation_steps": 1}
    assert tuned_values_from_env({TUNED_VALUES_ENV: value}) == json.loads(value)
    with pytest.raises(RecordError, match=TUNED_VALUES_ENV):
        tuned_values_from_env({TUNED_VALUES_ENV: "[1, 2]"})


def test_the_request_and_measurement_carry_the_tuned_values_through_json():
    request = MeasurementRequest(3, 5, tuned=Experiment(1, 2, 4).tuned_values())
    assert MeasurementRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    measurement = ran(built=(("compile.enabled", False),), tuned_over_script=("zero_optimization.stage",))
    assert Measurement.from_json(json.loads(json.dumps(measurement.to_json()))) == measurement
