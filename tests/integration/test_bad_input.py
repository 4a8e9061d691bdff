"""Bad input is refused before anything is launched: one line naming the file, key or flag,
exit status 2, no traceback (unless --debug). In-process through `autotuner.app.cli.main`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotuner.app.cli import main
from conftest import TOY, TOY_MAPPINGS as MAPPINGS, launcher_env, run_launcher


def config_dict(autotuning: dict | None = None, **top) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
        "zero_optimization": {"stage": 0},
        **top,
        "autotuning": {"enabled": True, "arg_mappings": MAPPINGS, "start_profile_step": 2, "end_profile_step": 4,
                       "model_info": {"num_params": 1000}, **(autotuning or {})},
    }


def write(path: Path, content: dict | str) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def tune_argv(config: Path | str, *script_args: str, script: Path | str = TOY, nproc: str = "2",
              launcher: tuple[str, ...] = ()) -> list[str]:
    return ["--autotuning", "tune", "--nproc_per_node", nproc, *launcher, str(script), "--pid_dir", "pids",
            *script_args, "--deepspeed", str(config)]


def assert_refused(tmp_path: Path, capsys, argv: list[str], *mentions: str) -> str:
    """Exit 2, one line 'launcher: error: ...' naming what is wrong, no traceback, nothing launched."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("launcher: error: "), line
    for mention in mentions:
        assert mention in line, (mention, line)
    assert "Traceback" not in out + err
    assert not (tmp_path / "autotuning_exps").exists()  # no experiment, no profile
    assert not (tmp_path / "pids").exists()  # no rank started
    return line


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ----- the config file -----
def test_malformed_json_names_file_line_and_column(in_tmp, capsys):
    config = write(in_tmp / "ds.json", '{\n  "train_batch_size": 8,\n  "zero_optimization": }\n')
    assert_refused(in_tmp, capsys, tune_argv(config), f"{config}:3:24:", "malformed")


def test_malformed_hjson_names_file_line_and_column(in_tmp, capsys):
    config = write(in_tmp / "ds.hjson", "{\n  # a comment\n  train_batch_size: 8,\n  zero_optimization: {stage: 1\n")
    assert_refused(in_tmp, capsys, tune_argv(config), f"{config}:", "malformed")


def test_a_key_given_twice_is_refused_as_deepspeed_refuses_it(in_tmp, capsys):
    # json and hjson keep the last value silently: this trained with a static loss scale of 128.
    config = write(in_tmp / "ds.json", '{"train_micro_batch_size_per_gpu": "auto",\n'
                                       ' "fp16": {"enabled": true, "loss_scale": 0, "loss_scale": 128}}')
    assert_refused(in_tmp, capsys, tune_argv(config), str(config), "'loss_scale' is given twice")


