"""The engine on 2 gloo ranks, started by our launcher: stage parity, gas, checkpoints, metrics."""

import json

import pytest

from autotuner.config import read_config_file

from conftest import CONFIGS, MINIMAL, assert_no_children_left, run_engine_check, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STAGES = ("0", "1", "2", "3")


# One launch runs every engine check in turn (each launch costs seconds of start-up on 2 cores).
ENGINE_CHECKS = ("parity", "gas", "checkpoint", "checkpoint_state", "bf16", "non_finite", "activation_checkpointing", "compile", "deepspeed_signatures")


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    result = run_engine_check(",".join(ENGINE_CHECKS), tmp_path_factory.mktemp("engine_checks"), 2)
    assert_no_children_left()
    return result["checks"]


def run_check(check: str, checks: dict) -> dict:
    return checks[check]


def test_every_stage_gives_stage0_losses(checks):
    losses = run_check("parity", checks)["losses"]
    assert len(losses["0"]) == 5
    for stage in ("1", "2", "3"):
        assert losses[stage] == pytest.approx(losses["0"], abs=1e-5), f"stage {stage}"
    assert len(set(losses["0"])) > 1  # the model really trained on changing data


def test_a_step_with_an_inf_gradient_is_skipped_as_deepspeed_skips_it(checks):
    """DeepSpeed 0.19.8 on one CPU rank, the same inf loss after one step: skipped at ZeRO 1-3 in
    fp32 and bf16 and at stage 0 in bf16 (its bf16 optimizer's check_grad_overflow); applied at
    stage 0 in fp32, whose weights then hold NaN. With bf16.check_grad_overflow false, DeepSpeed's
    ZeRO 1/2 optimizer applies it too (its engine on one CPU rank: skipped_steps 0 at stages 1-2,
    1 at 0 and 3)."""
    result = run_check("non_finite", checks)
    skipped = [False, 1, True, True, 0, True]  # applied, skipped_steps, weights kept, finite, schedule, next loss finite
    applied = [True, 0, False, False, 1, False]
    for stage in (0, 1, 2, 3):
        assert result[f"{stage}_bf16"] == skipped, stage
        assert result[f"{stage}_fp32"] == (skipped if stage else applied), stage
        assert result[f"{stage}_bf16_unchecked"] == (applied if stage in (1, 2) else skipped), stage
    # compute_grad_norm false (DeepSpeed: stages 1-2, clipping 0): no norm kept; fp32 applies the
    # step, bf16's overflow check still skips it (DeepSpeed's engine: skipped_steps 0 and 1, norm None).
    for stage in (1, 2):
        assert result[f"{stage}_fp32_no_norm"] == [*applied, None], stage
        assert result[f"{stage}_bf16_no_norm"] == [*skipped, None], stage


def test_micro2_gas2_equals_micro4_gas1(checks):
    result = run_check("gas", checks)
    for stage in STAGES:
        accumulated, single, initial = result[stage]["2x2"], result[stage]["4x1"], result[stage]["initial"]
        assert accumulated.keys() == single.keys()
        for name in single:
            assert accumulated[name] == pytest.approx(single[name], abs=1e-6), f"stage {stage} {name}"
        moved = max(abs(a - b) for name in single for a, b in zip(single[name], initial[name]))
        assert moved > 1e-3  # the step really changed the parameters


def test_checkpoint_round_trip_gives_identical_losses(checks):
    result = run_check("checkpoint", checks)
    for stage in STAGES:
        record = result[stage]
        assert record["resumed"] == record["continued"], f"stage {stage}"
        assert record["client_state"] == {"note": "three steps"}
        assert record["global_steps"] == 5
        assert record["lr"] == record["lr_continued"]


def test_a_resume_keeps_the_schedule_and_client_state_as_saved_and_starts_a_fresh_accumulation(checks):
    # Saved half-way through the fourth step at gas 2, resumed at gas 4: the next step is a whole
    # window of 4 micro-steps (DeepSpeed does not restore micro_steps), and MultiStepLR's milestone
    # at step 4 still decays the rate (its Counter's int keys had become strings through JSON).
    result = run_check("checkpoint_state", checks)
    for stage in ("0", "3"):
        record = result[stage]
        assert record["tag_dir"] == "7", stage  # a number as a tag, as DeepSpeed's str(tag)
        assert record["client_state_types"] == {"pos": "tuple", "per_class_keys": ["int"]}, stage
        assert record["boundaries"] == [False, False, False, True], stage
        assert record["global_steps"] == 4 and record["lr"] == pytest.approx(0.005), stage
        # Two parameter groups where one was saved: refused in one line before any weight moved.
        assert "has 1 parameter group(s) and this one 2; pass load_optimizer_states=False" in record["split_groups"]
        assert "\n" not in record["split_groups"] and record["split_untouched"], stage


def test_deepspeeds_keyword_arguments_are_honoured_at_every_stage(checks):
    result = run_check("deepspeed_signatures", checks)
    for stage in STAGES:
        record = result[stage]
        returned, loss = record["backward_returns"]
        assert returned == pytest.approx(loss / 2), f"stage {stage}"  # gas 2: the accumulation-scaled loss
        # lr_kwargs reach the schedule at the accumulation boundary only, as in DeepSpeed.
        assert record["lr_kwargs_received"] == [[1, 128]]
        # A schedule that takes no keywords is stepped to the train batch size (DeepSpeed's fallback).
        assert record["fallback_last_epoch"] == record["train_batch_size"] == 8
        assert record["latest"] == "first"  # save_latest=False left it at the earlier tag
        assert "load_module_strict=False" in record["strict_refused"] and "stem.weight" in record["strict_refused"]
        assert record["client_state"] == {"k": 1}
        assert record["non_strict_loaded_trained"] and record["frozen_kept_fresh"] == [True, True]
        # load_lr_scheduler_states=False: the fresh schedule's position (-1, DeepSpeed's not started),
        # where the trained one's is 2 after three steps (as DeepSpeed's last_batch_iteration).
        assert record["steps_and_schedule_after_load"] == [3, -1, 2]
        assert record["module_only"] == [0, 0, True]  # weights only: no steps, no optimizer state
        calls, equal = record["custom_load_fn"]
        assert len(calls) == 1 and "stem.weight" in calls[0] and equal
        calls, equal = record["custom_load_fn_renamed"]
        assert len(calls) == 1 and "head.weight" in calls[0] and "out.weight" not in calls[0] and equal


