"""The experiment's tuned values: laid over a script's own config on our engine, checked against what
the ranks reported building, and carried to the pick's training (issue 67)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from autotuner.config.tuned_values import (TUNED_VALUES_ENV, lay_tuned_values, read_tuned_values,
                                           tuned_values_from_env)
from autotuner.core.boundary import REQUEST_ENV, Measurement, MeasurementRequest, TunedValues, write_record
from autotuner.app.cli import main
from autotuner.core.errors import ConfigError
from autotuner.launch.nodes import nodes_plan
from autotuner.launch.options import LaunchOptions
from autotuner.launch.plan import build_plan
from autotuner.tuning.reports.optimal_commands import optimal_command
from autotuner.tuning.reports.outcome import pick_tuned_values
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


def test_the_pick_carries_its_values_only_where_a_launch_laid_them_over_the_scripts_config(tmp_path):
    pick = Experiment(1, 2, 1)
    plain = TrialResult(experiment=pick, state=TrialState.OK, value=1.0, measurement=ran(stage=1))
    assert pick_tuned_values(pick, (plain,)) is None
    laid = replace(plain, measurement=ran(stage=1, tuned_over_script=("zero_optimization.stage",)))
    record = pick_tuned_values(pick, (plain, laid))
    values = {"zero_optimization.stage": 1, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    assert record == TunedValues(tuple(values.items()))
    # A versioned record in a file; the ranks get its path, never the values, in their environment.
    path = tmp_path / "tuned_values.json"
    write_record(path, record)
    assert json.loads(path.read_text()) == {"values": values, "version": 1}
    assert read_tuned_values(path) == values
    assert tuned_values_from_env({TUNED_VALUES_ENV: str(path)}) == values
    assert tuned_values_from_env({}) == {}
    # A tuner's launch trains with its own request's values, whatever else is named.
    request = tmp_path / "request.json"
    write_record(request, MeasurementRequest(2, 4, tuned=Experiment(0, 4, 1).tuned_values()))
    assert tuned_values_from_env({REQUEST_ENV: str(request), TUNED_VALUES_ENV: str(path)}) == \
        dict(Experiment(0, 4, 1).tuned_values())


@pytest.mark.parametrize("text, why", [
    (None, "no such file (a tune writes its tuned_values.json in autotuning.results_dir and names it in "
           "cmd_optimal.txt)"),
    ("{", "not a tuned values record (Expecting property name"),
    ("[1, 2]", "not a tuned values record (tuned values record: not a JSON object)"),
    ('{"zero_optimization.stage": 1}', "not a tuned values record (tuned values record without a 'values' object"),
    ('{"values": {}, "version": 9}', "not a tuned values record (tuned values record version 9; this autotuner "
                                     "reads version 1)"),
    (b"\xff\xfe", "cannot be read ("),
])
def test_a_tuned_values_file_that_is_missing_or_ill_formed_is_one_line_naming_it(tmp_path, text, why):
    path = tmp_path / "tuned_values.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        tuned_values_from_env({TUNED_VALUES_ENV: str(path)})
    assert str(raised.value).startswith(f"--tuned_values {path}: {why}")
    assert "\n" not in str(raised.value) and raised.value.exit_code == 2
    with pytest.raises(ConfigError, match="cannot be read"):  # a directory in its place
        read_tuned_values(tmp_path)


def test_the_request_and_measurement_carry_the_tuned_values_through_json():
    request = MeasurementRequest(3, 5, tuned=Experiment(1, 2, 4).tuned_values())
    assert MeasurementRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    measurement = ran(built=(("compile.enabled", False),), tuned_over_script=("zero_optimization.stage",))
    assert Measurement.from_json(json.loads(json.dumps(measurement.to_json()))) == measurement


def test_the_launcher_names_the_file_to_its_ranks_on_every_node_and_the_optimal_command_names_it(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("")
    path = tmp_path / "results" / "tuned_values.json"
    write_record(path, TunedValues((("zero_optimization.stage", 1),)))
    options = LaunchOptions(script=str(script), nproc_per_node=2, tuned_values="results/tuned_values.json")
    # The ranks' environment holds the file's absolute path (they may start elsewhere), not its values.
    assert build_plan(options, sys.executable).env[TUNED_VALUES_ENV] == str(path)
    assert TUNED_VALUES_ENV not in build_plan(replace(options, tuned_values=None), sys.executable).env
    # Each other node's agent is given the flag, and names it to its own ranks.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    nodes = nodes_plan(replace(options, hostfile=str(hostfile), nproc_per_node=None), sys.executable, str(tmp_path),
                       {}, num_nodes=None)
    for node in nodes.nodes:
        assert f"--tuned_values {path} " in node.cmd[-1]
    # cmd_optimal.txt, run by hand, names it among the launcher's flags.
    settings = make_settings()
    command = optimal_command(settings, ("--deepspeed", "o.json"), path)
    at = command.index("--tuned_values")
    assert command[at:at + 3] == ("--tuned_values", str(path), "train.py")
    assert "--tuned_values" not in optimal_command(settings, ("--deepspeed", "o.json"))


def test_a_launch_naming_a_missing_tuned_values_file_is_one_line_before_any_rank_starts(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a rank started')\n")
    missing = tmp_path / "tuned_values.json"
    code = main(["--nproc_per_node", "2", "--tuned_values", str(missing), str(script)])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.strip().splitlines() == [f"launcher: error: --tuned_values {missing}: no such file (a tune writes its "
                                        "tuned_values.json in autotuning.results_dir and names it in cmd_optimal.txt)"]


def test_a_tune_given_tuned_values_is_refused_in_one_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "autotuning": {"warm_start": False}}))
    code = main(["--autotuning", "tune", "--tuned_values", "t.json", str(script), "--deepspeed", str(config)])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.strip().splitlines() == ["launcher: error: --tuned_values t.json: a tune writes the pick's own (named "
                                        "in its cmd_optimal.txt); drop it with --autotuning"]