def test_a_trainer_scripts_varying_batch_key_needs_its_flag_mapped(in_tmp, capsys):
    # Hugging Face's Trainer refuses a config gradient_accumulation_steps other than its flag's:
    # unmapped, every launch but one would fail, and the pick come from the one left.
    pytest.importorskip("deepspeed")
    script = write(in_tmp / "train.py", "from transformers import Trainer, TrainingArguments\n")
    cfg = write(in_tmp / "ds.json", {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "autotuning": {"enabled": True, "max_train_batch_size": 16,
                       "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}}})
    assert_refused(in_tmp, capsys, tune_argv(cfg, script=script), str(cfg),
                   "gradient_accumulation_steps varies between experiments (1..8)",
                   '"gradient_accumulation_steps": "--gradient_accumulation_steps"')


def test_a_trainer_script_by_epochs_with_a_numeric_step_count_is_refused_before_launch(in_tmp, capsys):
    # Trained by epochs, the Trainer derives total_num_steps (and a ratio warmup) from each
    # experiment's batch and refuses any other value: every launch but one would fail.
    pytest.importorskip("deepspeed")
    script = write(in_tmp / "train.py", "from transformers import Trainer, TrainingArguments\n")
    mappings = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                "gradient_accumulation_steps": "--gradient_accumulation_steps"}
    scheduler = {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 10}}
    cfg = write(in_tmp / "ds.json", {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "scheduler": scheduler,
        "autotuning": {"enabled": True, "max_train_batch_size": 16, "arg_mappings": mappings}})
    assert_refused(in_tmp, capsys, tune_argv(cfg, "--num_train_epochs", "1", script=script), str(cfg),
                   "scheduler.params.total_num_steps: got 1000", "--max_steps")
    # "auto" total, a ratio warmup with a numeric warmup count: the warmup is refused the same way.
    scheduler["params"]["total_num_steps"] = "auto"
    write(cfg, {**json.loads(cfg.read_text()), "scheduler": scheduler})
    assert_refused(in_tmp, capsys, tune_argv(cfg, "--warmup_ratio", "0.1", script=script), str(cfg),
                   "scheduler.params.warmup_num_steps: got 10")
    # With --max_steps the count no longer follows the batch, and a fixed warmup never did.
    from autotuner.app.settle import check_trainer_step_counts
    from autotuner.config import load_config
    from autotuner.tuning.space.config_space import search_space
    config = load_config(cfg)
    space = search_space(config, 2, "deepspeed", False)
    check_trainer_step_counts(config, space, ("--max_steps", "50", "--warmup_ratio", "0.1"), str(cfg))
    check_trainer_step_counts(config, space, ("--warmup_steps", "5"), str(cfg))


def test_hjson_with_comments_and_trailing_commas_is_accepted_up_to_the_next_check(in_tmp, capsys):
    # Valid hjson gets past parsing; a later check (here, a typo) is what refuses it.
    config = write(in_tmp / "ds.hjson", "{\n  // comment\n  train_micro_batch_size_per_gpu: 2,\n  zero_optimisation: {stage: 1,},\n}\n")
    assert_refused(in_tmp, capsys, tune_argv(config), "unknown key 'zero_optimisation'", "did you mean 'zero_optimization'")


@pytest.mark.parametrize("config, mentions", [
    ({"train_micro_batch_size_per_gpus": 4}, ["unknown key 'train_micro_batch_size_per_gpus'",
                                              "did you mean 'train_micro_batch_size_per_gpu'"]),
    ({"zero_optimization": {"stage": 1, "overlap_com": True}}, ["unknown key 'zero_optimization.overlap_com'",
                                                                "did you mean 'overlap_comm'"]),
    ({"autotuning": {"enabled": True, "metirc": "latency"}}, ["unknown key 'autotuning.metirc'", "did you mean 'metric'"]),
], ids=["top", "zero", "autotuning"])
def test_unknown_key_is_named_with_a_suggestion(in_tmp, capsys, config, mentions):
    cfg = write(in_tmp / "ds.json", config)
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), *mentions)


@pytest.mark.parametrize("top, mentions", [
    ({"train_micro_batch_size_per_gpu": "four"}, ["train_micro_batch_size_per_gpu", '"four"', "positive integer"]),
    ({"gradient_clipping": "high"}, ["gradient_clipping", '"high"']),
    ({"optimizer": {"type": "Adamax"}}, ["optimizer.type", '"Adamax"']),
    ({"zero_optimization": {"stage": 1, "overlap_comm": "yes please"}}, ["zero_optimization.overlap_comm"]),
    ({"autotuning": {"enabled": True, "exp_timeout_s": "soon"}}, ["autotuning.exp_timeout_s", '"soon"']),
    ({"autotuning": {"enabled": True, "exp_timeout_s": -1}}, ["autotuning.exp_timeout_s", "got -1"]),
    ({"autotuning": {"enabled": True, "tuner_type": "bohb"}}, ["autotuning.tuner_type", '"bohb"', "gridsearch", "bayes"]),
    ({"autotuning": {"enabled": True, "memory_per_rank_bytes": 0}}, ["autotuning.memory_per_rank_bytes", "got 0"]),
    ({"autotuning": {"enabled": True, "model_info": {"num_params": 0}}}, ["autotuning.model_info.num_params"]),
    ({"train_micro_batch_size_per_gpu": 2.5}, ["train_micro_batch_size_per_gpu", "got 2.5"]),
    ({"autotuning": "yes"}, ["autotuning", '"yes"']),
], ids=["micro-str", "clipping", "optimizer", "overlap", "timeout", "timeout-negative", "tuner", "budget-zero",
        "num-params-zero", "micro-float", "section-str"])
def test_wrong_type_names_key_and_value(in_tmp, capsys, top, mentions):
    cfg = write(in_tmp / "ds.json", {**config_dict(), **top})
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), *mentions)


@pytest.mark.parametrize("key, value", [
    ("train_micro_batch_size_per_gpu", -2), ("train_micro_batch_size_per_gpu", 0),
    ("train_batch_size", -8), ("train_batch_size", 0),
    ("gradient_accumulation_steps", -1), ("gradient_accumulation_steps", 0),
])
def test_negative_and_zero_batch_sizes(in_tmp, capsys, key, value):
    cfg = write(in_tmp / "ds.json", config_dict(**{key: value}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), key, f"got {value}", "positive integer")