def test_metrics_written_and_ranks_exit_at_end_profile_step(tmp_path, no_orphans):
    metric_path = tmp_path / "metrics.json"
    config = read_config_file(CONFIGS / "zero2.json")
    config["autotuning"] = {"enabled": True, "start_profile_step": 3, "end_profile_step": 6,
                            "metric_path": str(metric_path)}
    config["gradient_accumulation_steps"] = 2
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--nproc_per_node", "2", MINIMAL, "--deepspeed", config_file, "--steps", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done:" not in result.stdout  # the ranks left at step 6, not after 50 steps
    metrics = json.loads(metric_path.read_text())
    assert metrics["world_size"] == 2 and metrics["zero_stage"] == 2
    assert metrics["micro_batch_size"] == 16 and metrics["gradient_accumulation_steps"] == 2
    assert metrics["train_batch_size"] == 64
    assert metrics["step_wall_s"]["count"] == 4  # steps 3..6 inclusive
    assert metrics["forward"]["count"] == 8 and metrics["backward"]["count"] == 8  # 4 steps x gas 2
    assert metrics["step"]["count"] == 4
    assert metrics["latency"] == pytest.approx(metrics["step_wall_s"]["mean_s"])
    assert metrics["throughput"] == pytest.approx(64 / metrics["latency"])
    assert metrics["latency"] >= metrics["forward"]["mean_s"] * 2
    assert metrics["FLOPS_per_gpu"] > 0
    assert len(metrics["peak_memory_bytes_per_rank"]) == 2
    assert metrics["peak_memory_bytes"] == max(metrics["peak_memory_bytes_per_rank"]) > 50 * 2**20


@pytest.mark.parametrize("stage", ("0", "2"))
def test_profile_run_counts_adam_states_once_replicated_or_sharded(stage, tmp_path, no_orphans):
    info_path = tmp_path / "model_info.json"
    config = read_config_file(CONFIGS / f"zero{stage}.json")
    config["autotuning"] = {"enabled": True, "model_info_path": str(info_path), "model_info": {"profile": True}}
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--nproc_per_node", "2", MINIMAL, "--deepspeed", config_file, "--steps", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(info_path.read_text())
    assert info["zero_stage"] == int(stage) and info["world_size"] == 2
    # Adam's two fp32 moments: 8 bytes per parameter for the whole model, on 1 rank or split over 2.
    assert info["optimizer_state_bytes_per_param"] == pytest.approx(8.0, rel=0.01)
    # The same forward says what each checkpointing policy would hold for the MLP's 4 blocks.
    by_policy = info["activation_bytes_by_policy"]
    assert set(by_policy) == {"none", "full", "selective"} and by_policy["none"] == info["activation_bytes"]
    assert 0 < by_policy["full"] < by_policy["none"]


# Stages 0 (DDP) and 3 (FSDP2, parameters resharded): the engine checks above cover every stage.
@pytest.mark.parametrize("stage", ("0", "3"))
def test_minimal_example_trains_under_each_stage(stage, tmp_path, no_orphans):
    losses_file = tmp_path / "losses.json"
    result = run_launcher("--nproc_per_node", "2", MINIMAL, "--deepspeed", CONFIGS / f"zero{stage}.json",
                          "--steps", "30", "--losses_out", losses_file, "--save_dir", tmp_path / "ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(losses_file.read_text())
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5  # it learns
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step30"


def test_bf16_trains_under_every_stage_close_to_fp32(checks):
    bf16 = run_check("bf16", checks)["losses"]
    fp32 = run_check("parity", checks)["losses"]
    for stage in STAGES:
        assert bf16[stage] == pytest.approx(fp32[stage], rel=0.05), f"stage {stage}"
        assert bf16[stage] != fp32[stage]  # it really ran in bf16


def test_every_activation_checkpointing_policy_trains_like_none_at_every_stage_and_checkpoints_load_across(
        checks):
    result = run_check("activation_checkpointing", checks)
    for stage in STAGES:
        record = result[stage]
        assert record["checkpointed_blocks"] == {"none": 0, "full": 3, "selective": 3}, f"stage {stage}"
        for policy in ("full", "selective"):
            assert record["losses"][policy] == pytest.approx(record["losses"]["none"], abs=1e-5), f"{stage} {policy}"
        assert len(set(record["losses"]["none"])) > 1
        # Saved under "full", loaded under "selective": parameter names are the same under every policy.
        assert record["resumed_under_selective"] == pytest.approx(record["continued"], abs=1e-6), f"stage {stage}"


def test_compiled_blocks_train_like_eager_ones_at_every_stage(checks):
    result = run_check("compile", checks)
    for stage in STAGES:
        record = result[stage]
        assert record["is_compiled"], f"stage {stage}"
        # inductor fuses the block's ops, so the sums round differently: equal within 1e-4.
        assert record["compiled"] == pytest.approx(record["eager"], abs=1e-4), f"stage {stage}"
        assert len(set(record["eager"])) > 1
