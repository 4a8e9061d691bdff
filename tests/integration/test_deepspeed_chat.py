"""A DeepSpeed-Chat step-1 shaped script (tests/workers/dschat_style_train.py: its config built in
code, LoRA fused under GatheredParameters(modifier_rank=0), engine.gradient_checkpointing_enable(),
rank 0 saving model.module.state_dict(), save_zero_three_model's ds_id test) on 2 CPU ranks, with
only its deepspeed imports swapped (issue 67)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, experiments_table, launcher_env, run_launcher, tune, write_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs DeepSpeed: pip install 'autotuner[deepspeed]'")
SCRIPT = WORKERS / "dschat_style_train.py"
LORA = ("--lora_dim", "4", "--only_optimize_lora")


def train(out: Path, stage: int, *flags: str):
    done = run_launcher("--nproc_per_node", "2", SCRIPT, "--zero_stage", str(stage), "--output_dir", out, *flags,
                        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """One training per ZeRO stage, LoRA and gradient checkpointing on: {stage: output dir}."""
    root = tmp_path_factory.mktemp("dschat")
    outputs = {}
    for stage in (0, 1, 2, 3):
        train(root / f"z{stage}", stage, *LORA, "--gradient_checkpointing")
        outputs[stage] = root / f"z{stage}"
    return outputs


def saved(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "pytorch_model.bin", weights_only=True)


def assert_same_model(out: Path, reference: Path, atol: float = 1e-5) -> None:
    """What the script saved loads with from_pretrained and equals the reference training's weights."""
    from transformers import AutoModelForCausalLM

    state = saved(out)
    assert state and all(type(value) is torch.Tensor for value in state.values()), {type(v) for v in state.values()}
    model, expected = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(reference)
    ours, theirs = model.state_dict(), expected.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        assert value.shape == theirs[key].shape, key
        assert torch.allclose(value, theirs[key], atol=atol, rtol=1e-5), key


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_saves_the_whole_model_that_stage_0_trains(stages, stage):
    # Ranks seed their models differently: every stage starts from rank 0's weights, as DeepSpeed's
    # engine does, trains to the same losses, and saves whole weights: rank 0's state_dict at
    # stage 1-2, save_zero_three_model's GatheredParameters at stage 3, after the LoRA fuse.
    assert json.loads((stages[stage] / "losses.json").read_text()) == \
        pytest.approx(json.loads((stages[0] / "losses.json").read_text()), abs=1e-5)
    assert_same_model(stages[stage], stages[0])


def test_the_fused_lora_weights_are_in_the_saved_model(stages):
    # The LoRA factors are dropped from the file, their product added into the frozen base weights:
    # the base weight of a LoRA layer differs from the model's initial one only by the fuse.
    state = saved(stages[3])
    assert not [key for key in state if "lora" in key]
    from transformers import AutoModelForCausalLM, OPTConfig

    torch.manual_seed(1234)  # rank 0's seed: the weights every rank started from
    initial = AutoModelForCausalLM.from_config(OPTConfig.from_json_file(stages[3] / "config.json")).state_dict()
    key = "model.decoder.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(state[key], initial[key], atol=1e-4)
    untouched = "model.decoder.embed_positions.weight"  # no LoRA there, and frozen: as initialised
    assert torch.equal(state[untouched], initial[untouched])


def test_the_engine_passes_unknown_attributes_to_the_model_after_its_own(stages):
    seen = json.loads((stages[0] / "engine_attributes.json").read_text())
    assert seen == {
        "config_is_the_engines": "DeepSpeedConfig",  # the engine's own config comes first
        "model_config_type": "OPTConfig",
        "gradient_checkpointing": True,  # engine.gradient_checkpointing_enable() reached the model
        "generate_is_the_models": True,
        "missing_raises": "'Engine' object has no attribute 'no_such_attribute_anywhere'",
        "parameter_dtypes": ["torch.float32"],
    }
    assert json.loads((stages[3] / "engine_attributes.json").read_text())["gradient_checkpointing"] is True


@needs_deepspeed
def test_a_model_built_under_hf_deepspeed_config_trains_and_saves_at_stage_3(tmp_path):
    # transformers builds it under DeepSpeed's own zero.Init (partitioned, rank 0's weights): gathered
    # whole at initialize, it trains at stage 3 as at stage 0 and saves the same whole model.
    # In bf16, as DeepSpeed-Chat trains: DeepSpeed's Init casts the weights to bf16, and they come back as
    # fp32 parameters holding those values (DeepSpeed's fp32 master weights start from them too).
    flags = (*LORA, "--hf_deepspeed_config", "--dtype", "bf16")
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    train(tmp_path / "z0", 0, *flags)
    done = train(tmp_path / "z3", 3, *flags)
    assert "built under DeepSpeed's own zero.Init" in done.stderr
    assert json.loads((tmp_path / "z3" / "engine_attributes.json").read_text())["parameter_dtypes"] == ["torch.float32"]
    assert json.loads((tmp_path / "z3" / "losses.json").read_text()) == \
        pytest.approx(json.loads((tmp_path / "z0" / "losses.json").read_text()), abs=2e-2)
    assert {value.dtype for value in saved(tmp_path / "z3").values()} == {torch.float32}
    assert_same_model(tmp_path / "z3", tmp_path / "z0", atol=2e-3)
    # DeepSpeed's comm on CPU makes a 66 MiB shared-memory buffer per rank: unlinked once every rank mapped them.
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before