@pytest.mark.parametrize("autotuning, mentions", [
    ({"critical_batch_size": 4096}, ["autotuning", 'critical_batch_size is read only with metric "goodput"',
                                     'metric is "throughput"']),
    ({"metric": "goodput", "reference_batch_size": 32, "critical_batch_size": 0},
     ["autotuning.critical_batch_size", "got 0"]),
], ids=["without-goodput", "zero"])
def test_a_critical_batch_size_that_cannot_be_used(in_tmp, capsys, autotuning, mentions):
    cfg = write(in_tmp / "ds.json", config_dict(autotuning))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), *mentions)


def test_a_plan_with_model_info_skipping_the_profile_is_refused(in_tmp, capsys):
    # model_info.num_params skips the profile launches: a plan would have no measured step to predict from.
    cfg = write(in_tmp / "ds.json", config_dict())
    argv = tune_argv(cfg)
    argv[1] = "plan"
    assert_refused(in_tmp, capsys, argv, "--autotuning plan", str(cfg), "autotuning.model_info.num_params",
                   "drop model_info.num_params")
    assert not (in_tmp / "autotuning_results" / "plan.csv").exists()


def test_negative_micro_batch_in_a_list(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(train_micro_batch_size_per_gpu=[2, -4]))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "train_micro_batch_size_per_gpu")


def test_boolean_batch_size_is_refused_with_one_clear_message(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(train_micro_batch_size_per_gpu=True))
    line = assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "train_micro_batch_size_per_gpu", "got true")
    assert line.count("got true") == 1, line


def test_inconsistent_fixed_batch_triad(in_tmp, capsys):
    # 10 != 4 x 1 x 2 ranks
    cfg = write(in_tmp / "ds.json", config_dict(train_batch_size=10, train_micro_batch_size_per_gpu=4,
                                                gradient_accumulation_steps=1))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "train_batch_size (10)",
                   "train_micro_batch_size_per_gpu (4)", "gradient_accumulation_steps (1)", "= 8")


def test_inconsistent_fixed_batch_triad_in_a_plain_launch(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(train_batch_size=10, train_micro_batch_size_per_gpu=4,
                                                gradient_accumulation_steps=1))
    assert_refused(in_tmp, capsys, ["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed", str(cfg)],
                   str(cfg), "batch triad is inconsistent")


@pytest.mark.parametrize("stage", [4, "two", -1, [0, 5], []], ids=["4", "two", "-1", "list-with-5", "empty-list"])
def test_bad_zero_stage(in_tmp, capsys, stage):
    cfg = write(in_tmp / "ds.json", config_dict(zero_optimization={"stage": stage}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "zero_optimization.stage")


@pytest.mark.parametrize("policy, says", [("every_2nd", '"every_2nd" is not a policy'), (True, "true is not a policy"),
                                          (["full", "auto"], '"auto" is not a policy'),
                                          ([], "an empty list tunes nothing")], ids=["name", "bool", "auto-in-list", "empty"])
@pytest.mark.parametrize("autotuning", [True, False], ids=["tune", "plain"])
def test_bad_activation_checkpointing_policy(in_tmp, capsys, policy, says, autotuning):
    cfg = write(in_tmp / "ds.json", config_dict(activation_checkpointing={"policy": policy}))
    argv = tune_argv(cfg) if autotuning else ["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed",
                                               str(cfg)]
    assert_refused(in_tmp, capsys, argv, str(cfg), "activation_checkpointing.policy", says,
                   '"none", "full" or "selective", a list of them, or "auto"')


@pytest.mark.parametrize("section, says", [
    ({"autotp_size": 2, "partition_config": {"layer_specs": []}}, "tensor_parallel.partition_config"),
    ({"autotp_size": 3}, "tensor_parallel.autotp_size 3: must divide the number of ranks (2)"),
    ({"autotp_size": 2, "unknown": 1}, "unknown key 'tensor_parallel.unknown'"),
    ({"autotp_size": "auto"}, 'tensor_parallel.autotp_size: got "auto"; "auto" or a list is only for --autotuning '
                              "tune|run; give an integer (0 or 1: no tensor parallelism) to train"),
    ({"autotp_size": [1, 2]}, "tensor_parallel.autotp_size: got [1, 2]; \"auto\" or a list is only for"),
    ({"autotp_size": "two"}, "tensor_parallel.autotp_size"),
], ids=["not-carried", "indivisible", "typo", "auto-plain", "list-plain", "not-a-size"])
def test_a_tensor_parallel_section_our_engine_cannot_train_is_refused_before_any_launch(in_tmp, capsys, section,
                                                                                        says):
    cfg = write(in_tmp / "ds.json", config_dict(tensor_parallel=section))
    argv = ["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed", str(cfg)]
    assert_refused(in_tmp, capsys, argv, str(cfg), says)
    assert not (in_tmp / "pids").exists()


@pytest.mark.parametrize("extra, says", [
    ({"autotuning": {"metric": "goodput", "reference_batch_size": 8, "lr_scaling": "linear"}},
     "autotuning.metric \"goodput\" with tensor_parallel.autotp_size 2"),
    ({"tensor_parallel": {"autotp_size": "auto"}, "autotuning": {"metric": "goodput", "reference_batch_size": 8,
                                                                 "lr_scaling": "linear"}},
     "autotuning.metric \"goodput\" with tensor_parallel.autotp_size \"auto\""),
    ({"tensor_parallel": {"autotp_size": [1, 3]}}, "tensor_parallel.autotp_size: 3 in [1, 3] does not divide the "
                                                   "number of ranks (2)"),
    ({"tensor_parallel": {"autotp_size": "auto", "tp": {"tp_size": 2}}}, "tensor_parallel.tp.tp_size 2: with "
                                                                         "autotp_size \"auto\" the tune settles"),
], ids=["goodput", "goodput-searched", "list-indivisible", "tp-size-searched"])
def test_a_tensor_parallel_tune_our_engine_cannot_run_is_refused_before_any_launch(in_tmp, capsys, extra, says):
    raw = config_dict(tensor_parallel={"autotp_size": 2})
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    cfg = write(in_tmp / "ds.json", raw)
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), says)


