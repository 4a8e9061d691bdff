"""The memory model fitted to allocator peaks measured on CUDA, and CPU offload as a search fallback."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotuner.config import load_config
from autotuner.tuning.memory.estimate import ModelProfile, PeakFit, StageSettings, estimate, model_state_bytes
from autotuner.tuning.profiling.launches import peak_fit
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.searches.stage_search import run_search
from autotuner.tuning.space.search_space import SearchPolicy
from autotuner.tuning.space.experiment import Experiment
from fakes import FakeRunner, book_over_ledger, experiment_settings, model_info, never_called, ok, orchestrator

MiB = 2**20
P = 100_000_000


def info(micro: int, forward_backward_mib: float, step_mib: float, stage: int = 0):
    return model_info(micro, stage, "bf16", forward_backward_peak_bytes=int(forward_backward_mib * MiB),
                      optimizer_step_peak_bytes=int(step_mib * MiB))


def test_peak_fit_is_a_line_through_the_two_forward_backward_peaks_and_the_larger_step_peak():
    fit = peak_fit([info(2, 3000, 2500), info(1, 2000, 2600)])
    assert fit == PeakFit(0, "bf16", 1000 * MiB, 1000 * MiB, 2600 * MiB)


def test_peak_fit_needs_phase_peaks_from_both_launches():
    assert peak_fit([model_info(1), model_info(2)]) is None
    assert peak_fit([info(1, 2000, 2600)]) is None


def test_peak_fit_never_has_a_negative_slope():
    assert peak_fit([info(1, 2000, 100), info(2, 1990, 100)]).per_sample_bytes == 0


def fitted(stage: int = 0, fixed_mib: int = 1000, per_sample_mib: int = 500, step_mib: int = 1800) -> ModelProfile:
    fit = PeakFit(stage, "bf16", fixed_mib * MiB, per_sample_mib * MiB, step_mib * MiB)
    return ModelProfile(P, 400 * MiB, peak_fits=(fit,), num_shard_units=10)


@pytest.mark.parametrize("micro", [1, 2, 3, 8])
def test_at_the_profiled_stage_the_estimate_is_the_larger_of_the_two_measured_branches(micro):
    total = estimate(fitted(), StageSettings(0, "bf16", 1), micro).total
    assert total == max(1000 * MiB + 500 * MiB * micro, 1800 * MiB)


def test_parts_still_add_up_to_the_fitted_total():
    parts = estimate(fitted(), StageSettings(0, "bf16", 1), 4)
    assert parts.activations == 4 * 500 * MiB
    assert parts.total == 3000 * MiB


def test_other_stages_of_the_engine_move_by_the_analytic_difference():
    profile = fitted()
    z0, z1 = (model_state_bytes(profile, StageSettings(s, "bf16", 4)) for s in (0, 1))
    sharded_optimizer = z0.optimizer_states - z1.optimizer_states
    assert sharded_optimizer > 0
    for micro in (1, 8):
        assert (estimate(profile, StageSettings(0, "bf16", 4), micro).total
                - estimate(profile, StageSettings(1, "bf16", 4), micro).total) == sharded_optimizer


def test_ddp_gradient_accumulation_keeps_gradients_through_the_next_forward():
    profile = fitted(step_mib=0)
    one, two = (estimate(profile, StageSettings(0, "bf16", 1, gradient_accumulation_steps=g), 4).total for g in (1, 2))
    assert two - one == 4 * P


def test_fsdp2_stage_2_holds_its_unsharded_copy_in_forward_backward_only():
    profile = fitted(stage=3, step_mib=100_000)  # a step peak above everything: stage 2 adds nothing to it
    z2, z3 = (estimate(profile, StageSettings(s, "bf16", 1), 4).total for s in (2, 3))
    assert z2 == z3
    profile = fitted(stage=3, step_mib=0)
    z2, z3 = (estimate(profile, StageSettings(s, "bf16", 1), 4).total for s in (2, 3))
    buffers = [model_state_bytes(profile, StageSettings(s, "bf16", 1)).working_buffers for s in (2, 3)]
    assert z2 - z3 == buffers[0] - buffers[1] > 0


def test_offload_removes_the_sharded_states_from_a_fitted_estimate():
    profile = fitted(stage=3)
    kept = estimate(profile, StageSettings(3, "bf16", 1), 2).total
    offloaded = estimate(profile, StageSettings(3, "bf16", 1, offload_optimizer=True, offload_param=True), 2).total
    # Forward+backward holds no gradients (freed at each step): fp32 parameters and two Adam moments leave.
    assert kept - offloaded == 12 * P


def test_a_fit_of_another_precision_or_engine_is_not_used():
    profile = fitted(stage=0)
    analytic = ModelProfile(P, 400 * MiB, num_shard_units=10)
    assert estimate(profile, StageSettings(0, "fp32", 1), 4) == estimate(analytic, StageSettings(0, "fp32", 1), 4)
    assert estimate(profile, StageSettings(3, "bf16", 1), 4) == estimate(analytic, StageSettings(3, "bf16", 1), 4)


# ----- offload as the way to fit -----
def offload_tuner(tmp_path, device_type: str, zero: dict | None = None):
    config = load_config({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": True},
                          "zero_optimization": {"stage": "all", **(zero or {})},
                          "autotuning": {"enabled": True, "max_train_micro_batch_size_per_gpu": 16}})
    settings = experiment_settings(config, script_args=(), nproc_per_node=1, data_parallel_size=1)
    # 100 M parameters need 1.6 GB of fp32 states and Adam moments alone
    return book_over_ledger(config, settings, ModelProfile(P, 100 * MiB, num_shard_units=10), "bf16", 1200 * MiB,
                            device_type)


def test_a_stage_that_fits_nothing_on_a_gpu_is_offered_offload(tmp_path):
    tuner = offload_tuner(tmp_path, "cuda")
    assert tuner.memory.predicted_largest() == {0: 0, 1: 0, 2: 0, 3: 0}
    assert tuner.memory.offload_fallback(0) is None and tuner.memory.offload_fallback(1) is None
    knobs, largest = tuner.memory.offload_fallback(3)
    assert knobs == {"offload_optimizer": "cpu", "offload_param": "cpu"} and largest >= 1
    assert tuner.memory.fits(Experiment(3, largest, 1).with_knobs(knobs))
    # DeepSpeed offloads parameters at stage 3 only
    assert tuner.memory.offload_fallback(2)[0] == {"offload_optimizer": "cpu"}


def test_no_offload_is_offered_off_cuda_or_over_the_users_own_offload_section(tmp_path):
    assert offload_tuner(tmp_path, "cpu").memory.offload_fallback(3) is None
    user = offload_tuner(tmp_path, "cuda", {"offload_optimizer": {"device": "none"}})
    assert user.memory.offload_fallback(3) is None


def test_the_search_launches_only_offloaded_experiments_when_nothing_else_fits(tmp_path):
    tuner = offload_tuner(tmp_path, "cuda")
    launched, lines = [], []

    def evaluate(experiment):
        launched.append(experiment)
        return TrialResult(experiment, TrialState.OK, value=float(experiment.micro_batch_size))

    run_search(tuner.space, SearchPolicy(Objective("throughput"), "gridsearch", 5, 50, 0, True), tuner.memory.predicted_largest(), evaluate,
               lambda stage, reason, text: lines.append(f"pruned {stage}"), tuner.memory.fits, tuner.memory.offload_fallback,
               lines.append)
    assert launched and all(dict(e.knobs).get("offload_optimizer") == "cpu" for e in launched)
    assert {e.zero_stage for e in launched} <= {2, 3}
    assert "pruned 0" in lines and "pruned 1" in lines
    assert any(line.startswith("ZeRO 2: fits no micro-batch on the device; searched with offload_optimizer.device=cpu")
               for line in lines)
    config = launched[0].apply({"zero_optimization": {"offload_optimizer": {"pin_memory": True}}}, 1)
    assert config["zero_optimization"]["offload_optimizer"] == {"pin_memory": True, "device": "cpu"}
    assert "_oocpu" in launched[0].name


# ----- regression against what an H100 measured (benchmarks/gpu/memory_error.py, since removed, and offload_demo.py) -----
# Per preset: parameters, transformer blocks, and the fits the profile launches printed
# (MiB: forward+backward fixed, per sample, optimizer step) for DDP (ZeRO 0) and FSDP2 (ZeRO 3).
H100_FITS = {
    "gpt2": (124_439_808, 12, (2248, 1365.3, 2932), (1590, 1130.0, 2470)),
    "gpt2-medium": (354_823_168, 24, (6154, 2708.9, 8187), (4226, 2034.5, 6833)),
    "gpt2-large": (774_030_080, 36, (13742, 4459.8, 18072), (9320, 3289.1, 15118)),
}
RESULTS = __import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def h100_profile(preset: str) -> ModelProfile:
    params, blocks, ddp, fsdp = H100_FITS[preset]
    fits = tuple(PeakFit(stage, "bf16", int(fixed * MiB), int(per_sample * MiB), int(step * MiB))
                 for stage, (fixed, per_sample, step) in ((0, ddp), (3, fsdp)))
    return ModelProfile(params, 0, num_shard_units=blocks, peak_fits=fits)


def test_fitted_model_predicts_every_measured_h100_peak_within_2_percent():
    import csv

    rows = list(csv.DictReader((RESULTS / "gpu_memory_model.csv").open()))
    assert len(rows) == 36
    for row in rows:
        stage, micro = int(row["zero_stage"]), int(row["micro_batch_size"])
        predicted = estimate(h100_profile(row["preset"]), StageSettings(stage, "bf16", 1), micro).total
        measured = float(row["allocated_mib"]) * MiB
        assert abs(predicted - measured) / measured < 0.02, row


def test_fitted_model_predicts_the_measured_h100_offload_peaks_within_2_percent():
    import csv

    rows = [r for r in csv.DictReader((RESULTS / "gpu_offload_experiments.csv").open()) if r["state"] == "ok"]
    assert len(rows) == 3
    for row in rows:
        knobs = dict(kv.split("=") for kv in row["knobs"].split(";"))
        settings = StageSettings(int(row["zero_stage"]), "bf16", 1, offload_optimizer=knobs.get("offload_optimizer") == "cpu",
                                 offload_param=knobs.get("offload_param") == "cpu")
        predicted = estimate(h100_profile("gpt2-medium"), settings, int(row["micro_batch_size"])).total
        measured = float(row["measured_memory_mib"]) * MiB
        assert abs(predicted - measured) / measured < 0.02, (row["name"], predicted / MiB, measured / MiB)


# ----- regression against what an H200 measured on DeepSpeed's engine (benchmarks/gpu/vs_deepspeed_gpu.py) -----
def test_on_deepspeeds_engine_a_zero_0_fit_predicts_the_measured_zero_1_peaks():
    # gpt2-medium, bf16, sequence 1024, 1 GPU. The profile launches (ZeRO 0, micro-batch 1 and 32)
    # printed: forward+backward 4802 MiB + 2034.8 MiB per sample, optimizer step 8187 MiB. ZeRO 1
    # then measured these allocated peaks; the analytic activations (1642 MiB per sample) fell
    # 17% short at micro-batch 64 before the fit was carried across DeepSpeed's stages.
    import json

    runs = json.loads((RESULTS / "gpu_vs_deepspeed_runs.json").read_text())["runs"]["predictive"]["per_experiment"]
    measured = {int(e["name"].split("mbs")[1]): e["measured_memory_mib"] for e in runs
                if e["name"].startswith("z1_") and e["state"] == "ok"}
    assert sorted(measured) == [4, 16, 32, 64]
    fit = PeakFit(0, "bf16", int(4802 * MiB), int(2034.8 * MiB), int(8187 * MiB))
    profile = ModelProfile(354_823_168, int(1642.21 * MiB), peak_fits=(fit,), num_shard_units=24, engine="deepspeed")
    for micro, mib in measured.items():
        predicted = estimate(profile, StageSettings(1, "bf16", 1), micro).total
        assert predicted / MiB == pytest.approx(mib, rel=0.02), micro
    # Our engine keeps fits per family: FSDP2 computes in pure bf16 where DDP runs under autocast.
    assert replace(profile, engine="autotuner").peak_fit(2) is None


MIB = 2**20


def test_a_negative_correction_learnt_on_small_sizes_is_not_carried_16x_further():
    """Issue 49's H200 launch: FSDP2 at micro-batch 1024 after a profile at 1 and 64. The fit on
    those two peaks said "analytic + 11 MiB - 11.00 MiB per sample", and carried to 1024 it
    predicted 127,347 MiB where the launch peaked at 136,366 (6.6% short). Held at its value at
    64, the correction leaves the analytic per-sample bytes to grow alone: within 2%, and above."""
    from autotuner.tuning.memory.peak_fit import PeakObservation, fit_residuals

    analytic = {1: 5_000 * MIB, 64: 13_300 * MIB, 1024: 138_600 * MIB}  # 132 MiB a sample over 64 -> 1024
    residual = {1: 0, 64: (11 - 11 * 64) * MIB}  # the line through both: 11 MiB - 11 MiB per sample
    fit = fit_residuals([PeakObservation("FSDP2", m, analytic[m], analytic[m] + residual[m]) for m in (1, 64)])["FSDP2"]
    assert fit.per_sample_bytes / MIB == pytest.approx(-11.0)
    carried = analytic[1024] + fit.fixed_bytes + fit.per_sample_bytes * 1024  # the old prediction
    assert carried / MIB == pytest.approx(127_347, abs=1)
    predicted = analytic[1024] + fit.bytes_at(1024)
    measured = 136_366 * MIB
    assert measured <= predicted <= 1.02 * measured
    # Where it was measured the fit is unchanged.
    assert fit.bytes_at(64) == residual[64] and fit.bytes_at(1) == residual[1]


def test_a_positive_correction_is_still_carried_beyond_the_measured_sizes():
    from autotuner.tuning.memory.peak_fit import PeakObservation, fit_residuals

    fit = fit_residuals([PeakObservation("DDP", 2, 100 * MIB, 110 * MIB),
                         PeakObservation("DDP", 8, 400 * MIB, 470 * MIB)])["DDP"]
    assert fit.per_sample_bytes == pytest.approx(10 * MIB)
    assert fit.bytes_at(64) == pytest.approx(fit.fixed_bytes + 10 * MIB * 64, abs=1)


# ----- every H200 peak of the "memory far from the profile" sweeps (benchmarks/gpu/memory_far.py) -----
F62ECC4_TUNE_LOGS = ("gpu_memory_far_tunes256_sweep_medium_memory_tune.log",
                     "gpu_memory_far_tune_large1024_sweep_large_memory_tune.log")
PHASE_MODEL_TUNE = "gpu_memory_far_phase_model_memory_tune"  # the same three tunes at 15ba4b0, 2026-11-27


def _memory_far_profiles(logs=F62ECC4_TUNE_LOGS) -> dict:
    """Per (preset, sequence): the profile the tune printed (its log), as the memory model holds it."""
    import re

    blocks = {"gpt2-medium": 24, "gpt2-large": 36}
    profiles = {}
    for log in (RESULTS / name for name in logs):
        for chunk in log.read_text().split("===== ")[1:]:
            preset, rest = chunk.split(":", 1)
            size = re.search(r"profile: ([\d,]+) parameters, ([\d.]+) MiB activations per sample.*baseline (\d+) MiB",
                             chunk)
            fits = tuple(
                PeakFit(stage, "bf16", int(float(fixed) * MiB), int(float(per_sample) * MiB), int(float(step) * MiB))
                for stage, family in ((0, "DDP"), (3, "FSDP2"))
                for fixed, per_sample, step in re.findall(
                    family + r" measured peaks: forward\+backward (\d+) MiB \+ ([\d.]+) MiB per sample, optimizer "
                    r"step (\d+)", chunk))
            profiles[(preset, int(rest.split(":")[0]))] = ModelProfile(
                int(size.group(1).replace(",", "")), int(float(size.group(2)) * MiB),
                baseline_bytes=int(size.group(3)) * MiB, num_shard_units=blocks[preset], peak_fits=fits)
    return profiles


def test_every_h200_peak_far_from_the_profile_is_predicted_no_more_than_2_percent_short():
    """Issue 49's sweeps: gpt2-medium and gpt2-large, bf16, micro-batches 1 to 256 on one H200, each
    launch's allocated peak beside what the profile's phase fits (forward+backward line and the
    optimizer step's peak) predict for it. DDP is within 2.1% at every size (2.03% over at
    micro-batch 4), up to 128x the profile's first; no launch is predicted more than 2% short, and every launch that ran out of memory was
    predicted beyond the device. FSDP2 is predicted high (11-27% from micro-batch 4 on): its slope
    is held at the analytic activation bytes the DDP launch measured under autocast, above the
    pure-bf16 slope FSDP2 runs at. Safe, but room left unused: the residual fit corrects it only
    up to the largest size measured."""
    import csv

    profiles = _memory_far_profiles()
    assert set(profiles) == {("gpt2-medium", 256), ("gpt2-large", 256), ("gpt2-large", 1024)}
    checked = ooms = 0
    for sweep in sorted(RESULTS.glob("gpu_memory_far_*_sweep.csv")):
        for row in csv.DictReader(sweep.open()):
            stage, micro = int(row["zero_stage"]), int(row["micro_batch_size"])
            predicted = estimate(profiles[(row["preset"], int(row["seq_len"]))], StageSettings(stage, "bf16", 1),
                                 micro).total / MiB
            if row["state"] == "oom":
                assert predicted > 143_771, row  # the H200's memory: its launch could not fit
                ooms += 1
                continue
            measured = float(row["peak_allocated_mib"])
            assert predicted >= 0.98 * measured, (row["preset"], stage, micro, predicted, measured)
            if stage == 0:
                assert predicted <= 1.021 * measured, (row["preset"], stage, micro, predicted, measured)
            checked += 1
    assert (checked, ooms) == (19, 4)


def test_every_h200_launch_of_the_phase_model_tunes_is_predicted_at_most_3_percent_short_by_its_profile():
    """The tuner's own launches on the current model (2026-11-27, docs/gpu.md): three tunes, no OOM.
    Each launch's allocated peak beside what that tune's profile (phase fits, read from its log)
    predicts (the phase fits alone; the tune also had its residual fits). The largest shortfall is
    DDP on gpt2-large, sequence 256, at micro-batch 64, four times the profile's 16: 3.0% (2.9% by
    the tune with its residual fit; the line through micro-batch 1 is a little flat). FSDP2 is
    predicted 14-27% high, its own profile's second size included: its slope is held at the
    activation bytes the DDP launch measured under autocast; the residual fit corrects it up to the
    largest size measured, and past it the tune's first FSDP2 launch was 10-17% high."""
    import csv

    profiles = _memory_far_profiles((PHASE_MODEL_TUNE + ".log",))
    assert set(profiles) == {("gpt2-medium", 256), ("gpt2-large", 256), ("gpt2-large", 1024)}
    errors = []
    for row in csv.DictReader((RESULTS / (PHASE_MODEL_TUNE + ".csv")).open()):
        assert row["state"] == "ok", row
        stage, micro = int(row["zero_stage"]), int(row["micro_batch_size"])
        predicted = estimate(profiles[(row["preset"], int(row["seq_len"]))], StageSettings(stage, "bf16", 1),
                             micro).total / MiB
        measured = float(row["measured_memory_mib"])
        errors.append((predicted - measured) / measured)
    assert len(errors) == 24
    assert min(errors) == pytest.approx(-0.030, abs=0.002)  # DDP, gpt2-large 256, micro-batch 64
    assert max(errors) == pytest.approx(0.270, abs=0.005)  # FSDP2, gpt2-large 256, the profile's micro-batch 16


