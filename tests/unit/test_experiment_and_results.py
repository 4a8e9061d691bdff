"""Pure pieces around one experiment (its config, arguments, command and verdict) and the
result files. Verdicts are built from files written into tmp_path; nothing is launched."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from autotuner.config import load_config
from autotuner.core.errors import ConfigError
from autotuner.tuning.space.config_space import base_config, search_space
from autotuner.tuning.space.dimensions import full_mode_values
from autotuner.core.boundary import Measurement, write_record
from autotuner.core.launch_records import LaunchReport, RankError
from autotuner.launch.elastic import failure_report
from autotuner.launch.options import RankFlags
from autotuner.tuning.trials.trial import ExperimentSettings, Trial, config_value, experiment_config, mapped_script_args
from autotuner.execution.trial_launch import cold_launch, judge
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.reports import results as results_module
from autotuner.tuning.reports.results import summary_text, write_results
from fakes import OUR_ENGINE_KNOBS
from autotuner.tuning.space.experiment import Experiment

THROUGHPUT = Objective("throughput")


def settings(**kwargs) -> ExperimentSettings:
    values = dict(script="train.py", script_args=("--deepspeed", "ds.json"), base_config={"steps_per_print": 7},
                  nproc_per_node=2, data_parallel_size=2, objective=THROUGHPUT, timeout_s=30.0,
                  python="/usr/bin/python3")
    values.update(kwargs)
    return ExperimentSettings(**values)


# ----- mapped_script_args -----

MAPPINGS = {
    "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
    "zero_optimization.stage": "--zero_stage",
}


def test_mapped_args_rewrite_both_forms_and_append_absent_flags():
    config = Experiment(1, 8, 2).apply({}, 2)
    args = ("--per_device_train_batch_size", "2", "--gradient_accumulation_steps=1", "--lr", "1e-4")
    got = mapped_script_args(args, MAPPINGS, config)
    assert got == ("--per_device_train_batch_size", "8", "--gradient_accumulation_steps=2", "--lr", "1e-4",
                   "--zero_stage", "1")


def test_mapped_args_without_mappings_are_unchanged():
    args = ("--a", "1", "--b=2")
    assert mapped_script_args(args, {}, Experiment(0, 4).apply({}, 1)) == args


def test_mapped_args_fill_a_bare_flag():
    config = Experiment(0, 4).apply({}, 1)
    got = mapped_script_args(("--per_device_train_batch_size", "--lr", "1"),
                             {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}, config)
    assert got == ("--per_device_train_batch_size", "4", "--lr", "1")


def test_mapped_args_take_knob_values_by_dotted_key():
    config = Experiment(2, 4).with_knobs({"overlap_comm": True}).apply({}, 1)
    got = mapped_script_args((), {"zero_optimization.overlap_comm": "--overlap"}, config)
    assert got == ("--overlap", "True")


def test_a_bare_bool_flag_keeps_the_scripts_next_argument_and_its_own_word_is_replaced():
    # Hugging Face's bool flags take an optional true/false; any other token after a bare one is
    # the script's (a positional data file here), and was swallowed as the flag's value.
    mapping = {"activation_checkpointing.policy": "--gradient_checkpointing"}
    config = Experiment(0, 4).with_knobs({"activation_checkpointing": "full"}).apply({}, 1)
    assert mapped_script_args(("--gradient_checkpointing", "data.txt"), mapping, config) == \
        ("--gradient_checkpointing", "true", "data.txt")
    assert mapped_script_args(("--gradient_checkpointing", "False", "data.txt"), mapping, config) == \
        ("--gradient_checkpointing", "true", "data.txt")
    # A non-bool mapped flag still takes its value, a negative number included, never an option.
    bs = {"train_micro_batch_size_per_gpu": "--bs"}
    assert mapped_script_args(("--bs", "-1", "-v"), bs, config) == ("--bs", "4", "-v")
    assert mapped_script_args(("--bs", "-v"), bs, config) == ("--bs", "4", "-v")


@pytest.mark.parametrize("key", ["no_such_key", "zero_optimization.no_such_knob", "train_batch_size.deeper"])
def test_mapped_args_unknown_key_is_a_config_error(key):
    config = Experiment(0, 4).apply({}, 1)
    with pytest.raises(ConfigError, match=re.escape(f"'{key}'")) as err:
        mapped_script_args(("--x", "1"), {key: "--x"}, config)
    assert "arg_mappings" in str(err.value)
    assert err.value.exit_code == 2


def test_config_value_walks_dotted_keys():
    config = {"a": {"b": {"c": 3}}, "d": 0}
    assert config_value(config, "a.b.c") == 3
    assert config_value(config, "d") == 0
    with pytest.raises(ConfigError):
        config_value(config, "a.x")


def test_mapped_args_rewrite_every_occurrence_of_a_flag():
    config = Experiment(0, 8).apply({}, 1)
    got = mapped_script_args(("--bs", "2", "--bs", "4"), {"train_micro_batch_size_per_gpu": "--bs"}, config)
    assert "4" not in got


# ----- experiment_config / the launch as (cmd, env) -----

def test_experiment_config_sets_the_experiment_and_drops_the_autotuning_section():
    base = {"steps_per_print": 7, "zero_optimization": {"overlap_comm": False, "stage": 0},
            "autotuning": {"enabled": True, "arg_mappings": {}}}
    s = settings(base_config=base, data_parallel_size=4)
    experiment = Experiment(2, 8, 3).with_knobs({"overlap_comm": True})
    config = experiment_config(experiment, s)
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 8 * 3 * 4
    assert config["steps_per_print"] == 7
    assert "autotuning" not in config  # what to measure travels in the request file
    # The base config is not modified.
    assert base["zero_optimization"] == {"overlap_comm": False, "stage": 0}
    assert "train_batch_size" not in base


def test_cold_launch_is_pure_and_names_the_request_and_report(tmp_path):
    s = settings(script_args=("--deepspeed=ds.json", "--bs", "1"), arg_mappings={"train_micro_batch_size_per_gpu": "--bs"},
                 rank_flags=RankFlags(master_port=29600))
    trial = Trial(Experiment(0, 16), tmp_path / "exp", s)
    command, env = cold_launch(trial, {"PATH": "/bin"})
    path = tmp_path / "exp" / "ds_config.json"
    assert command == [
        "/usr/bin/python3", "-m", "autotuner", "--nproc_per_node", "2", "--master_port", "29600",
        "--report_file", str(tmp_path / "exp" / "launch_report.json"), "train.py", f"--deepspeed={path}", "--bs", "16"]
    # The launch dies with the tuner (parent_death), and its ranks wait no longer than the experiment.
    assert env == {"PATH": "/bin", "AUTOTUNER_MEASUREMENT_REQUEST": str(tmp_path / "exp" / "request.json"),
                   "PYTHONUNBUFFERED": "1", "AUTOTUNER_LAUNCHED_BY_PID": str(os.getpid()),
                   "AUTOTUNER_DIST_TIMEOUT_S": f"{s.timeout_s:g}",
                   "DEEPSPEED_TIMEOUT": str(max(1, math.ceil(s.timeout_s / 60)))}
    assert not (tmp_path / "exp").exists()


def test_the_request_of_a_measurement_and_of_a_profile(tmp_path):
    s = settings(start_profile_step=3, end_profile_step=7)
    measure = Trial(Experiment(0, 4), tmp_path, s).request()
    assert (measure.start_profile_step, measure.end_profile_step) == (3, 7)
    assert measure.metrics_path == str(tmp_path / "metrics.json") and measure.model_info_path is None
    profile = Trial(Experiment(0, 1), tmp_path, s, profile=True).request()
    # A profile launch is an experiment that also records the model: it times the window too.
    assert profile.metrics_path == str(tmp_path / "metrics.json") and not profile.exit_after_model_info
    assert profile.model_info_path == str(tmp_path / "model_info.json")
    assert profile.oom_marker(1) == str(tmp_path / "metrics.json.oom-rank1")


# ----- base_config / knob_values / search_space -----

def test_base_config_settles_knob_lists_and_removes_the_stage():
    config = load_config({
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": [1, 2], "reduce_bucket_size": [1000, 2000], "overlap_comm": [True, False],
                              "contiguous_gradients": True},
    })
    base = base_config(config)
    assert base["zero_optimization"] == {"reduce_bucket_size": 1000, "overlap_comm": True,
                                         "contiguous_gradients": True}
    assert base["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3}}


def test_base_config_with_no_zero_section():
    base = base_config(load_config({"train_micro_batch_size_per_gpu": 2}))
    assert base["zero_optimization"] == {}
    assert base["train_micro_batch_size_per_gpu"] == 2


def test_knob_values_defaults():
    assert full_mode_values(load_config({"train_batch_size": 8}).to_dict()) == OUR_ENGINE_KNOBS


def test_knob_values_user_scalar_fixes_and_user_list_replaces():
    config = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": "all", "reduce_bucket_size": 500_000, "contiguous_gradients": [True],
        "stage3_param_persistence_threshold": 10}})
    values = full_mode_values(config.to_dict())
    assert values[0] == values[1] == {"contiguous_gradients": [True]}  # rbs fixed: not tuned
    assert values[2] == {"overlap_comm": [False, True]}
    assert values[3] == {"overlap_comm": [False, True]}  # ppt fixed at 10: not tuned


def test_knob_values_user_list_of_bucket_sizes():
    config = load_config({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": [10, 20],
                                                                        "overlap_comm": [True]}})
    values = full_mode_values(config.to_dict())
    assert values[0] == {"reduce_bucket_size": [10, 20], "contiguous_gradients": [False, True]}
    assert values[3] == {"overlap_comm": [True], "stage3_param_persistence_threshold": [0, 100_000]}


def test_knob_values_user_list_of_persistence_thresholds():
    config = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage3_param_persistence_threshold": [0, 10, 1000], "stage3_prefetch_bucket_size": [0, 5]}})
    assert full_mode_values(config.to_dict())[3]["stage3_param_persistence_threshold"] == [0, 10, 1000]


def test_search_space_auto_micro_is_searched_under_a_cap():
    config = load_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "all"},
                          "autotuning": {"enabled": True, "max_train_batch_size": 64,
                                         "min_train_micro_batch_size_per_gpu": 2,
                                         "max_train_micro_batch_size_per_gpu": 32,
                                         "num_tuning_micro_batch_sizes": 4}})
    space = search_space(config, data_parallel_size=2)
    assert space.stages == (0, 1, 2, 3)
    assert space.data_parallel_size == 2
    assert space.fixed_micro_batch_sizes == ()
    assert space.global_batch_size == 64 and space.global_batch_exact is False
    assert (space.min_micro_batch_size, space.max_micro_batch_size, space.num_micro_batch_sizes) == (2, 32, 4)
    assert space.fixed_gradient_accumulation_steps is None
    assert space.knob_values == OUR_ENGINE_KNOBS


def test_search_space_int_micro_is_fixed():
    space = search_space(load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}), 1)
    assert space.fixed_micro_batch_sizes == (4,)
    assert space.stages == (1,)
    assert space.global_batch_size is None


def test_search_space_list_micro_is_a_fixed_tuple():
    space = search_space(load_config({"train_micro_batch_size_per_gpu": [2, 8],
                                      "zero_optimization": {"stage": [2, 0]}}), 1)
    assert space.fixed_micro_batch_sizes == (2, 8)
    assert space.stages == (0, 2)


def test_search_space_fixed_train_batch_size_is_exact():
    config = load_config({"train_batch_size": 32, "gradient_accumulation_steps": 2,
                          "autotuning": {"max_train_batch_size": 1024}})
    space = search_space(config, 2)
    assert space.global_batch_size == 32 and space.global_batch_exact is True
    assert space.fixed_gradient_accumulation_steps == 2
    assert space.valid_micro_batch_sizes(100) == [8]


def test_search_space_auto_gas_is_searched():
    space = search_space(load_config({"train_batch_size": "auto", "gradient_accumulation_steps": "auto"}), 1)
    assert space.fixed_gradient_accumulation_steps is None
    assert space.global_batch_size is None and space.global_batch_exact is False


# ----- the verdict (judge) -----

EXP = Experiment(1, 8, 2)


def _classify(exp_dir: Path, returncode=0, timed_out=False, report: LaunchReport | None = None,
              **kwargs) -> TrialResult:
    if report is not None:
        write_record(exp_dir / "launch_report.json", report)
    trial = Trial(EXP, exp_dir, settings(**kwargs), predicted_memory_bytes=1234)
    return judge(trial, returncode, timed_out, 12.5)


def _metrics(exp_dir: Path, **values) -> None:
    values.setdefault("latency", 0.5)
    (exp_dir / "metrics.json").write_text(json.dumps(values))


def test_timeout(tmp_path):
    _metrics(tmp_path, throughput=3.0)  # even with metrics, a timeout is a timeout
    result = _classify(tmp_path, returncode=None, timed_out=True)
    assert result.state is TrialState.TIMEOUT
    assert result.value is None
    assert "exp_timeout_s=30s" in result.error
    assert (result.experiment, result.wall_time_s, result.predicted_memory_bytes) == (EXP, 12.5, 1234)


def test_oom_marker_names_the_rank(tmp_path):
    (tmp_path / "metrics.json.oom-rank1").write_text("")
    result = _classify(tmp_path, returncode=1)
    assert result.state is TrialState.OOM
    assert result.error == "out of memory on rank 1"
    assert result.value is None


def test_oom_markers_of_several_ranks(tmp_path):
    for rank in (1, 0):
        (tmp_path / f"metrics.json.oom-rank{rank}").write_text("")
    result = _classify(tmp_path, returncode=0)
    assert result.state is TrialState.OOM
    assert result.error == "out of memory on rank 0, 1"


def _rank_error(directory: Path, rank: int, kind: str, message: str, when: float, exit_code: int = 1) -> None:
    write_record(directory / f"rank{rank}.json", RankError(rank, kind, message, exit_code, when))


def test_failure_names_rank_and_its_exception_from_the_report(tmp_path):
    report = LaunchReport(1, failed_rank=1, rank_exit_status=1, exception="ValueError: learning rate must be positive")
    (tmp_path / "stderr.log").write_text("RuntimeError: a misleading line in the log\n")  # never read
    result = _classify(tmp_path, returncode=1, report=report)
    assert result.state is TrialState.FAILED
    assert result.error == "rank 1: ValueError: learning rate must be positive"
    assert result.value is None


def test_the_report_decides_even_when_the_launcher_exit_status_is_0(tmp_path):
    _metrics(tmp_path, throughput=3.0)
    result = _classify(tmp_path, returncode=0, report=LaunchReport(1, 0, 137))
    assert result.state is TrialState.FAILED and result.error == "rank 0: exit status 137 (killed by SIGKILL)"


def test_failure_report_prefers_the_first_failed_ranks_own_exception(tmp_path):
    _rank_error(tmp_path, 1, "ValueError", "learning rate must be positive", when=10.0)
    _rank_error(tmp_path, 0, "RuntimeError", "Connection closed by peer", when=11.0)
    report = failure_report(str(tmp_path), 1, {0: 1, 1: 1})
    assert (report.failed_rank, report.exception) == (1, "ValueError: learning rate must be positive")


def test_failure_report_blames_a_sigkilled_rank_not_the_peer_that_raised_after_it(tmp_path):
    _rank_error(tmp_path, 0, "RuntimeError", "[gloo] Connection closed by peer", when=11.0)
    report = failure_report(str(tmp_path), 1, {0: 1, 1: 137})
    assert (report.failed_rank, report.rank_exit_status, report.exception) == (1, 137, None)


def test_failure_report_looks_past_a_rank_the_launcher_stopped(tmp_path):
    _rank_error(tmp_path, 1, "KeyError", "'a'", when=10.0)
    report = failure_report(str(tmp_path), 0, {0: 143, 1: 1})
    assert (report.failed_rank, report.exception, report.exit_code) == (1, "KeyError: 'a'", 1)


def test_failure_report_keeps_our_own_errors_exit_code(tmp_path):
    write_record(tmp_path / "rank0.json", RankError(0, "ConfigError", "ds.json: bad", 2, 1.0, ours=True))
    assert failure_report(str(tmp_path), 0, {0: 2}).exit_code == 2


def test_failure_from_argparse_in_the_script(tmp_path):
    _rank_error(tmp_path, 0, "argparse", "train.py: error: unrecognized arguments: --foo", when=1.0, exit_code=2)
    report = failure_report(str(tmp_path), 0, {0: 2})
    assert _classify(tmp_path, returncode=2, report=report).error == \
        "rank 0: train.py: error: unrecognized arguments: --foo"


def test_failure_without_report(tmp_path):
    result = _classify(tmp_path, returncode=3)
    assert result.state is TrialState.FAILED
    assert result.error == "exit status 3"


def test_exit_zero_without_metrics(tmp_path):
    result = _classify(tmp_path, returncode=0)
    assert result.state is TrialState.FAILED
    assert result.error.startswith("no metrics")
    assert "end_profile_step=5" in result.error


def test_metrics_over_the_memory_budget_are_oom(tmp_path):
    _metrics(tmp_path, throughput=50.0, peak_memory_bytes=3 * 2**30)
    result = _classify(tmp_path, memory_budget_bytes=2 * 2**30)
    assert result.state is TrialState.OOM
    assert result.value is None
    assert result.measured_memory_bytes == 3 * 2**30
    assert "3072 MiB" in result.error and "2048 MiB" in result.error


def test_metrics_within_the_budget_are_ok(tmp_path):
    _metrics(tmp_path, throughput=50.0, peak_memory_bytes=2 * 2**30)
    result = _classify(tmp_path, memory_budget_bytes=2 * 2**30)
    assert result.state is TrialState.OK
    assert result.measured_memory_bytes == 2 * 2**30


@pytest.mark.parametrize(("metric", "key", "value"), [
    ("throughput", "throughput", 123.5), ("latency", "latency", 0.25), ("FLOPS", "FLOPS_per_gpu", 3.5e12)])
def test_ok_value_is_the_objective_metric(tmp_path, metric, key, value):
    metrics = {"throughput": 123.5, "throughput_std": 1.5, "latency": 0.25, "FLOPS_per_gpu": 3.5e12,
               "peak_memory_bytes": 1000}
    _metrics(tmp_path, **metrics)
    result = _classify(tmp_path, objective=Objective(metric))
    assert Objective(metric).key == key
    assert result.state is TrialState.OK
    assert result.value == value
    assert result.value_std == (1.5 if metric == "throughput" else None)
    assert result.measurement == Measurement.from_json(metrics)
    assert result.error is None


def test_metrics_without_the_objective_key_fail(tmp_path):
    _metrics(tmp_path, throughput=1.0)
    result = _classify(tmp_path, objective=Objective("FLOPS"))
    assert result.state is TrialState.FAILED
    assert "FLOPS_per_gpu" in result.error


# ----- Experiment names and records -----

@pytest.mark.parametrize(("experiment", "name"), [
    (Experiment(1, 8, 2), "z1_gas2_mbs8"),
    (Experiment(0, 1), "z0_gas1_mbs1"),
    (Experiment(2, 4).with_knobs({"overlap_comm": True}), "z2_ocT_gas1_mbs4"),
    (Experiment(0, 16, 4).with_knobs({"reduce_bucket_size": 50_000_000, "contiguous_gradients": False}),
     "z0_cgF_rbs5.0e07_gas4_mbs16"),
    (Experiment(3, 2).with_knobs({"stage3_param_persistence_threshold": 0, "overlap_comm": False}),
     "z3_ocF_ppt0_gas1_mbs2"),
    (Experiment(3, 2).with_knobs({"stage3_param_persistence_threshold": 100_000}), "z3_ppt1.0e05_gas1_mbs2"),
    (Experiment(1, 2).with_knobs({"allgather_bucket_size": 6_553_600}), "z1_abs6.5536e06_gas1_mbs2"),
    (Experiment(1, 2).with_knobs({"some_knob": 3}), "z1_some_knob3_gas1_mbs2"),
])
def test_experiment_names(experiment, name):
    assert experiment.name == name


def test_knob_order_does_not_change_the_experiment():
    a = Experiment(0, 4).with_knobs({"reduce_bucket_size": 1_000_000, "contiguous_gradients": True})
    b = Experiment(0, 4).with_knobs({"contiguous_gradients": True, "reduce_bucket_size": 1_000_000})
    assert a == b and hash(a) == hash(b) and a.name == b.name


def test_trial_result_json_round_trip():
    experiment = Experiment(3, 8, 2).with_knobs({"overlap_comm": True, "stage3_param_persistence_threshold": 0})
    result = TrialResult(experiment, TrialState.OK, value=12.5, value_std=0.5,
                         measurement=Measurement.from_json({"throughput": 12.5, "latency": 0.1,
                                                            "forward": {"mean_s": 0.01}}),
                         predicted_memory_bytes=10, measured_memory_bytes=12, wall_time_s=3.25, error=None)
    data = json.loads(json.dumps(result.to_json()))
    assert data["name"] == experiment.name and data["state"] == "ok"
    back = TrialResult.from_json(data)
    assert back == result
    assert back.experiment == experiment and hash(back.experiment) == hash(experiment)
    assert back.measurement == result.measurement
    assert back.name == result.name


def test_the_engine_a_record_names_is_read_back_as_the_engine_type_and_an_unknown_one_is_refused():
    from autotuner.core.boundary import ModelInfo, RecordError
    from autotuner.core.engine_kind import Engine
    from fakes import model_info

    measured = Measurement.from_json({"throughput": 1.0, "latency": 0.1, "engine": "deepspeed"})
    assert measured.engine is Engine.DEEPSPEED and json.loads(json.dumps(measured.to_json()))["engine"] == "deepspeed"
    assert Measurement.from_json({"throughput": 1.0, "latency": 0.1}).engine is Engine.OURS
    info = ModelInfo.from_json({**model_info().to_json(), "engine": "autotuner"})
    assert info.engine is Engine.OURS
    for record, data in ((Measurement, {"throughput": 1.0, "latency": 0.1, "engine": "megatron"}),
                         (ModelInfo, {**model_info().to_json(), "engine": "megatron"})):
        with pytest.raises(RecordError, match="engine 'megatron'; expected one of 'deepspeed', 'autotuner'"):
            record.from_json(data)


@pytest.mark.parametrize("state", list(TrialState))
def test_trial_result_json_round_trip_every_state(state):
    result = TrialResult(Experiment(0, 1), state, error=None if state is TrialState.OK else "why")
    back = TrialResult.from_json(json.loads(json.dumps(result.to_json())))
    assert back == result and back.state is state


# ----- summary and result files -----

@pytest.fixture
def plots(monkeypatch):
    """Stub the plot (matplotlib is slow to import; the end-to-end test checks the PNG): record its calls."""
    calls = []
    monkeypatch.setattr(results_module, "plot_metric", lambda path, results, objective, curves=(): calls.append(path) or True)
    return calls


def _ok(stage, micro, value, gas=1, **kwargs):
    return TrialResult(Experiment(stage, micro, gas), TrialState.OK, value=value,
                       measurement=Measurement(throughput=value, latency=1.0 / value), **kwargs)


RESULTS = [
    _ok(0, 4, 10.0),
    TrialResult(Experiment(0, 8), TrialState.OOM, error="out of memory on rank 0"),
    _ok(1, 8, 20.0, gas=2),
    _ok(1, 4, 15.0),
    TrialResult(Experiment(2, 1), TrialState.FAILED, error="rank 0: ValueError: x"),
    TrialResult(Experiment(3, 1), TrialState.PRUNED, error="cannot help: ..."),
]


def _rows(summary: str) -> dict[str, list[str]]:
    rows = {}
    for line in summary.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] and not set(cells[0]) <= set(":-") and cells[0] != "tuning_space":
            rows[cells[0]] = cells[1:]
    return rows


def test_summary_rows_per_stage_and_global():
    summary = summary_text(RESULTS, THROUGHPUT, 3723.456)
    rows = _rows(summary)
    assert rows["z0"] == ["2", "10", "single run", "z0_gas1_mbs4"]
    assert rows["z1"] == ["2", "20", "single run", "z1_gas2_mbs8"]
    assert rows["z2"][0] == "1" and rows["z2"][3] == ""  # launched, nothing succeeded
    assert rows["global"] == ["5", "20", "single run", "z1_gas2_mbs8"]
    assert list(rows)[-1] == "global"
    assert summary.rstrip().endswith("Tuning completed in 1:02:03.46. Total number of experiments: 5.")


def test_the_picks_stage_row_agrees_with_the_global_row():
    # The final pick re-measured z1_gas1_mbs4 above z1_gas2_mbs8 (median 22): its stage's row named
    # the first window's best (20) while the global row named the pick.
    from autotuner.tuning.reports.results import Explanation

    chosen = TrialResult(Experiment(1, 4), TrialState.OK, value=22.0, measurement=RESULTS[3].measurement)
    remeasured = tuple((run, replace(chosen, value=v)) for run, v in ((1, 22.0), (2, 24.0)))
    rows = _rows(summary_text(RESULTS, THROUGHPUT, 1.0, Explanation(remeasurements=remeasured, chosen=chosen)))
    # Each row names its value: the pick's is the median of its 3 runs, the others' a single run.
    assert rows["z1"] == ["2", "22", "median of 3 runs", "z1_gas1_mbs4"]
    assert rows["global"] == ["5", "22", "median of 3 runs", "z1_gas1_mbs4"]
    assert rows["z0"] == ["2", "10", "single run", "z0_gas1_mbs4"]


def test_summary_with_latency_picks_the_minimum():
    rows = _rows(summary_text(RESULTS, Objective("latency"), 1.0))
    assert rows["z1"][1:] == ["15", "single run", "z1_gas1_mbs4"]
    assert rows["global"][1:] == ["10", "single run", "z0_gas1_mbs4"]


@pytest.mark.parametrize(("seconds", "text"), [(0.0, "0:00:00.00"), (5.5, "0:00:05.50"), (61.25, "0:01:01.25"),
                                               (3600.0, "1:00:00.00"), (36000 + 59 * 60 + 1.5, "10:59:01.50")])
def test_summary_duration_format(seconds, text):
    assert f"Tuning completed in {text}. Total number of experiments: 0." in summary_text([], THROUGHPUT, seconds)


@pytest.mark.parametrize(("seconds", "text"), [(59.999, "0:01:00.00"), (3599.996, "1:00:00.00")])
def test_summary_duration_rounds_into_the_next_minute(seconds, text):
    assert f"Tuning completed in {text}." in summary_text([], THROUGHPUT, seconds)


def test_summary_counts_launched_experiments_only():
    pruned = [TrialResult(Experiment(s, 1), TrialState.PRUNED, error="memory model") for s in range(4)]
    summary = summary_text(pruned, THROUGHPUT, 1.0)
    assert summary.rstrip().endswith("Total number of experiments: 0.")
    assert _rows(summary)["global"][0] == "0"


NASTY_CMD = ["/usr/bin/python3", "-m", "autotuner", "--nproc_per_node", "2", "train.py",
             "--run_name", "my run 1", "--note", "it's \"quoted\" $HOME `date` \\ back", "--empty", "",
             "--multi", "line1\nline2", "--deepspeed", "/tmp/dir with space/ds_config_optimal.json"]


def test_write_results_files(tmp_path, plots):
    optimal = experiment_config(RESULTS[2].experiment, settings())
    summary = write_results(tmp_path, RESULTS, THROUGHPUT, 12.0, optimal, NASTY_CMD)
    assert (tmp_path / "summary.txt").read_text() == summary
    assert json.loads((tmp_path / "ds_config_optimal.json").read_text()) == optimal
    assert shlex.split((tmp_path / "cmd_optimal.txt").read_text()) == NASTY_CMD
    assert plots == [tmp_path / "metric_vs_micro_batch.png"]

    import pandas as pd

    table = pd.read_csv(tmp_path / "experiments.csv", keep_default_na=False)
    assert len(table) == len(RESULTS)
    assert list(table["name"]) == [r.name for r in RESULTS]
    assert list(table["state"]) == [r.state.value for r in RESULTS]
    assert list(table["zero_stage"]) == [r.experiment.zero_stage for r in RESULTS]
    assert list(table["gradient_accumulation_steps"]) == [r.experiment.gradient_accumulation_steps for r in RESULTS]
    assert table.loc[table["state"] == "pruned", "error"].tolist() == ["cannot help: ..."]


def test_write_results_csv_knobs_column(tmp_path, plots):
    knobbed = TrialResult(Experiment(0, 4).with_knobs({"contiguous_gradients": True, "reduce_bucket_size": 1000}),
                          TrialState.OK, value=5.0)
    write_results(tmp_path, [knobbed], THROUGHPUT, 1.0, None, None)
    import pandas as pd

    table = pd.read_csv(tmp_path / "experiments.csv")
    assert table["knobs"].tolist() == ["contiguous_gradients=True;reduce_bucket_size=1000"]
    assert table["name"].tolist() == ["z0_cgT_rbs1000_gas1_mbs4"]


def test_write_results_csv_has_the_objective_value(tmp_path, plots):
    result = TrialResult(Experiment(0, 4), TrialState.OK, value=7.5)
    write_results(tmp_path, [result], THROUGHPUT, 1.0, None, None)
    import pandas as pd

    table = pd.read_csv(tmp_path / "experiments.csv")
    assert table["metric"].tolist() == ["throughput"]
    assert table["metric_value"].tolist() == [7.5]


def test_no_successful_result_writes_no_optimal_files(tmp_path, plots):
    failed = [r for r in RESULTS if r.state is not TrialState.OK]
    # A stale optimum from an earlier run must not survive a run that found none.
    write_results(tmp_path, RESULTS, THROUGHPUT, 1.0, {"train_batch_size": 1}, ["python", "x.py"])
    assert (tmp_path / "cmd_optimal.txt").exists() and (tmp_path / "ds_config_optimal.json").exists()
    summary = write_results(tmp_path, failed, THROUGHPUT, 1.0, None, None)
    assert not (tmp_path / "ds_config_optimal.json").exists()
    assert not (tmp_path / "cmd_optimal.txt").exists()
    assert (tmp_path / "summary.txt").read_text() == summary
    assert "Total number of experiments: 2." in summary

    import pandas as pd

    assert len(pd.read_csv(tmp_path / "experiments.csv")) == len(failed)


def test_a_timed_out_launch_names_a_torch_extension_build_lock_left_behind(tmp_path, monkeypatch):
    """A rank killed while DeepSpeed JIT-built an op leaves the build's lock; every later launch
    that builds it waits until its own time limit (seen on DeepSpeed's CPU engine)."""
    from autotuner.tuning.trials.trial import Trial
    from fakes import experiment_settings

    extensions = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    settings = experiment_settings(load_config({"train_micro_batch_size_per_gpu": 2}))
    trial = Trial(Experiment(0, 2), tmp_path / "exp", settings)
    assert "lock" not in (judge(trial, None, True, 31.0).error or "")
    lock = extensions / "py311_cpu" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    result = judge(trial, None, True, 31.0)
    assert result.state is TrialState.TIMEOUT and str(lock) in result.error and "delete it" in result.error


def test_on_deepspeeds_engine_each_experiment_keeps_the_users_deepspeed_only_keys_at_every_depth():
    """DeepSpeed acts on keys our engine does not (sub_group_size, an offload's ratio, the
    checkpointing section's own keys): an experiment measured without them would not be the config
    the pick trains with. Our engine's ranks get only what it acts on."""
    from fakes import experiment_settings

    from autotuner.tuning.trials.trial import launched_config
    from autotuner.tuning.space.experiment import Experiment

    user = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": [2, 3], "sub_group_size": 1e8,
                                  "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
            "activation_checkpointing": {"policy": "full", "number_checkpoints": 4},
            "autotuning": {"arg_mappings": {"activation_checkpointing.policy": "--checkpoint_activations"}}}
    config = load_config(user)
    experiment = Experiment(3, 4, 1)
    on_deepspeed = launched_config(experiment, experiment_settings(config, engine="deepspeed", user_config=user))
    zero = on_deepspeed["zero_optimization"]
    assert zero["stage"] == 3 and zero["sub_group_size"] == 1e8
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_optimizer"]["ratio"] == 0.5
    assert on_deepspeed["activation_checkpointing"] == {"number_checkpoints": 4}  # the policy goes to the flag
    assert on_deepspeed["train_micro_batch_size_per_gpu"] == 4 and "autotuning" not in on_deepspeed
    ours = launched_config(experiment, experiment_settings(config, user_config=user))
    assert "sub_group_size" not in ours["zero_optimization"] and ours["activation_checkpointing"] == {"policy": "full"}