@pytest.mark.parametrize("policy", ["auto", ["none", "full"]], ids=["auto", "list"])
def test_a_tuned_activation_checkpointing_policy_is_refused_for_a_plain_run(in_tmp, capsys, policy):
    cfg = write(in_tmp / "ds.json", config_dict(activation_checkpointing={"policy": policy}))
    argv = ["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed", str(cfg)]
    assert_refused(in_tmp, capsys, argv, str(cfg), "activation_checkpointing.policy", "only for --autotuning tune|run")


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_a_tuned_offload_device_is_refused_for_a_plain_run(in_tmp, capsys, section):
    cfg = write(in_tmp / "ds.json", config_dict(zero_optimization={"stage": 2, section: {"device": "auto"}}))
    argv = ["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids", "--deepspeed", str(cfg)]
    assert_refused(in_tmp, capsys, argv, str(cfg), f"zero_optimization.{section}.device: got \"auto\"",
                   "only for --autotuning tune|run", '"none" or "cpu"')


def test_an_unknown_offload_device_names_the_choices(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(zero_optimization={"stage": 2, "offload_optimizer": {"device": "gpu"}}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "zero_optimization.offload_optimizer.device",
                   'expected "none", "cpu" or "auto"')


@pytest.mark.parametrize("section, mentions", [
    ({"activation_checkpointing": {"policy": "full"}},
     ('activation_checkpointing.policy: "full" is applied by our engine only', "deepspeed.checkpointing",
      "--gradient_checkpointing")),
    ({"activation_checkpointing": {"policy": "auto"}},
     ('activation_checkpointing.policy: "auto" is tuned by our engine only', "autotuning.arg_mappings",
      "--gradient_checkpointing")),
    ({"compile": {"enabled": True}}, ("compile.enabled: our engine's key", "engine.compile()", "--torch_compile")),
], ids=["checkpointing", "checkpointing-auto", "compile"])
@pytest.mark.parametrize("autotuning", [True, False], ids=["tune", "plain"])
def test_our_engines_keys_for_a_script_on_deepspeeds_engine(in_tmp, capsys, autotuning, section, mentions):
    pytest.importorskip("deepspeed")
    script = write(in_tmp / "train.py", "import deepspeed\n")
    cfg = write(in_tmp / "ds.json", config_dict(**section))
    argv = tune_argv(cfg, script=script) if autotuning else ["--nproc_per_node", "2", str(script), "--deepspeed",
                                                              str(cfg)]
    assert_refused(in_tmp, capsys, argv, str(cfg), *mentions)


@pytest.mark.parametrize("size", [2, "auto"])
def test_a_tensor_parallel_tune_of_a_script_on_deepspeeds_engine_is_refused_before_any_launch(in_tmp, capsys, size):
    script = write(in_tmp / "train.py", "import deepspeed\n")
    cfg = write(in_tmp / "ds.json", config_dict(tensor_parallel={"autotp_size": size}))
    assert_refused(in_tmp, capsys, tune_argv(cfg, script=script), str(cfg), f"tensor_parallel.autotp_size "
                   f"{json.dumps(size)}: a tensor-parallel tune runs on autotuner's engine only")


@pytest.mark.parametrize("section, key, value", [
    ({"activation_checkpointing": {"policy": ["none", "selective"]}}, "activation_checkpointing.policy", '"selective"'),
    ({"compile": {"enabled": "auto", "backend": "eager"}}, "compile.backend", None),
], ids=["selective", "compile-backend"])
def test_a_mapped_dimension_on_deepspeeds_engine_takes_only_what_the_flag_expresses(in_tmp, capsys, section, key, value):
    # Hugging Face's --gradient_checkpointing checkpoints whole blocks: "none" or "full" only; the
    # compile backend is DeepSpeed's engine.compile() argument, not a config key there.
    pytest.importorskip("deepspeed")
    script = write(in_tmp / "train.py", "import deepspeed\n")
    mappings = {"activation_checkpointing.policy": "--gradient_checkpointing", "compile.enabled": "--torch_compile"}
    cfg = write(in_tmp / "ds.json", config_dict({"arg_mappings": {**MAPPINGS, **{k: v for k, v in mappings.items()
                                                                  if k.split(".")[0] in section}}}, **section))
    if value is not None:
        assert_refused(in_tmp, capsys, tune_argv(cfg, script=script), str(cfg), key, value,
                       "cannot be passed through --gradient_checkpointing", 'allowed: "none", "full"')
    else:
        assert_refused(in_tmp, capsys, tune_argv(cfg, script=script), str(cfg), key, "our engine's key")


def test_arg_mappings_naming_an_unknown_config_key(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"arg_mappings": {"train_micro_batch": "--micro_batch_size"}}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.arg_mappings", "'train_micro_batch'",
                   "not a config key")


