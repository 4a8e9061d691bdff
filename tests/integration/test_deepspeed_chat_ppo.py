"""A DeepSpeed-Chat step-3 (PPO) shaped script (tests/workers/dschat_ppo_train.py) on 2 CPU ranks,
with only its deepspeed imports swapped (issue 77): four engines in one process, the reference and
reward models without an optimizer, the critic trained through `forward_value` reached via the
engine, fp16's overflow record and --align_overflow's calls, and at ZeRO 3 the critic and reward
models built under DeepSpeed's own zero.Init and loaded inside GatheredParameters(modifier_rank=0).
ZeRO 3 needs DeepSpeed (transformers' HfDeepSpeedConfig requires it); those cases skip without it."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, experiments_table, run_launcher, tune, write_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs DeepSpeed: pip install 'autotuner[deepspeed]'")
SCRIPT = WORKERS / "dschat_ppo_train.py"
STAGES = [0, 2, pytest.param(3, marks=needs_deepspeed)]


def ppo(root: Path, name: str, stage: int, *flags: str):
    """One run from the shared step 1 and 2 checkpoints: (its record, its stderr)."""
    out = root / name
    done = run_launcher("--nproc_per_node", "2", SCRIPT, "--checkpoints", root / "checkpoints", "--output_dir", out,
                        "--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage), *flags, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "record.json").read_text()), done.stderr


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ppo")


@pytest.fixture(scope="module")
def fp32_runs(root):
    """fp32 at each stage: {stage: (record, stderr)}, filled as the tests ask."""
    return {}


def fp32_run(root, runs, stage):
    if stage not in runs:
        runs[stage] = ppo(root, f"fp32_z{stage}", stage, "--dtype", "fp32")
    return runs[stage]


def saved(out: Path, model: str) -> dict[str, torch.Tensor]:
    return torch.load(out / model / "pytorch_model.bin", weights_only=True)


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_trains_all_four_engines_as_stage_0_does(root, fp32_runs, stage):
    record, stderr = fp32_run(root, fp32_runs, stage)
    reference, _ = fp32_run(root, fp32_runs, 0)
    # The reference and reward engines were built without an optimizer, as DeepSpeed builds them.
    assert record["engines"] == ["AdamW", None, "AdamW", None]
    assert record["ref_backward"].startswith("UnsupportedError: engine.backward: this engine was built without an "
                                             "optimizer")
    # The critic and reward models hold step 2's weights after loading (at ZeRO 3 they were
    # DeepSpeed partitions, loaded inside GatheredParameters on rank 0 and gathered at initialize).
    assert record["critic_and_reward_from_checkpoint"] == [0.0, 0.0]
    # Every step, both trained engines: the same losses and rewards as stage 0 (fp32: the same math).
    assert record["skipped"] == [0, 0]
    for ours, theirs in zip(record["steps"], reference["steps"]):
        for key in ("actor_loss", "critic_loss", "reward"):
            assert math.isfinite(ours[key])
            assert ours[key] == pytest.approx(theirs[key], abs=1e-4), (key, record["steps"], reference["steps"])
    # The steps moved the weights: later steps differ from the first.
    assert record["steps"][2]["actor_loss"] != pytest.approx(record["steps"][0]["actor_loss"], abs=1e-3)
    # DeepSpeed-Chat's prescale_gradients false is DeepSpeed's default: nothing to warn about.
    assert "prescale_gradients" not in stderr


@pytest.mark.parametrize("stage", STAGES)
def test_the_saved_actor_and_critic_are_whole_and_equal_stage_0s(root, fp32_runs, stage):
    fp32_run(root, fp32_runs, stage)
    fp32_run(root, fp32_runs, 0)
    checkpoint = torch.load(root / "checkpoints" / "critic_init" / "pytorch_model.bin", weights_only=True)
    for model in ("actor", "critic"):
        ours, theirs = saved(root / f"fp32_z{stage}", model), saved(root / "fp32_z0", model)
        assert ours and all(type(value) is torch.Tensor for value in ours.values())
        # At ZeRO 3 dschat's save_zero_three_model writes named_parameters(): the head tied to the
        # embedding is listed once, under the embedding's name, as on DeepSpeed.
        tied = {"lm_head.weight"} if stage == 3 and model == "actor" else set()
        assert set(ours) == set(theirs) - tied
        for key, value in ours.items():
            assert value.shape == theirs[key].shape, key
            assert torch.allclose(value, theirs[key], atol=1e-5), key
    assert sorted(saved(root / f"fp32_z{stage}", "critic")) == sorted(checkpoint)


def test_a_config_built_in_code_says_what_is_not_used_once_on_a_plain_launch(root, fp32_runs):
    _, stderr = fp32_run(root, fp32_runs, 0)
    # The actor's and the critic's dicts both carry these: one line for both.
    line = ("initialize(config=...): accepted but not used by autotuner: zero_optimization.memory_efficient_linear, "
            "hybrid_engine (hybrid_engine: generation runs Hugging Face's generate on the training module, without "
            "DeepSpeed's inference kernels or its inference tensor parallelism)")
    assert stderr.count(line) == 1, stderr[-3000:]
    assert stderr.count("initialize(config=...): accepted but not used by autotuner: "
                        "zero_optimization.memory_efficient_linear\n") == 1, stderr[-3000:]


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_keeps_deepspeeds_overflow_record_and_align_overflow_skips_both_engines_together(root, fp32_runs, stage):
    record, _ = ppo(root, f"fp16_z{stage}", stage, "--dtype", "fp16", "--align_overflow", "--num_steps", "5")
    reference, _ = fp32_run(root, fp32_runs, 0)
    # At ZeRO 3 DeepSpeed's Init cast the checkpoint to fp16 before it reached our engine.
    assert max(record["critic_and_reward_from_checkpoint"]) < (2e-3 if stage == 3 else 1e-7)
    steps = record["steps"]
    assert all(math.isfinite(step[key]) for step in steps for key in ("actor_loss", "critic_loss", "reward"))
    assert steps[0]["actor_loss"] == pytest.approx(reference["steps"][0]["actor_loss"], abs=2e-2)
    assert steps[0]["critic_loss"] == pytest.approx(reference["steps"][0]["critic_loss"], abs=2e-2)
    # get_overflow reads each engine's last step; with --align_overflow a step either engine
    # overflowed is skipped by both (the other through optimizer.skip_step).
    assert all(isinstance(flag, bool) for step in steps for flag in step["overflow"])
    either = sum(any(step["overflow"]) for step in steps)
    assert record["skipped"] == [either, either]
    assert 0 < either  # fp16's first steps overflow at DeepSpeed's initial scale of 2**16


def test_without_align_overflow_each_engine_skips_what_it_overflowed(root):
    record, _ = ppo(root, "fp16_z0_own", 0, "--dtype", "fp16", "--num_steps", "5")
    steps = record["steps"]
    assert record["skipped"] == [sum(step["overflow"][0] for step in steps), sum(step["overflow"][1] for step in steps)]


PPO_TUNING = {"enabled": True, "start_profile_step": 2, "end_profile_step": 3, "exp_timeout_s": 120,
              "tuner_type": "gridsearch", "remeasure_rounds": 0, "history": False,
              # Only the batch is mapped; the stage is laid over the measured engine's own dict.
              "arg_mappings": {"train_micro_batch_size_per_gpu": "--per_device_training_batch_size",
                               "gradient_accumulation_steps": "--gradient_accumulation_steps"}}


def test_a_tune_is_for_the_first_engine_built_with_an_optimizer_and_leaves_the_others_their_own(root, tmp_path,
                                                                                            no_orphans):
    # Micro-batch 1 only (the script's default is 2): the stages are the search; the mapped flag
    # reaching every engine shows at 1 as at 2.
    config = write_json(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": [1],
                                              "gradient_accumulation_steps": 1, "zero_optimization": {"stage": [0, 2]},
                                              "autotuning": PPO_TUNING})
    done = tune(tmp_path, config, "--checkpoints", root / "checkpoints", "--dtype", "fp32", "--num_steps", "4",
                "--output_dir", tmp_path / "out", "--critic_zero_stage", "0", script=SCRIPT, mode="run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = experiments_table(tmp_path / "autotuning_results")
    assert set(table.state) == {"ok"} and set(table.zero_stage) == {0, 2}
    for row in table.itertuples():  # each experiment's measured (actor) engine ran what it is recorded under
        metrics = json.loads((tmp_path / "autotuning_exps" / row.name / "metrics.json").read_text())
        assert (metrics["zero_stage"], metrics["micro_batch_size"]) == (row.zero_stage, row.micro_batch_size)
    assert ("the script made 4 engines; the tuned values are for the first it built with an optimizer "
            "(OPTForCausalLM), and are laid over that engine's config only") in done.stdout
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "Engines: the script made 4; the tuned values are for the first it built with an optimizer " \
           "(OPTForCausalLM)" in summary
    # The pick trains on the actor; the reference follows --actor_zero_stage's 0 (dschat's rule), the
    # critic its own flag and the reward model the critic's: their configs are their own.
    picked = table[table.chosen].iloc[0]
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["stages"] == [int(picked.zero_stage), 0, 0, 0]
    assert record["micro_batches"] == [int(picked.micro_batch_size)] * 4  # the mapped flag reaches every engine
    assert all(math.isfinite(step["actor_loss"]) for step in record["steps"])