IN_CODE_TUNING = {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, "exp_timeout_s": 120,
                  "tuner_type": "gridsearch", "remeasure_rounds": 0, "history": False,
                  # Only the batch is mapped: the script's --zero_stage (0 by default) is its own.
                  "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                                   "gradient_accumulation_steps": "--gradient_accumulation_steps"}}


def in_code_config(path: Path) -> Path:
    return write_json(path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": [0, 1]}, "autotuning": IN_CODE_TUNING})


def stages_the_ranks_ran(results: Path) -> dict[str, int]:
    runs = {}
    for metrics in sorted((results.parent / "autotuning_exps").glob("*/metrics.json")):
        runs[metrics.parent.name] = json.loads(metrics.read_text())["zero_stage"]
    return runs


def test_on_our_engine_the_tuned_stage_wins_over_the_scripts_own_config(tmp_path, no_orphans):
    done = tune(tmp_path, in_code_config(tmp_path / "ds.json"), "--num_steps", "8", "--output_dir", tmp_path / "out",
                script=SCRIPT, mode="run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    table = experiments_table(results)
    assert set(table.state) == {"ok"} and set(table.zero_stage) == {0, 1}
    ran = stages_the_ranks_ran(results)
    assert {row.name: row.zero_stage for row in table.itertuples()} == ran
    stderr = (tmp_path / "autotuning_exps" / "z1_gas1_mbs2" / "stderr.log").read_text()
    assert ("initialize(config=...): the script's config differs from the tuned values, which our engine trains "
            "with: zero_optimization.stage: 0 -> 1") in stderr
    # The pick trains with its values too: the tune writes them to a file, the command names it, and
    # `run` gives the same file to the ranks.
    picked = table[table.chosen].iloc[0]
    tuned = results.resolve() / "tuned_values.json"
    assert json.loads(tuned.read_text()) == {"values": {"zero_optimization.stage": int(picked.zero_stage),
                                                        "train_micro_batch_size_per_gpu": 2,
                                                        "gradient_accumulation_steps": 1}, "version": 1}
    command = shlex.split((results / "cmd_optimal.txt").read_text())
    assert command[command.index("--tuned_values") + 1] == str(tuned)
    assert not [word for word in command if "AUTOTUNER_" in word]  # a path on a flag, not an env payload
    if picked.zero_stage == 1:
        assert "zero_optimization.stage: 0 -> 1" in done.stderr.split("training with the optimal config")[-1]
    assert json.loads((tmp_path / "out" / "losses.json").read_text())
    # Run by hand, the command trains with what the file says: a stage written there is the one built.
    tuned.write_text(json.dumps({"values": {"zero_optimization.stage": 1}, "version": 1}))
    by_hand = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=300)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert "zero_optimization.stage: 0 -> 1" in by_hand.stderr
    # Without the file, one line naming it, and no rank starts.
    tuned.unlink()
    missing = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2, missing.stderr[-3000:]
    assert missing.stderr.strip().splitlines() == [f"launcher: error: --tuned_values {tuned}: no such file (a tune "
                                                   "writes its tuned_values.json in autotuning.results_dir and names "
                                                   "it in cmd_optimal.txt)"]


@needs_deepspeed
def test_on_deepspeeds_engine_an_experiment_its_ranks_did_not_run_fails_naming_the_mapping(tmp_path, no_orphans):
    # DeepSpeed's --deepspeed is a switch: the config goes by --deepspeed_config, which the script names
    # and then sets aside for its own dict (DeepSpeed takes one of the two).
    command = [sys.executable, "-m", "autotuner", "--autotuning", "tune", "--nproc_per_node", "2", str(SCRIPT),
               "--num_steps", "8", "--engine", "deepspeed", "--deepspeed", "--deepspeed_config",
               str(in_code_config(tmp_path / "ds.json"))]
    done = subprocess.run(command, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = experiments_table(tmp_path / "autotuning_results").set_index("name")
    assert table.loc["z0_gas1_mbs2", "state"] == "ok"
    assert table.loc["z1_gas1_mbs2", "state"] == "failed"
    assert table.loc["z1_gas1_mbs2", "error"] == (
        "the ranks built zero_optimization.stage = 0, not the experiment's 1 (the script's own config set it; map "
        "the key to the script's flag in autotuning.arg_mappings, e.g. \"zero_optimization.stage\": \"--zero_stage\")")
    # No record names a stage its ranks did not run: only the experiment that ran it is ok.
    ran = stages_the_ranks_ran(tmp_path / "autotuning_results")
    assert all(ran[name] == row.zero_stage for name, row in table.iterrows() if row.state == "ok")
    assert "z0_gas1_mbs2 is the optimal setup" in done.stdout