def test_arg_mappings_naming_an_unknown_nested_key(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"arg_mappings": {"zero_optimization.stag": "--stage"}}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "'zero_optimization.stag'")


def test_arg_mappings_value_that_is_not_a_flag(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"arg_mappings": {"train_micro_batch_size_per_gpu": "micro_batch_size"}}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.arg_mappings.train_micro_batch_size_per_gpu",
                   "'micro_batch_size'", "expected a flag")


def test_arg_mappings_value_that_is_not_a_string(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"arg_mappings": {"train_micro_batch_size_per_gpu": 5}}))
    line = assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg),
                          "autotuning.arg_mappings.train_micro_batch_size_per_gpu", "got 5")
    assert "positive integer" not in line and "flag" in line, line


def test_arg_mappings_naming_a_config_key_left_unset(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"arg_mappings": {**MAPPINGS, "gradient_clipping": "--clip"}},
                                                train_micro_batch_size_per_gpu=2))
    assert_refused(in_tmp, capsys, tune_argv(cfg), "gradient_clipping")


def test_min_micro_batch_above_max(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"min_train_micro_batch_size_per_gpu": 8,
                                                 "max_train_micro_batch_size_per_gpu": 4}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "min_train_micro_batch_size_per_gpu (8)",
                   "max_train_micro_batch_size_per_gpu (4)")


@pytest.mark.parametrize("start, end", [(4, 4), (5, 3)])
def test_start_profile_step_not_below_end(in_tmp, capsys, start, end):
    cfg = write(in_tmp / "ds.json", config_dict({"start_profile_step": start, "end_profile_step": end}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), f"start_profile_step ({start})",
                   f"end_profile_step ({end})")


def test_unknown_metric(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"metric": "accuracy"}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.metric", '"accuracy"', "throughput")


def test_mp_size_that_does_not_divide_the_world_size(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"mp_size": 3}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.mp_size", "got 3")


def test_mp_size_above_one_on_our_engine_is_refused(in_tmp, capsys):
    # It divides the world (2), but every rank of our engine is data parallel: each global batch
    # would have been sized for a world of 1.
    cfg = write(in_tmp / "ds.json", config_dict({"mp_size": 2}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.mp_size", "got 2", "only 1 is allowed",
                   "DeepSpeed's engine")


def test_mp_size_larger_than_the_world_with_a_fixed_triad(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"mp_size": 4}, train_batch_size=8, train_micro_batch_size_per_gpu=2,
                                                gradient_accumulation_steps=2))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.mp_size")


def test_top_level_not_an_object(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", "[1, 2]")
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "top level must be an object")


