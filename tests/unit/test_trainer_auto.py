"""Hugging Face's "auto" values (issue 29, 3.2): the Trainer fills them in before DeepSpeed reads
the config. They load; on DeepSpeed's engine they reach the script unchanged; on ours they are
refused in one line, exit 2, naming each key and what to set. In-process and fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.nn as nn

import autotuner
from autotuner.app.cli import main
from autotuner.config import load_config
from autotuner.config.trainer_auto import TRAINER_FILLED, refuse_trainer_autos, trainer_auto_keys
from autotuner.core.errors import ConfigError
from autotuner.runtime.training.optim import check_optimizer_and_scheduler
from autotuner.app.engines import EngineChoice
from autotuner.app.settle import check_trainer_autos
from autotuner.tuning.memory.deepspeed_states import DEFAULTS, deepspeed_state_bytes, zero_knob
from autotuner.tuning.trials.trial import ExperimentSettings, experiment_config, with_user_keys
from autotuner.tuning.space.records import Objective
from autotuner.tuning.space.experiment import Experiment
from conftest import MINIMAL
from hf_configs import HF_ZERO2, HF_ZERO3, MAPPINGS

ON_DEEPSPEED = EngineChoice("deepspeed", True, "imports", "run_clm.py imports transformers.Trainer (line 1)")


@pytest.mark.parametrize("documented", [HF_ZERO2, HF_ZERO3], ids=["zero2", "zero3"])
def test_hugging_faces_documented_configs_load_and_pass_the_checks_before_launch(documented):
    config = load_config(documented)
    check_optimizer_and_scheduler(config, "ds.json")  # "auto" params are the Trainer's; the rest is checked
    assert config.fp16.enabled == "auto" and config.gradient_clipping == "auto"
    # Written back unchanged, for the Trainer to fill in.
    again = config.to_dict()
    assert again["optimizer"]["params"]["betas"] == "auto"
    assert again["zero_optimization"]["reduce_bucket_size"] == "auto"
    expected = {key for key in TRAINER_FILLED if key != "scheduler.params.total_num_steps"
                and not key.startswith("zero_optimization.stage3_")}
    if documented is HF_ZERO3:
        expected |= set(TRAINER_FILLED)
    assert set(trainer_auto_keys(config)) == expected


def test_an_impossible_value_beside_the_autos_is_still_refused_before_launch():
    bad = {**HF_ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": -1.0}}}
    with pytest.raises(ConfigError, match="eps"):
        check_optimizer_and_scheduler(load_config(bad), "ds.json")


def test_our_engine_refuses_one_auto_in_one_line_saying_what_to_set():
    with pytest.raises(ConfigError) as caught:
        refuse_trainer_autos(load_config({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto"}),
                             "ds.json")
    assert caught.value.exit_code == 2
    assert str(caught.value) == ('ds.json: gradient_clipping is "auto" (a value Hugging Face\'s Trainer fills in); '
                                 "on autotuner's engine set gradient_clipping to a number, e.g. 1.0 (0 disables "
                                 "clipping)")


def test_the_batch_keys_and_bf16_auto_keep_their_own_meaning_on_our_engine():
    # Batch "auto" is the tuner's to settle; bf16 "auto" is bf16 where the device supports it.
    config = load_config({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "train_batch_size": "auto", "bf16": {"enabled": "auto"}})
    refuse_trainer_autos(config, "ds.json")
    assert config.with_device_precision(False).precision == "fp32"


def test_initialize_on_our_engine_refuses_the_autos_before_anything_starts():
    with pytest.raises(ConfigError, match=r'optimizer\.params\.lr, scheduler\.params\.warmup_max_lr are "auto"'):
        autotuner.initialize(model=nn.Linear(2, 2), config={
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("tuning", [False, True], ids=["plain launch", "tune"])
def test_a_script_on_our_engine_is_refused_before_any_launch(in_tmp, capsys, tuning):
    path = in_tmp / "ds.json"
    path.write_text(json.dumps({**HF_ZERO2, "autotuning": {"enabled": True, "arg_mappings": MAPPINGS}}))
    argv = (["--autotuning", "tune"] if tuning else []) + ["--nproc_per_node", "2", str(MINIMAL),
                                                           "--deepspeed", str(path)]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"launcher: error: {path}: gradient_clipping, fp16.enabled, "), err
    assert "on autotuner's engine set gradient_clipping to a number" in lines[0]
    assert "Traceback" not in out + err and not (in_tmp / "autotuning_exps").exists()


# ----- on DeepSpeed's engine: what the tuner does with them -----
def test_on_deepspeeds_engine_the_tuner_says_it_passes_them_through(capsys):
    check_trainer_autos(load_config(HF_ZERO3), ON_DEEPSPEED, "run_clm.py", "ds.json")
    out = capsys.readouterr().out
    assert 'gradient_clipping, fp16.enabled, bf16.enabled, optimizer.params.lr' in out
    assert "passed to the script unchanged" in out and "the profile launch measures the precision" in out


@pytest.mark.parametrize("key", ["fp16", "bf16"])
def test_with_model_info_given_a_precision_left_to_the_trainer_is_refused(key):
    config = load_config({key: {"enabled": "auto"}, "autotuning": {"model_info": {"num_params": 1000}}})
    with pytest.raises(ConfigError, match=rf'{key}.enabled is "auto" and autotuning.model_info is given'):
        check_trainer_autos(config, ON_DEEPSPEED, "run_clm.py", "ds.json")


def test_deepspeeds_memory_model_costs_an_auto_bucket_at_deepspeeds_default():
    assert zero_knob({"reduce_bucket_size": "auto"}, "reduce_bucket_size", 2) == DEFAULTS["reduce_bucket_size"]
    auto = {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    assert deepspeed_state_bytes(10**9, 8.0, 3, 2, 2, auto) == deepspeed_state_bytes(10**9, 8.0, 3, 2, 2, {})


def settings(engine: str, base: dict, **kwargs) -> ExperimentSettings:
    return ExperimentSettings(script="run_clm.py", script_args=("--deepspeed", "ds.json"), base_config=base,
                              nproc_per_node=2, data_parallel_size=2, objective=Objective("throughput"),
                              timeout_s=30.0, engine=engine, **kwargs)


def test_on_deepspeeds_engine_train_batch_size_is_left_for_deepspeed_to_derive():
    """Written out, the Trainer compares it with its own product, whose world is 1 on a CPU-only
    machine; DeepSpeed derives the same micro x gas x world itself."""
    experiment = Experiment(1, 4, 2)
    derived = experiment_config(experiment, settings("deepspeed", {"train_batch_size": "auto"}))
    assert "train_batch_size" not in derived
    assert derived["train_micro_batch_size_per_gpu"] == 4 and derived["gradient_accumulation_steps"] == 2
    # A fixed train_batch_size is the user's, and mapped to a flag it must have a value.
    assert experiment_config(experiment, settings("deepspeed", {"train_batch_size": 16}))["train_batch_size"] == 16
    mapped = settings("deepspeed", {}, arg_mappings={"train_batch_size": "--total"})
    assert experiment_config(experiment, mapped)["train_batch_size"] == 16
    assert experiment_config(experiment, settings("autotuner", {}))["train_batch_size"] == 16
    # The optimal config keeps the user's other keys ("auto" ones too) but not a batch "auto".
    user = {"train_batch_size": "auto", "gradient_clipping": "auto", "autotuning": {"enabled": True}}
    optimal = with_user_keys(user, derived)
    assert "train_batch_size" not in optimal and optimal["gradient_clipping"] == "auto"
    assert "autotuning" not in optimal


@pytest.mark.parametrize("bad, mention", [
    ({"gradient_clipping": "high"}, 'gradient_clipping: got "high"; expected a number >= 0 (0 disables clipping) '
                                    'or "auto"'),
    ({"fp16": {"enabled": "maybe"}}, 'fp16.enabled: got "maybe"; expected true, false or "auto"'),
    ({"zero_optimization": {"reduce_bucket_size": "aut"}}, 'reduce_bucket_size: got "aut"; expected a positive '
                                                           'integer, a list of them, or "auto"'),
])
def test_a_misspelt_auto_is_refused_naming_auto_as_allowed(bad, mention):
    with pytest.raises(ConfigError) as caught:
        load_config(bad, name="ds.json")
    assert mention in str(caught.value)


def test_engine_detection_keeps_the_gpt2_example_on_ours():
    from autotuner.app.engines import script_engine, trains_on_ours

    example = Path(MINIMAL).parents[1] / "hf_gpt2" / "train.py"  # imports transformers and autotuner
    assert script_engine(str(example)).engine == "autotuner" and trains_on_ours(str(example))


def test_a_trainer_script_is_one_that_imports_the_trainer_and_not_autotuner(tmp_path):
    from autotuner.app.engines import trains_with_trainer

    trainer = tmp_path / "run_clm.py"
    trainer.write_text("from transformers import (\n    Trainer,\n    TrainingArguments,\n)\n")
    ours = tmp_path / "ours.py"
    ours.write_text("import autotuner\nfrom transformers import Trainer\n")  # our engine, whatever else it imports
    plain = tmp_path / "plain.py"
    plain.write_text("import deepspeed\nfrom transformers import AutoModel\n")
    assert [trains_with_trainer(str(p)) for p in (trainer, ours, plain)] == [True, False, False]


def test_a_tuned_key_is_written_in_the_users_spelling_and_only_once():
    # Hugging Face's documented ZeRO-3 config spells stage3_gather_16bit_weights_on_model_save; the
    # tuned config holds the field's own name. Both in one file: our config and DeepSpeed's refuse it.
    # And the Trainer checks "bf16" against its --bf16 flag, where the user's "bfloat16" passed.
    user = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 10**9},
            "bfloat16": {"enabled": True}}
    tuned = {"zero_optimization": {"stage": 2, "gather_16bit_weights_on_model_save": False}, "bf16": {"enabled": True},
             "train_micro_batch_size_per_gpu": 2}
    optimal = with_user_keys(user, tuned)
    assert optimal == {"zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_save": False,
                                             "sub_group_size": 10**9},
                       "bfloat16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2}
    assert load_config(optimal).precision == "bf16"  # one spelling: it loads, as tuned
    # Written in our spelling where the user gave none.
    assert with_user_keys({}, tuned) == tuned


def test_deepspeeds_deprecated_cpu_offload_flags_are_read_as_deepspeed_reads_them():
    # DeepSpeed 0.19.8: cpu_offload true is offload_optimizer {device: cpu}, cpu_offload_param true
    # offload_param's; false is none; beside the section it replaces, DeepSpeed refuses the file.
    # They were set aside unread, so the memory model planned an offloaded optimizer as resident.
    config = load_config({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True}})
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.zero_optimization.offload_param.device == "cpu"
    assert load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization.offload_optimizer is None
    with pytest.raises(ConfigError) as caught:
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}},
                    name="ds.json")
    assert str(caught.value) == ("ds.json: zero_optimization.cpu_offload: DeepSpeed's deprecated spelling of "
                                 "offload_optimizer, which is set too; DeepSpeed refuses both, so keep only "
                                 "offload_optimizer")
    with pytest.raises(ConfigError, match=r"cpu_offload_param: got .*expected true or false"):
        load_config({"zero_optimization": {"stage": 3, "cpu_offload_param": "yes"}})
    # The tuned config writes the section, so the user's deprecated flag is not written beside it.
    user = {"zero_optimization": {"stage": 2, "cpu_offload": True, "sub_group_size": 10**9}}
    tuned = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert with_user_keys(user, tuned) == {"zero_optimization": {"stage": 2, "sub_group_size": 10**9,
                                                                 "offload_optimizer": {"device": "cpu"}}}