def test_the_first_search_launch_after_a_bf16_profile_is_predicted_from_its_phase_fit(tmp_path):
    """The H200 run of 2026-11-27 (docs/gpu.md, ZeRO 1 only, DeepSpeed's engine, gpt2-medium at
    sequence 1024): the profile launches (micro-batch 1 and 32) printed forward+backward 5304 MiB +
    2019.2 MiB per sample, and micro-batch 52 then peaked at 110,615 MiB. The residual fit had been
    taken while the book still held the default fp32, so it measured the peaks against the analytic
    activations (1642 MiB a sample) and added +371 MiB a sample on top of the bf16 phase fit: 52 was
    predicted 13.6% high, and 60, which fits the 10% margin, was never launched."""
    fixed, per_sample, step, device = 5304 * MiB, int(2019.2 * MiB), 7512 * MiB, 141_829 * MiB

    def forward_backward(micro: int) -> int:
        return fixed + per_sample * micro

    def answer(trial):
        micro = trial.experiment.micro_batch_size
        peak = max(forward_backward(micro), step)
        result = ok(trial, float(micro), peak)
        if not trial.profile:
            return result
        info = model_info(micro, 1, "bf16", num_params=354_823_168, trainable_num_params=354_823_168,
                          activation_bytes=int(1642.21 * MiB) * micro, peak_memory_bytes=peak, world_size=1,
                          forward_backward_peak_bytes=forward_backward(micro), optimizer_step_peak_bytes=step,
                          device_memory_bytes=device, engine="deepspeed", num_shard_units=24)
        return replace(result, model_info=info)

    config = load_config({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
                          "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                          "autotuning": {"enabled": True, "fast": True, "max_train_micro_batch_size_per_gpu": 64,
                                         "history": False}})
    runner = FakeRunner(answer)
    settings = experiment_settings(config, nproc_per_node=1, data_parallel_size=1, engine="deepspeed")
    orchestrator(tmp_path, config, runner, settings).tune()
    searched = [t for t in runner.trials if not t.profile]
    assert searched, runner.names
    for trial in searched:
        micro = trial.experiment.micro_batch_size
        assert trial.predicted_memory_bytes == pytest.approx(forward_backward(micro), rel=0.01), micro
    # The largest size whose line fits 90% of the device: 60 (126,456 MiB), not 52.
    assert max(t.experiment.micro_batch_size for t in searched) == 60