def test_config_path_is_a_directory(in_tmp, capsys):
    (in_tmp / "ds.json").mkdir()
    assert_refused(in_tmp, capsys, tune_argv(in_tmp / "ds.json"), str(in_tmp / "ds.json"), "is a directory")


def test_config_that_is_not_utf8(in_tmp, capsys):
    cfg = in_tmp / "ds.json"
    cfg.write_bytes(b"\xff\xfe{}")
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "cannot read")


# ----- files and flags -----
@pytest.mark.parametrize("autotuning", [True, False], ids=["tune", "plain"])
def test_missing_config_file(in_tmp, capsys, autotuning):
    missing = in_tmp / "nope.json"
    argv = tune_argv(missing) if autotuning else ["--nproc_per_node", "2", str(TOY), "--pid_dir", "pids",
                                                  "--deepspeed", str(missing)]
    assert_refused(in_tmp, capsys, argv, str(missing), "not found")


@pytest.mark.parametrize("autotuning", [True, False], ids=["tune", "plain"])
def test_missing_script(in_tmp, capsys, autotuning):
    cfg = write(in_tmp / "ds.json", config_dict(train_micro_batch_size_per_gpu=2))
    missing = in_tmp / "no_such_train.py"
    argv = tune_argv(cfg, script=missing) if autotuning else ["--nproc_per_node", "2", str(missing), "--pid_dir",
                                                              "pids", "--deepspeed", str(cfg)]
    assert_refused(in_tmp, capsys, argv, str(missing), "script not found")


@pytest.mark.parametrize("nproc, mention", [("0", "got 0"), ("-2", "got -2"), ("two", "invalid int value: 'two'")])
def test_bad_nproc_per_node(in_tmp, capsys, nproc, mention):
    cfg = write(in_tmp / "ds.json", config_dict())
    assert_refused(in_tmp, capsys, tune_argv(cfg, nproc=nproc), "--nproc_per_node", mention)


def test_bad_nproc_per_node_in_a_plain_launch(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(train_micro_batch_size_per_gpu=2))
    assert_refused(in_tmp, capsys, ["--nproc_per_node", "0", str(TOY), "--pid_dir", "pids", "--deepspeed", str(cfg)],
                   "--nproc_per_node", "got 0")


def test_autotuning_without_a_config_among_the_script_args(in_tmp, capsys):
    assert_refused(in_tmp, capsys, ["--autotuning", "tune", "--nproc_per_node", "2", str(TOY), "--pid_dir", "pids"],
                   "--autotuning", "--deepspeed")


def test_autotuning_with_a_config_flag_but_no_path(in_tmp, capsys):
    assert_refused(in_tmp, capsys, ["--autotuning", "tune", "--nproc_per_node", "2", str(TOY), "--pid_dir", "pids",
                                    "--deepspeed"], "--deepspeed")


def test_unknown_autotuning_mode(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict())
    argv = tune_argv(cfg)
    argv[1] = "tunes"
    assert_refused(in_tmp, capsys, argv, "--autotuning", "'tunes'")


def test_autotuning_on_several_nodes(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict())
    assert_refused(in_tmp, capsys, tune_argv(cfg, launcher=("--num_nodes", "2", "--master_addr", "127.0.0.1")),
                   "--num_nodes")
    hostfile = in_tmp / "hostfile"
    hostfile.write_text("localhost slots=2\nworker-1 slots=2\n")
    assert_refused(in_tmp, capsys, tune_argv(cfg, launcher=("--hostfile", str(hostfile))), "--hostfile",
                   "worker-1", "--autotuning")


# ----- results_dir -----
@pytest.mark.parametrize("key", ["results_dir", "exps_dir"])
def test_results_dir_that_is_a_file(in_tmp, capsys, key):
    (in_tmp / "taken").write_text("")
    cfg = write(in_tmp / "ds.json", config_dict({key: "taken"}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), f"autotuning.{key}", "taken", "not a directory")


