"""The memory model against hand-computed byte counts (arithmetic written out), and its
derived promises: activations scale, the largest micro-batch fits, stages are monotonic."""

from __future__ import annotations

import math

import pytest

from autotuner.config import load_config
from autotuner.tuning.memory.estimate import (
    MemoryEstimate,
    ModelProfile,
    StageSettings,
    calibrate_baseline,
    estimate,
    max_micro_batch_size,
    model_state_bytes,
    usable_bytes,
)
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from fakes import FakeRunner, book_over_ledger, experiment_settings, never_called, orchestrator

P = 1_000_000  # parameters
W = 2  # data-parallel ranks
MiB = 2**20
UNITS = 10  # FSDP2 shard units
BLOCK = P // UNITS  # 100_000 parameters per unit
ADAM = 8  # bytes per parameter: two fp32 moments

PROFILE = ModelProfile(num_params=P, activation_bytes_per_sample=0, num_shard_units=UNITS)

# (stage, precision) -> (parameters, gradients, optimizer_states, working_buffers), W = 2, block = 100_000.
EXPECTED = {
    # stage 0 (DDP): fp32 params + grads, DDP buckets 4P, autocast copy 2P under bf16/fp16, full Adam states.
    (0, "fp32"): (4 * P, 4 * P, ADAM * P, 4 * P),
    (0, "bf16"): (4 * P, 4 * P, ADAM * P, 4 * P + 2 * P),
    (0, "fp16"): (4 * P, 4 * P, ADAM * P, 4 * P + 2 * P),
    # stage 1: as stage 0, optimizer states sharded over W.
    (1, "fp32"): (4 * P, 4 * P, ADAM * P // W, 4 * P),
    (1, "bf16"): (4 * P, 4 * P, ADAM * P // W, 4 * P + 2 * P),
    (1, "fp16"): (4 * P, 4 * P, ADAM * P // W, 4 * P + 2 * P),
    # stage 2 (FSDP2): everything sharded; the whole compute copy + one block of fp32 grads in flight.
    (2, "fp32"): (4 * P // W, 4 * P // W, ADAM * P // W, 4 * P + 4 * BLOCK),
    (2, "bf16"): (4 * P // W, 4 * P // W, ADAM * P // W, 2 * P + 4 * BLOCK),
    (2, "fp16"): (4 * P // W, 4 * P // W, ADAM * P // W, 2 * P + 4 * BLOCK),
    # stage 3: two blocks (running + prefetched) of compute params and fp32 grads.
    (3, "fp32"): (4 * P // W, 4 * P // W, ADAM * P // W, 2 * (4 + 4) * BLOCK),
    (3, "bf16"): (4 * P // W, 4 * P // W, ADAM * P // W, 2 * (2 + 4) * BLOCK),
    (3, "fp16"): (4 * P // W, 4 * P // W, ADAM * P // W, 2 * (2 + 4) * BLOCK),
}


def parts(estimate_: MemoryEstimate) -> tuple[int, int, int, int]:
    return (estimate_.parameters, estimate_.gradients, estimate_.optimizer_states, estimate_.working_buffers)


@pytest.mark.parametrize(("stage", "precision"), sorted(EXPECTED))
def test_model_states_by_stage_and_precision(stage, precision):
    got = model_state_bytes(PROFILE, StageSettings(stage, precision, world_size=W))
    assert parts(got) == EXPECTED[(stage, precision)]
    assert got.activations == 0
    assert got.baseline == 0
    assert got.total == sum(EXPECTED[(stage, precision)])


def test_worked_totals():
    # Written out once in full, so a reader can check the table above.
    assert model_state_bytes(PROFILE, StageSettings(0, "fp32", W)).total == 4_000_000 * 3 + 8_000_000  # 20 MB
    assert model_state_bytes(PROFILE, StageSettings(1, "bf16", W)).total == 4_000_000 * 2 + 4_000_000 + 6_000_000
    assert model_state_bytes(PROFILE, StageSettings(2, "bf16", W)).total == (
        2_000_000 + 2_000_000 + 4_000_000 + 2_000_000 + 400_000)
    assert model_state_bytes(PROFILE, StageSettings(3, "fp32", W)).total == (
        2_000_000 + 2_000_000 + 4_000_000 + 1_600_000)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_is_costed_differently_from_fp32(stage):
    # DeepSpeed's autotuner costs bf16 as fp32; ours counts the 2-byte compute copies.
    fp32 = model_state_bytes(PROFILE, StageSettings(stage, "fp32", W)).total
    bf16 = model_state_bytes(PROFILE, StageSettings(stage, "bf16", W)).total
    fp16 = model_state_bytes(PROFILE, StageSettings(stage, "fp16", W)).total
    assert bf16 != fp32
    assert bf16 == fp16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_contiguous_gradients_drops_the_ddp_bucket_copy(stage, precision):
    plain = model_state_bytes(PROFILE, StageSettings(stage, precision, W))
    contiguous = model_state_bytes(PROFILE, StageSettings(stage, precision, W, contiguous_gradients=True))
    assert plain.working_buffers - contiguous.working_buffers == 4 * P
    autocast = 2 * P if precision == "bf16" else 0
    assert contiguous.working_buffers == autocast


@pytest.mark.parametrize("stage", [2, 3])
def test_contiguous_gradients_does_not_apply_to_fsdp(stage):
    plain = model_state_bytes(PROFILE, StageSettings(stage, "fp32", W))
    contiguous = model_state_bytes(PROFILE, StageSettings(stage, "fp32", W, contiguous_gradients=True))
    assert contiguous == plain


def test_stage_0_ignores_world_size_and_stage_1_divides_only_the_optimizer():
    for w in (1, 2, 4, 8):
        z0 = model_state_bytes(PROFILE, StageSettings(0, "fp32", w))
        z1 = model_state_bytes(PROFILE, StageSettings(1, "fp32", w))
        assert parts(z0) == (4 * P, 4 * P, 8 * P, 4 * P)
        assert parts(z1) == (4 * P, 4 * P, 8 * P // w, 4 * P)


def test_world_size_below_one_counts_as_one():
    z3 = model_state_bytes(PROFILE, StageSettings(3, "fp32", world_size=0))
    assert (z3.parameters, z3.gradients, z3.optimizer_states) == (4 * P, 4 * P, 8 * P)


def test_optimizer_state_bytes_per_param_is_used():
    sgd = ModelProfile(P, 0, optimizer_state_bytes_per_param=4.0, num_shard_units=UNITS)  # momentum only
    assert model_state_bytes(sgd, StageSettings(0, "fp32", W)).optimizer_states == 4 * P
    assert model_state_bytes(sgd, StageSettings(1, "fp32", W)).optimizer_states == 4 * P // W
    assert model_state_bytes(sgd, StageSettings(3, "fp32", W)).optimizer_states == 4 * P // W


def test_unknown_shard_units_use_the_whole_model_as_one_block():
    unknown = ModelProfile(P, 0, num_shard_units=0)
    assert model_state_bytes(unknown, StageSettings(2, "fp32", W)).working_buffers == 4 * P + 4 * P
    assert model_state_bytes(unknown, StageSettings(3, "fp32", W)).working_buffers == 2 * (4 + 4) * P
    assert model_state_bytes(unknown, StageSettings(3, "bf16", W)).working_buffers == 2 * (2 + 4) * P


def test_block_is_rounded_up():
    odd = ModelProfile(1_000_001, 0, num_shard_units=10)
    block = math.ceil(1_000_001 / 10)  # 100_001
    assert block == 100_001
    assert model_state_bytes(odd, StageSettings(3, "fp32", W)).working_buffers == 2 * (4 + 4) * block
    assert model_state_bytes(odd, StageSettings(2, "bf16", W)).working_buffers == 2 * 1_000_001 + 4 * block


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_offload_optimizer_below_stage_2_zeroes_optimizer_states_only(stage, precision):
    kept = model_state_bytes(PROFILE, StageSettings(stage, precision, W))
    offloaded = model_state_bytes(PROFILE, StageSettings(stage, precision, W, offload_optimizer=True))
    assert offloaded.optimizer_states == 0
    assert (offloaded.parameters, offloaded.gradients, offloaded.working_buffers) == (
        kept.parameters, kept.gradients, kept.working_buffers)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", [dict(offload_optimizer=True), dict(offload_param=True),
                                     dict(offload_optimizer=True, offload_param=True)])
@pytest.mark.parametrize("stage", [2, 3])
def test_any_offload_at_stage_2_and_3_leaves_only_compute_copies_on_the_device(stage, offload, precision):
    """FSDP2's CPUOffloadPolicy keeps the sharded fp32 parameters and gradients on the host and steps
    the optimizer there: either DeepSpeed section turns it on, and the device holds only what computes."""
    kept = model_state_bytes(PROFILE, StageSettings(stage, precision, W))
    offloaded = model_state_bytes(PROFILE, StageSettings(stage, precision, W, **offload))
    assert (offloaded.parameters, offloaded.gradients, offloaded.optimizer_states) == (0, 0, 0)
    assert offloaded.working_buffers == kept.working_buffers > 0
    assert offloaded.total == kept.working_buffers + kept.baseline


@pytest.mark.parametrize("stage", [0, 1])
def test_offload_param_does_not_apply_below_stage_2(stage):
    kept = model_state_bytes(PROFILE, StageSettings(stage, "fp32", W))
    assert model_state_bytes(PROFILE, StageSettings(stage, "fp32", W, offload_param=True)) == kept


def test_baseline_is_carried():
    profile = ModelProfile(P, 0, baseline_bytes=300_000_000, num_shard_units=UNITS)
    states = model_state_bytes(profile, StageSettings(0, "fp32", W))
    assert states.baseline == 300_000_000
    assert states.total == 20 * P + 300_000_000


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_activations_scale_with_micro_batch(stage):
    act = 3_000_000  # bytes per sample
    profile = ModelProfile(P, act, baseline_bytes=1_000, num_shard_units=UNITS)
    settings = StageSettings(stage, "bf16", W)
    states = model_state_bytes(profile, settings).total
    for micro in (1, 2, 7, 64):
        got = estimate(profile, settings, micro)
        assert got.activations == act * micro
        assert got.total == states + act * micro
        assert parts(got) == parts(model_state_bytes(profile, settings))


def test_usable_bytes():
    assert usable_bytes(1_000_000_000, 0.1) == 900_000_000
    assert usable_bytes(1_000_000_000, 0.0) == 1_000_000_000


@pytest.mark.parametrize("margin", [0.0, 0.1, 0.25])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_max_micro_batch_size_is_the_largest_that_fits(stage, precision, margin):
    profile = ModelProfile(P, 1_234_567, baseline_bytes=5_000_000, num_shard_units=UNITS)
    settings = StageSettings(stage, precision, W)
    budget = 200_000_000
    usable = int(budget * (1 - margin))
    largest = max_micro_batch_size(profile, settings, budget, margin)
    assert largest >= 1
    assert estimate(profile, settings, largest).total <= usable
    assert estimate(profile, settings, largest + 1).total > usable


def test_max_micro_batch_size_worked_example():
    # stage 0 fp32: 20 MB of states + 1 MB baseline; 10 MB activations per sample; budget 100 MB, margin 0.1.
    profile = ModelProfile(P, 10_000_000, baseline_bytes=1_000_000, num_shard_units=UNITS)
    # usable 90 MB - 21 MB = 69 MB of room -> 6 samples (60 MB); 7 would need 70 MB.
    assert max_micro_batch_size(profile, StageSettings(0, "fp32", W), 100_000_000, 0.1) == 6


def test_max_micro_batch_size_is_zero_when_states_alone_do_not_fit():
    profile = ModelProfile(P, 1_000, num_shard_units=UNITS)
    states = model_state_bytes(profile, StageSettings(0, "fp32", W)).total  # 20 MB
    assert max_micro_batch_size(profile, StageSettings(0, "fp32", W), states, 0.1) == 0  # 18 MB usable
    assert max_micro_batch_size(profile, StageSettings(0, "fp32", W), states // 2, 0.0) == 0
    # Exactly full: no room for a single sample.
    assert max_micro_batch_size(profile, StageSettings(0, "fp32", W), states, 0.0) == 0
    # A higher stage that shards the states may fit where stage 0 does not.
    assert max_micro_batch_size(profile, StageSettings(3, "fp32", W), states, 0.1) > 0


def test_max_micro_batch_size_when_less_than_one_sample_fits():
    profile = ModelProfile(P, 10 * P, num_shard_units=UNITS)
    budget = 20 * P + 5 * P  # 5 MB of room, a sample needs 10 MB
    assert max_micro_batch_size(profile, StageSettings(0, "fp32", W), budget, 0.0) == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 64])
def test_higher_stages_never_need_more(world_size, precision):
    # Adam, many shard units, DDP buckets not contiguous (the default).
    profile = ModelProfile(10 * P, 2_000_000, baseline_bytes=1_000_000, num_shard_units=48)
    totals = [estimate(profile, StageSettings(stage, precision, world_size), 4).total for stage in range(4)]
    assert totals == sorted(totals, reverse=True), totals
    budget = 400_000_000
    largest = [max_micro_batch_size(profile, StageSettings(stage, precision, world_size), budget) for stage in range(4)]
    assert largest == sorted(largest), largest


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_calibrate_baseline_recovers_a_known_baseline(stage, precision):
    baseline = 123_456_789
    truth = ModelProfile(P, 2_500_000, baseline_bytes=baseline, num_shard_units=UNITS)
    settings = StageSettings(stage, precision, W)
    measured = estimate(truth, settings, 8).total
    # The profile passed in may carry any (e.g. stale) baseline: it is not part of what is explained.
    stale = ModelProfile(P, 2_500_000, baseline_bytes=999, num_shard_units=UNITS)
    assert calibrate_baseline(stale, settings, 8, measured) == baseline
    assert calibrate_baseline(truth, settings, 8, measured) == baseline


def test_calibrate_baseline_is_never_negative():
    profile = ModelProfile(P, 2_500_000, num_shard_units=UNITS)
    settings = StageSettings(0, "fp32", W)
    explained = estimate(profile, settings, 4).total
    assert calibrate_baseline(profile, settings, 4, explained) == 0
    assert calibrate_baseline(profile, settings, 4, explained - 1) == 0
    assert calibrate_baseline(profile, settings, 4, 0) == 0


# ----- the orchestrator's verdict before each launch, corrected by measured peaks -----
def calibrating_tuner(tmp_path, budget_mib: int = 1000):
    config = load_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "all"},
                          "autotuning": {"enabled": True}})
    settings = experiment_settings(config, script_args=())
    lines: list[str] = []
    tuner = book_over_ledger(config, settings, ModelProfile(25_000_000, 2**20, baseline_bytes=150 * MiB,
                                                            num_shard_units=6),
                             budget_bytes=budget_mib * MiB, report=lines.append)
    return tuner, lines


def measured(tuner, experiment, peak_bytes, state=None):
    return TrialResult(experiment, state or TrialState.OK, value=1.0 if state is None else None,
                       predicted_memory_bytes=tuner.memory.predicted_memory(experiment),
                       measured_memory_bytes=peak_bytes)


def test_fits_keeps_the_safety_margin_until_an_engine_has_been_measured(tmp_path):
    tuner, _ = calibrating_tuner(tmp_path)
    usable = usable_bytes(tuner.memory.budget_bytes, 0.1)
    for stage in (0, 1, 2, 3):
        for micro in (1, 16, 64, 256):
            experiment = Experiment(stage, micro)
            assert tuner.memory.fits(experiment) == (tuner.memory.predicted_memory(experiment) <= usable)


def test_a_measured_overrun_is_allowed_for_in_later_launches_of_that_engine(tmp_path):
    tuner, lines = calibrating_tuner(tmp_path)

    def largest(stage):
        return max(m for m in range(1, 2000) if tuner.memory.fits(Experiment(stage, m)))

    largest_before, largest_ddp_before = largest(2), largest(0)
    # An FSDP2 launch peaked 200 MiB over the model.
    probe = Experiment(3, 8)
    tuner.learn(measured(tuner, probe, tuner.memory.predicted_memory(probe) + 200 * MiB))
    largest_after = largest(2)
    # 200 MiB over: 200 MiB less room, 1 MiB per sample (sizes beyond the one measured keep the whole margin).
    assert largest_before - largest_after == pytest.approx(200, abs=2)
    # DDP, not measured yet, borrows FSDP2's fit and keeps the whole margin; once measured, it has its own.
    assert largest(0) == pytest.approx(largest_ddp_before - 200, abs=1)
    ddp = Experiment(0, 8)
    tuner.learn(measured(tuner, ddp, tuner.memory.analytic_memory(ddp) + 50 * MiB))
    assert largest(0) == pytest.approx(largest_ddp_before - 50, abs=1)
    assert largest_before - largest(2) == pytest.approx(200, abs=2)
    assert lines[0] == ("memory model: FSDP2 fitted on 1 measured peak(s): analytic + 200 MiB + 0.00 MiB per sample "
                        "(none)")


def test_on_a_cpu_half_the_margin_holds_only_up_to_the_largest_size_measured(tmp_path):
    # Beyond it the fit extrapolates: a launch predicted at 94% of a 1 GiB budget, past the two
    # sizes the profile measured, peaked at 1032 MiB (the RSS varies ~10% between launches).
    tuner, _ = calibrating_tuner(tmp_path)
    for micro in (4, 8):
        tuner.learn(measured(tuner, Experiment(0, micro), tuner.memory.predicted_memory(Experiment(0, micro))))

    def fits_at_93_percent(micro):
        tuner.with_facts(budget_bytes=int(tuner.memory.predicted_memory(Experiment(0, micro)) / 0.93))
        return tuner.memory.fits(Experiment(0, micro))

    assert fits_at_93_percent(8) and fits_at_93_percent(4)  # measured range: half the margin
    assert not fits_at_93_percent(9) and not fits_at_93_percent(16)  # beyond it: the whole margin


def test_on_a_gpu_a_measured_fit_keeps_the_whole_margin(tmp_path):
    # The fit is of allocated bytes; the caching allocator's reserved slack is what runs out. On an
    # H200 a ZeRO-0 launch predicted at 94% of the room (inside half the margin) ran out of memory.
    tuner, _ = calibrating_tuner(tmp_path)
    tuner.with_facts(device_type="cuda")
    for micro in (4, 8):
        tuner.learn(measured(tuner, Experiment(0, micro), tuner.memory.predicted_memory(Experiment(0, micro))))
    tuner.with_facts(budget_bytes=int(tuner.memory.predicted_memory(Experiment(0, 8)) / 0.93))
    assert not tuner.memory.fits(Experiment(0, 8))  # 93% of the room: over the whole margin
    tuner.with_facts(device_type="cpu")  # where the fitted RSS is itself the limited quantity
    assert tuner.memory.fits(Experiment(0, 8))


def test_peaks_at_two_sizes_fit_the_per_sample_growth_the_analytic_model_misses(tmp_path):
    tuner, lines = calibrating_tuner(tmp_path)
    truth = lambda e: tuner.memory.analytic_memory(e) + 30 * MiB + 3 * MiB * e.micro_batch_size  # noqa: E731
    for micro in (2, 32):
        tuner.learn(measured(tuner, Experiment(0, micro), truth(Experiment(0, micro))))
    for micro in (1, 8, 64, 200):
        assert tuner.memory.predicted_memory(Experiment(0, micro)) == pytest.approx(truth(Experiment(0, micro)), abs=2)
    # FSDP2, measured once, keeps its own offset but borrows DDP's per-sample growth.
    tuner.learn(measured(tuner, Experiment(3, 16), tuner.memory.analytic_memory(Experiment(3, 16)) + 100 * MiB))
    memory = tuner.memory
    fsdp = lambda m: memory.predicted_memory(Experiment(3, m)) - memory.analytic_memory(Experiment(3, m))  # noqa: E731
    assert fsdp(16) == pytest.approx(100 * MiB, abs=2)
    assert fsdp(48) - fsdp(16) == pytest.approx(32 * 3 * MiB, abs=2)
    assert "(borrowed from DDP)" in lines[-1]


def test_an_oom_raises_the_fitted_line_to_the_budget_there(tmp_path):
    tuner, lines = calibrating_tuner(tmp_path)
    for micro in (2, 16):
        e = Experiment(0, micro)
        tuner.learn(measured(tuner, e, tuner.memory.analytic_memory(e) + 10 * MiB))
    oom = Experiment(0, 100)
    assert tuner.memory.fits(Experiment(0, 90))
    tuner.learn(measured(tuner, oom, None, TrialState.OOM))
    assert tuner.memory.predicted_memory(oom) >= tuner.memory.budget_bytes
    assert not tuner.memory.fits(Experiment(0, 90))  # the line pivots on 16, so sizes just below rise too
    e = Experiment(0, 16)
    assert tuner.memory.predicted_memory(e) == pytest.approx(tuner.memory.analytic_memory(e) + 10 * MiB, abs=2)
    assert "(raised by OOM)" in lines[-1]


def test_an_allocator_oom_without_a_measured_peak_counts_as_the_whole_budget(tmp_path):
    from autotuner.tuning.space.records import TrialState
    tuner, _ = calibrating_tuner(tmp_path)
    oom = Experiment(1, 64)
    tuner.learn(measured(tuner, oom, None, TrialState.OOM))
    assert not tuner.memory.fits(oom)


def test_a_cpu_budget_says_once_how_to_make_the_resident_set_predictable_unless_it_is():
    from autotuner.config.models import DeepSpeedConfig
    from autotuner.tuning.memory.estimate import ModelProfile
    from autotuner.tuning.models.memory_book import MemoryBook, memory_facts
    from autotuner.tuning.space.search_space import SearchSpace

    def book(autotuning: dict, device_memory: int | None = None) -> MemoryBook:
        config = DeepSpeedConfig.model_validate({"train_micro_batch_size_per_gpu": "auto",
                                                 "autotuning": {"enabled": True, **autotuning}})
        space = SearchSpace(stages=(0,), data_parallel_size=2, max_micro_batch_size=8)
        return MemoryBook(memory_facts(config, space, ModelProfile(1000, 0), "fp32", device_memory, 2**34, 2, {}),
                          lambda: ())

    budgeted = book({"memory_per_rank_bytes": 2**30})
    assert "MALLOC_MMAP_THRESHOLD_=131072" in budgeted.budget_note({})
    assert budgeted.budget_note({"MALLOC_MMAP_THRESHOLD_": "131072"}) is None
    unbudgeted = book({})  # the machine's RAM: nothing to hold to
    assert unbudgeted.budget_note({}) is None
    on_gpu = book({"memory_per_rank_bytes": 2**30}, 80 * 2**30)
    assert on_gpu.budget_note({}) is None


def test_a_variant_not_measured_yet_borrows_no_downward_correction():
    """Issue 49: compiled variants peaked 8-10% above a fit learnt on their eager twins. Until a
    compiled peak is in, a negative correction of the engine's fit does not lower its prediction;
    once one is, the fit applies as to any measured configuration."""
    from autotuner.config.models import DeepSpeedConfig
    from autotuner.tuning.memory.estimate import ModelProfile
    from autotuner.tuning.models.memory_book import memory_facts
    from autotuner.tuning.space.search_space import SearchSpace
    from fakes import BookOverLedger

    mib = 2**20
    config = DeepSpeedConfig.model_validate({"train_micro_batch_size_per_gpu": "auto", "compile": {"enabled": "auto"},
                                             "autotuning": {"enabled": True}})
    space = SearchSpace(stages=(0,), data_parallel_size=1, max_micro_batch_size=32)
    tuner = BookOverLedger(memory_facts(config, space, ModelProfile(num_params=1_000_000,
                                                                   activation_bytes_per_sample=8 * mib),
                                        "fp32", None, 2**34, 1, {"contiguous_gradients": True}))
    book = tuner.memory
    eager = [Experiment(0, m, 1, (("compile", False),)) for m in (2, 8)]
    for experiment in eager:  # the analytic model over-counts eager peaks by 20 MiB at each size
        tuner.learn(TrialResult(experiment, TrialState.OK, measured_memory_bytes=book.analytic_memory(experiment) - 20 * mib))
    compiled = Experiment(0, 16, 1, (("compile", True),))
    assert book.predicted_memory(eager[1]) == book.analytic_memory(eager[1]) - 20 * mib
    assert book.predicted_memory(compiled) == book.analytic_memory(compiled)  # nothing of its own measured
    tuner.learn(TrialResult(Experiment(0, 4, 1, (("compile", True),)), TrialState.OK,
                           measured_memory_bytes=book.analytic_memory(Experiment(0, 4, 1, (("compile", True),))) - 20 * mib))
    assert book.predicted_memory(compiled) < book.analytic_memory(compiled)


def test_the_memory_budget_is_the_users_else_the_ranks_device_else_the_hosts_share():
    from autotuner.tuning.models.memory_book import memory_budget

    assert memory_budget(3 * MiB, 80 * 2**30, 64 * 2**30, 2) == 3 * MiB
    assert memory_budget(None, 80 * 2**30, 64 * 2**30, 2) == 80 * 2**30
    assert memory_budget(None, None, 64 * 2**30, 2) == 32 * 2**30


def test_tensor_parallel_divides_only_the_split_parameters_and_the_stage_divides_by_dp_once():
    # DeepSpeed issue 6796: its autotuner shards the states over all 4 GPUs and then divides the sum by
    # mp_size again, 20P / (4 x 2) at ZeRO 3 (fp16 Adam), below what any rank can hold. Here the plan's
    # split parameters are divided by tp, the replicated ones not, and ZeRO 3 shards a rank's share over
    # the data-parallel size (4 ranks / tp 2 = 2), once.
    whole, split = 1_000_000, 800_000
    profile = ModelProfile(num_params=whole, activation_bytes_per_sample=0, tensor_parallel=2, split_num_params=split)
    assert profile.params_per_tp_rank == 200_000 + 400_000
    z3 = model_state_bytes(profile, StageSettings(3, "fp32", world_size=2))
    per_rank = 600_000 // 2
    assert (z3.parameters, z3.gradients, z3.optimizer_states) == (4 * per_rank, 4 * per_rank, 8 * per_rank)
    deepspeed_6796 = 20 * whole // (4 * 2)  # its fp16 figure: 2 + 2 + 16 bytes a parameter, divided twice
    ours_fp16 = model_state_bytes(profile, StageSettings(3, "fp16", world_size=2))
    assert ours_fp16.parameters + ours_fp16.gradients + ours_fp16.optimizer_states > deepspeed_6796
    # Stage 0 holds a rank's share whole; without tensor parallelism nothing changes.
    z0 = model_state_bytes(profile, StageSettings(0, "fp32", world_size=2))
    assert z0.parameters == 4 * 600_000
    assert ModelProfile(num_params=whole, activation_bytes_per_sample=0).params_per_tp_rank == whole