def _without_file_permission_overrides() -> None:
    """In the child, before it runs the launcher: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from
    the bounding set, so that even root, once it executes the interpreter, obeys file modes."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_results_dir_not_writable(in_tmp, capsys):
    locked = in_tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    cfg = write(in_tmp / "ds.json", config_dict({"results_dir": "locked/results"}))
    try:
        if os.geteuid() != 0:
            assert_refused(in_tmp, capsys, tune_argv(cfg), "autotuning.results_dir", "locked/results", "not writable")
            return
        # As root (CI) a 0o500 directory is writable: the launcher runs without root's override of file modes.
        done = subprocess.run([sys.executable, "-m", "autotuner", *tune_argv(cfg)], cwd=in_tmp, env=launcher_env(),
                              capture_output=True, text=True, timeout=120, preexec_fn=_without_file_permission_overrides)
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("launcher: error: ") and "Traceback" not in done.stderr
        assert "autotuning.results_dir" in line and "locked/results" in line and "not writable" in line, line
        assert not (in_tmp / "autotuning_exps").exists()
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("key", ["results_dir", "exps_dir"])
def test_results_dir_that_cannot_be_created(in_tmp, capsys, key):
    cfg = write(in_tmp / "ds.json", config_dict({key: "/proc/autotuner_cannot_create_this"}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), f"autotuning.{key}", "/proc/autotuner_cannot_create_this")


# ----- tracebacks only with --debug -----
def test_debug_shows_the_traceback_as_well_as_the_line(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(zero_optimization={"stage": 4}))
    code = main(["--debug", *tune_argv(cfg)])
    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("launcher: error: ")
    assert not (in_tmp / "autotuning_exps").exists()


def test_debug_after_the_script_is_the_scripts(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict(zero_optimization={"stage": 4}))
    assert_refused(in_tmp, capsys, tune_argv(cfg, "--debug"), "zero_optimization.stage")


# ----- atomic records (unit) -----
def test_write_json_atomic_keeps_the_old_file_when_the_write_fails_midway(tmp_path, monkeypatch):
    from autotuner.core import atomic

    path = tmp_path / "exp.json"
    atomic.write_json_atomic(path, {"state": "ok", "value": 1.0})
    before = path.read_bytes()
    real_dump = json.dump

    def torn_dump(data, handle, **kwargs):
        text = json.dumps(data, **kwargs)
        handle.write(text[: len(text) // 2])
        handle.flush()
        raise OSError("disk full")

    monkeypatch.setattr(atomic.json, "dump", torn_dump)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_json_atomic(path, {"state": "failed", "error": "x" * 1000})
    monkeypatch.setattr(atomic.json, "dump", real_dump)
    assert path.read_bytes() == before
    assert json.loads(path.read_text()) == {"state": "ok", "value": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["exp.json"]  # the temporary file is gone too


def test_write_json_atomic_keeps_the_old_file_on_keyboard_interrupt(tmp_path, monkeypatch):
    from autotuner.core import atomic

    path = tmp_path / "exp.json"
    atomic.write_json_atomic(path, [1, 2, 3])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_json_atomic(path, [4, 5, 6])
    assert json.loads(path.read_text()) == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["exp.json"]


# ----- enabled vs --autotuning (real runs) -----
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_autotuning_flag_with_enabled_false_tunes_with_a_note(tmp_path, no_orphans):
    cfg = write(tmp_path / "ds.json", config_dict({"enabled": False, "exp_timeout_s": 120},
                                                  train_micro_batch_size_per_gpu=2))
    result = run_launcher("--autotuning", "tune", "--nproc_per_node", "2", TOY, "--deepspeed", cfg, cwd=tmp_path,
                          timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "autotuning.enabled is false; tuning anyway because --autotuning tune was given" in result.stdout
    assert "Total number of experiments: 1." in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_enabled_without_the_autotuning_flag_trains_as_written_with_a_note(tmp_path, no_orphans):
    cfg = write(tmp_path / "ds.json", config_dict(train_micro_batch_size_per_gpu=2))
    result = run_launcher("--nproc_per_node", "2", TOY, "--steps", "6", "--deepspeed", cfg, cwd=tmp_path, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "done: 6 steps" in result.stdout  # trained to the end, not stopped after the profile steps
    assert "has autotuning.enabled but --autotuning was not given" in result.stderr
    assert not (tmp_path / "autotuning_exps").exists() and not (tmp_path / "autotuning_results").exists()


# ----- --backend ray -----

@pytest.mark.parametrize("launcher, mentions", [
    (("--ray_address", "auto"), ("--ray_address", "only with --backend ray")),
    (("--ray_placement", "shared"), ("--ray_placement", "only with --backend ray")),
    (("--backend", "ray", "--ray_max_concurrent", "0"), ("--ray_max_concurrent", "got 0")),
    (("--backend", "ray", "--hostfile", "hosts"), ("--backend ray", "drop --hostfile")),
    (("--backend", "ray", "--ray_cpus_per_rank", "0"), ("--ray_cpus_per_rank",)),
])
def test_ray_flags_are_checked_before_ray_is_touched(in_tmp, capsys, launcher, mentions):
    config = write(in_tmp / "ds.json", config_dict())
    assert_refused(in_tmp, capsys, tune_argv(config, launcher=launcher), *mentions)


def test_backend_ray_without_autotuning_is_refused(in_tmp, capsys):
    code = main(["--backend", "ray", "--nproc_per_node", "1", str(TOY)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err.startswith("launcher: error: --backend ray: runs the experiments of --autotuning tune|run")


def test_backend_ray_without_ray_installed_says_which_extra(in_tmp, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: `import ray` raises ImportError
    config = write(in_tmp / "ds.json", config_dict())
    assert_refused(in_tmp, capsys, tune_argv(config, launcher=("--backend", "ray")),
                   "--backend ray: Ray is not installed; pip install 'autotuner[ray]'")


def test_a_tuned_compile_needs_a_step_before_the_window(in_tmp, capsys):
    cfg = write(in_tmp / "ds.json", config_dict({"start_profile_step": 1}, compile={"enabled": "auto"}))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), "autotuning.start_profile_step: got 1",
                   "at least 2")


GOODPUT_RAMP = {"metric": "goodput", "reference_batch_size": 8, "lr_scaling": "linear", "adapt_batch": True}


@pytest.mark.parametrize("autotuning, says", [
    ({**GOODPUT_RAMP, "adapt_interval": 0}, "autotuning.adapt_interval: got 0"),
    ({"adapt_batch": True, "lr_scaling": "linear"}, 'adapt_batch grows the batch by goodput: it needs metric "goodput"'),
    ({"metric": "goodput", "reference_batch_size": 8, "adapt_batch": True}, "adapt_batch changes the global batch "
                                                                              "during training: give lr_scaling"),
], ids=["interval-0", "without-goodput", "without-lr-scaling"])
def test_a_batch_ramp_that_cannot_run_is_refused_before_any_launch(in_tmp, capsys, autotuning, says):
    cfg = write(in_tmp / "ds.json", config_dict(autotuning))
    assert_refused(in_tmp, capsys, tune_argv(cfg), str(cfg), says)


def test_a_batch_ramp_for_a_trainer_script_is_refused_before_any_launch(in_tmp, capsys):
    """Hugging Face's own run_clm.py, unchanged (../shared/clients), as CI has it beside the repo."""
    from hf_configs import RUN_CLM

    assert RUN_CLM.is_file(), f"needs Hugging Face's run_clm.py at {RUN_CLM}"
    script = RUN_CLM
    cfg = write(in_tmp / "ds.json", config_dict({**GOODPUT_RAMP, "arg_mappings": {
        "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
        "gradient_accumulation_steps": "--gradient_accumulation_steps"}}))
    assert_refused(in_tmp, capsys, tune_argv(cfg, script=script), str(cfg), "autotuning.adapt_batch",
                   "trains with Hugging Face's Trainer", "leave adapt_batch out")


def _list_knobs():
    from autotuner.config.sections import zero_list_knobs

    return zero_list_knobs()


@pytest.mark.parametrize("knob", _list_knobs())
def test_a_list_at_any_zero_knob_outside_a_tune_is_refused_before_any_rank_starts(in_tmp, capsys, knob):
    # Full mode searches such a list; a plain launch would have trained on it (overlap_comm [false]
    # is true to an `if`, reduce_bucket_size [1e6, 5e6] a bare TypeError in DDP's bucket size).
    value = [False] if knob in ("overlap_comm", "contiguous_gradients") else [1000000, 5000000]
    config = write(in_tmp / "ds.json", config_dict(zero_optimization={"stage": 2, knob: value}))
    assert_refused(in_tmp, capsys, ["--nproc_per_node", "2", str(TOY), "--deepspeed", str(config)],
                   f"zero_optimization.{knob}: got {json.dumps(value)}; a list is only for --autotuning tune|run")


@pytest.mark.parametrize("knob", _list_knobs())
def test_a_list_at_any_zero_knob_reaching_a_rank_is_refused_there_in_one_line(knob):
    from autotuner.config import load_config
    from autotuner.config.sections import refuse_unsettled
    from autotuner.core.errors import ConfigError

    value = [True, False] if knob in ("overlap_comm", "contiguous_gradients") else [1000000]
    config = load_config({"zero_optimization": {knob: value}})
    with pytest.raises(ConfigError) as refused:
        refuse_unsettled(config, None, in_rank=True)
    assert str(refused.value) == (f"zero_optimization.{knob}: got {json.dumps(value)}; a list is settled by "
                                  "--autotuning tune|run (full mode searches it); give one value to train")
    refuse_unsettled(load_config({"zero_optimization": {knob: value[0]}}), None, in_rank=True)  # one value trains
