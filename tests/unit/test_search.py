"""The stage x micro-batch x gas search, run against a fake `evaluate` that simulates OOM
above a threshold micro-batch per stage and returns a known value per experiment."""

from __future__ import annotations

import math
from typing import Callable

import pytest

from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.searches.stage_search import BISECTION_TOLERANCE, confirm_largest, run_search
from autotuner.tuning.space.search_space import SearchPolicy, SearchSpace, spread_micro_batch_sizes
from autotuner.tuning.space.dimensions import full_mode_values, tag
from autotuner.tuning.space.experiment import Experiment

DEFAULT_KNOBS = full_mode_values({}, "autotuner")

THROUGHPUT = Objective("throughput")
LATENCY = Objective("latency")


def default_value(experiment: Experiment) -> float:
    """Throughput grows with micro-batch (and a little with stage), ignoring knobs."""
    return 100.0 * math.log2(1 + experiment.micro_batch_size) + experiment.zero_stage


class FakeRun:
    """An `evaluate` that records every experiment; OOM above `fits[stage]`, else OK with `value(e)`."""

    def __init__(self, fits: dict[int, int], value: Callable[[Experiment], float] = default_value):
        self.fits, self.value, self.calls = fits, value, []

    def __call__(self, experiment: Experiment) -> TrialResult:
        self.calls.append(experiment)
        if experiment.micro_batch_size > self.fits.get(experiment.zero_stage, 0):
            return TrialResult(experiment, TrialState.OOM, error="out of memory on rank 0")
        return TrialResult(experiment, TrialState.OK, value=self.value(experiment))

    def stages(self) -> list[int]:
        return [e.zero_stage for e in self.calls]

    def of_stage(self, stage: int) -> list[Experiment]:
        return [e for e in self.calls if e.zero_stage == stage]


class Prunes(list):
    def __call__(self, stage: int, reason, text: str) -> None:
        self.append((stage, text))


def space(stages=(0, 1, 2, 3), **kwargs) -> SearchSpace:
    kwargs.setdefault("data_parallel_size", 1)
    return SearchSpace(stages=stages, **kwargs)


def policy(**kwargs) -> SearchPolicy:
    # The search rules' own tests: the grid search, a patient early stop, full budget.
    values = dict(objective=THROUGHPUT, tuner_type="gridsearch", early_stopping=50, num_trials=50, seed=0, fast=True)
    return SearchPolicy(**{**values, **kwargs})


# ----- spread_micro_batch_sizes -----

def test_spread_is_geometric_from_the_largest():
    assert spread_micro_batch_sizes(list(range(1, 17)), 16, 3) == [16, 8, 4]
    assert spread_micro_batch_sizes(list(range(1, 65)), 64, 5) == [64, 32, 16, 8, 4]


def test_spread_picks_nearest_valid_sizes_in_log_space():
    divisors = [1, 2, 3, 4, 6, 12]
    assert spread_micro_batch_sizes(divisors, 12, 3) == [12, 6, 3]
    assert spread_micro_batch_sizes([1, 5], 5, 3) == [5, 1]  # duplicates collapse; fewer than asked


def test_spread_stays_within_the_largest_and_valid_sizes():
    valid = [2, 3, 5, 7, 11, 13, 17]
    got = spread_micro_batch_sizes(valid, 11, 4)
    assert got == sorted(got, reverse=True)
    assert got[0] == 11
    assert set(got) <= {m for m in valid if m <= 11}
    assert len(got) == len(set(got))


def test_spread_edge_cases():
    assert spread_micro_batch_sizes([], 8, 3) == []
    assert spread_micro_batch_sizes([16, 32], 8, 3) == []
    assert spread_micro_batch_sizes([1, 2, 4], 4, 0) == []
    assert spread_micro_batch_sizes([4], 4, 5) == [4]


# ----- SearchSpace.gas -----

def test_gas_without_a_target_is_one():
    s = space(data_parallel_size=4)
    assert [s.gas(m) for m in (1, 3, 64)] == [1, 1, 1]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_gas_under_max_train_batch_size(dp):
    cap = 64
    s = space(data_parallel_size=dp, global_batch_size=cap, global_batch_exact=False)
    for micro in range(1, 80):
        if micro * dp > cap:
            assert s.gas(micro) is None
        else:
            assert s.gas(micro) == cap // (micro * dp)
            assert micro * s.gas(micro) * dp <= cap


def test_gas_with_a_fixed_train_batch_size_needs_exact_division():
    s = space(data_parallel_size=2, global_batch_size=24, global_batch_exact=True)
    assert s.valid_micro_batch_sizes(100) == [1, 2, 3, 4, 6, 12]
    for micro in s.valid_micro_batch_sizes(100):
        assert micro * s.gas(micro) * 2 == 24
    assert s.gas(5) is None
    assert s.gas(24) is None  # 24 * 2 > 24


def test_fixed_gas_with_fixed_train_batch_size():
    s = space(data_parallel_size=2, global_batch_size=32, global_batch_exact=True,
              fixed_gradient_accumulation_steps=4)
    assert s.valid_micro_batch_sizes(64) == [4]
    assert s.gas(4) == 4


def test_fixed_gas_without_target():
    s = space(data_parallel_size=2, fixed_gradient_accumulation_steps=3)
    assert s.gas(5) == 3
    assert s.experiment(1, 5) == Experiment(1, 5, 3)


def test_fixed_gas_respects_max_train_batch_size():
    s = space(data_parallel_size=1, global_batch_size=32, global_batch_exact=False,
              fixed_gradient_accumulation_steps=4)
    assert s.gas(8) == 4
    assert s.gas(16) is None
    assert max(s.valid_micro_batch_sizes(64)) == 8


def test_valid_micro_batch_sizes_respect_min_and_max():
    s = space(min_micro_batch_size=3, max_micro_batch_size=6)
    assert s.valid_micro_batch_sizes(100) == [3, 4, 5, 6]
    assert s.valid_micro_batch_sizes(4) == [3, 4]
    assert s.valid_micro_batch_sizes(2) == []


# ----- confirm_largest -----

@pytest.mark.parametrize("threshold", list(range(0, 18)))
def test_confirm_largest_bisects_to_within_ten_percent_of_the_true_threshold(threshold):
    s = space(stages=(1,))
    run = FakeRun({1: threshold})
    largest, results = confirm_largest(s, 1, 16, run)
    if threshold < 1:
        assert largest is None
    else:
        assert min(threshold, 16) / (1 + BISECTION_TOLERANCE) <= largest <= min(threshold, 16)
        # A size that failed, just above the one chosen (or the chosen one is the largest valid).
        failed = [e.micro_batch_size for e in run.calls if e.micro_batch_size > largest]
        assert largest == 16 or min(failed) <= max(largest + 1, largest * (1 + BISECTION_TOLERANCE))
    assert run.calls[0] == Experiment(1, 16)  # the predicted largest first
    assert [r.experiment for r in results] == run.calls
    # Geometric bisection: log2 of the bracket's log-width over the tolerance (plus one for
    # rounding to integer sizes), not a scan.
    assert len(run.calls) <= 2 + math.ceil(math.log2(math.log(16) / math.log(1 + BISECTION_TOLERANCE)))
    assert len(set(run.calls)) == len(run.calls)


def test_confirm_largest_bisects_geometrically():
    run = FakeRun({0: 5})
    largest, _ = confirm_largest(space(stages=(0,)), 0, 16, run)
    assert largest == 5
    assert [e.micro_batch_size for e in run.calls] == [16, 4, 8, 6, 5]


def test_confirm_largest_stops_once_the_bracket_is_within_ten_percent():
    run = FakeRun({0: 470})
    largest, _ = confirm_largest(space(stages=(0,), max_micro_batch_size=1024), 0, 1024, run)
    assert 470 / 1.1 <= largest <= 470
    assert len(run.calls) <= 8  # an integer bisection over 1..1024 takes 11


def test_confirm_largest_tries_the_refitted_models_largest_after_an_oom():
    """A memory model refitted on the OOM moves its largest fitting size down: that size is tried
    next, not the geometric middle of the whole range."""
    limit = {"fits_up_to": 64}
    run = FakeRun({0: 45})

    def evaluate(experiment):
        result = run(experiment)
        if result.state is not TrialState.OK:
            limit["fits_up_to"] = 47  # the refit after the OOM
        return result

    largest, _ = confirm_largest(space(stages=(0,), max_micro_batch_size=64), 0, 64, evaluate,
                                 fits=lambda e: e.micro_batch_size <= limit["fits_up_to"])
    assert [e.micro_batch_size for e in run.calls][:2] == [64, 47]
    assert 45 / 1.1 <= largest <= 45


def test_confirm_largest_treats_failures_as_not_fitting():
    def evaluate(experiment):
        state = TrialState.OK if experiment.micro_batch_size <= 3 else TrialState.FAILED
        return TrialResult(experiment, state, value=1.0 if state is TrialState.OK else None)

    assert confirm_largest(space(stages=(0,)), 0, 10, evaluate)[0] == 3


def test_confirm_largest_only_tries_valid_sizes():
    s = space(stages=(0,), data_parallel_size=2, global_batch_size=24, global_batch_exact=True)
    run = FakeRun({0: 5})
    largest, _ = confirm_largest(s, 0, 11, run)
    assert largest == 4
    assert run.calls[0] == Experiment(0, 6, 2)  # 6 is the largest valid size <= 11
    assert all(e.micro_batch_size in (1, 2, 3, 4, 6) for e in run.calls)


def test_confirm_largest_with_nothing_valid_runs_nothing():
    run = FakeRun({0: 100})
    assert confirm_largest(space(stages=(0,), min_micro_batch_size=4), 0, 2, run) == (None, [])
    assert run.calls == []


# ----- run_search -----

def test_stages_run_in_order():
    run, prunes = FakeRun({0: 4, 1: 8, 2: 16, 3: 32}), Prunes()
    run_search(space(stages=(3, 1, 0, 2)), policy(), {0: 4, 1: 8, 2: 16, 3: 32}, run, prunes)
    assert prunes == []
    stages = run.stages()
    assert stages == sorted(stages)
    assert sorted(set(stages)) == [0, 1, 2, 3]


def test_results_are_the_evaluated_experiments():
    run = FakeRun({0: 4, 1: 8, 2: 16, 3: 32})
    results = run_search(space(), policy(), {0: 4, 1: 8, 2: 16, 3: 32}, run, Prunes())
    assert [r.experiment for r in results] == run.calls
    assert len(set(run.calls)) == len(run.calls)  # nothing is evaluated twice


def test_stage_whose_prediction_is_below_the_minimum_is_pruned():
    run, prunes = FakeRun({0: 100, 1: 100, 2: 100, 3: 100}), Prunes()
    run_search(space(min_micro_batch_size=2), policy(), {0: 0, 1: 1, 2: 8, 3: 16}, run, prunes)
    assert [stage for stage, _ in prunes] == [0, 1]
    assert all("memory model" in reason and "2" in reason for _, reason in prunes)
    assert {0, 1}.isdisjoint(run.stages())
    assert set(run.stages()) == {2, 3}


def slower_with_stage(experiment: Experiment) -> float:
    """Throughput grows with micro-batch; each ZeRO stage costs 10% (the usual case)."""
    return 100.0 * math.log2(1 + experiment.micro_batch_size) * (1 - 0.1 * experiment.zero_stage)


def test_stage_that_cannot_beat_a_lower_stage_is_probed_once_and_pruned():
    run, prunes = FakeRun({0: 16, 1: 16, 2: 16, 3: 32}, slower_with_stage), Prunes()
    run_search(space(), policy(), {0: 16, 1: 16, 2: 8, 3: 32}, run, prunes)
    assert [stage for stage, _ in prunes] == [1, 2]
    assert all(reason.startswith("cannot help") for _, reason in prunes)
    assert "(16)" in prunes[0][1] and "(8)" in prunes[1][1]
    assert "z0_gas1_mbs16's micro-batch it measured" in prunes[0][1]
    # One probe each, at the best micro-batch so far: nothing else of stages 1 and 2 runs.
    assert run.of_stage(1) == [Experiment(1, 16)] and run.of_stage(2) == [Experiment(2, 16)]
    assert Experiment(3, 32) in run.calls


def test_a_probe_that_wins_opens_the_stage_to_the_search():
    # ZeRO 1 fits no more than ZeRO 0 but is faster at the same size (a sharded optimizer step).
    def faster_stage1(experiment: Experiment) -> float:
        return slower_with_stage(experiment) * (1.5 if experiment.zero_stage == 1 else 1.0)

    run, prunes = FakeRun({0: 16, 1: 16}, faster_stage1), Prunes()
    results = run_search(space(stages=(0, 1)), policy(), {0: 16, 1: 16}, run, prunes)
    assert prunes == []
    assert len(run.of_stage(1)) > 1  # searched, not just probed
    assert len(set(run.calls)) == len(run.calls)  # the probe is not launched twice
    assert THROUGHPUT.best(results).experiment.zero_stage == 1


def test_cannot_help_compares_with_the_confirmed_not_the_predicted_largest():
    # Stage 0 was predicted 16 but only 6 fits; stage 1's prediction of 12 beats what stage 0 confirmed.
    run, prunes = FakeRun({0: 6, 1: 12, 2: 12, 3: 12}, slower_with_stage), Prunes()
    run_search(space(), policy(), {0: 16, 1: 12, 2: 12, 3: 10}, run, prunes)
    assert len(run.of_stage(1)) > 1
    assert [stage for stage, _ in prunes] == [2, 3]  # no larger than stage 1's confirmed 12


def test_first_experiment_of_a_stage_is_its_predicted_largest():
    predicted = {0: 5, 1: 9, 2: 20, 3: 2000}
    run = FakeRun({0: 100, 1: 100, 2: 100, 3: 2000})
    run_search(space(max_micro_batch_size=1024), policy(), predicted, run, Prunes())
    firsts = {stage: run.of_stage(stage)[0] for stage in range(4)}
    assert firsts == {0: Experiment(0, 5), 1: Experiment(1, 9), 2: Experiment(2, 20),
                      3: Experiment(3, 1024)}  # capped at max_micro_batch_size


def test_oom_bisects_down_to_the_true_threshold():
    run = FakeRun({0: 5, 1: 11})
    results = run_search(space(stages=(0, 1)), policy(), {0: 16, 1: 32}, run, Prunes())
    for stage, threshold in ((0, 5), (1, 11)):
        ok = [r.experiment.micro_batch_size for r in results
              if r.experiment.zero_stage == stage and r.state is TrialState.OK]
        assert max(ok) == threshold
        ooms = [r.experiment.micro_batch_size for r in results
                if r.experiment.zero_stage == stage and r.state is TrialState.OOM]
        assert ooms and min(ooms) == threshold + 1


def test_nothing_fits_in_a_stage():
    run, prunes = FakeRun({0: 0, 1: 4}), Prunes()
    results = run_search(space(stages=(0, 1)), policy(), {0: 8, 1: 8}, run, prunes)
    assert prunes == []
    assert all(r.state is TrialState.OOM for r in results if r.experiment.zero_stage == 0)
    assert THROUGHPUT.best(results).experiment.zero_stage == 1


def test_nothing_the_memory_model_refuses_is_launched():
    # Gas grows as the micro-batch shrinks, so here the model refuses the middle sizes, not the largest.
    refused = {Experiment(0, 8, 4), Experiment(0, 4, 8), Experiment(1, 16, 2)}
    run, prunes = FakeRun({0: 32, 1: 32}, slower_with_stage), Prunes()
    run_search(space(stages=(0, 1), data_parallel_size=2, global_batch_size=64), policy(), {0: 32, 1: 32}, run,
               prunes, fits=lambda e: e not in refused)
    assert not refused & set(run.calls)
    # The third candidate is the nearest allowed size to a quarter of the largest, not 8.
    assert run.of_stage(0) == [Experiment(0, 32, 1), Experiment(0, 16, 2), Experiment(0, 9, 3)]
    # Stage 1's probe would be at stage 0's best micro-batch (32, launched) - the model allows it.
    assert Experiment(1, 32, 1) in run.calls


def test_a_probe_the_memory_model_refuses_prunes_the_stage_unlaunched():
    run, prunes = FakeRun({0: 16, 1: 16}, slower_with_stage), Prunes()
    run_search(space(stages=(0, 1)), policy(), {0: 16, 1: 16}, run, prunes,
               fits=lambda e: e.zero_stage == 0)
    assert run.of_stage(1) == []
    assert prunes[0][0] == 1 and "memory model says z1_gas1_mbs16" in prunes[0][1]


def test_a_stage_whose_every_size_is_refused_is_pruned_not_silently_skipped():
    run, prunes = FakeRun({0: 16, 1: 32}), Prunes()
    run_search(space(stages=(0, 1)), policy(), {0: 16, 1: 32}, run, prunes, fits=lambda e: e.zero_stage == 0)
    assert run.of_stage(1) == []
    assert prunes == [(1, "memory model, with the overhead measured so far: no micro-batch fits")]


def test_micro_batch_candidates_after_confirmation():
    run = FakeRun({0: 16})
    run_search(space(stages=(0,), num_micro_batch_sizes=3), policy(), {0: 16}, run, Prunes())
    assert [e.micro_batch_size for e in run.calls] == [16, 8, 4]


def test_gas_under_max_train_batch_size_in_the_search():
    cap, dp = 64, 2
    s = space(data_parallel_size=dp, global_batch_size=cap, global_batch_exact=False)
    run = FakeRun({0: 8, 1: 16, 2: 32, 3: 32})
    run_search(s, policy(), {0: 8, 1: 16, 2: 32, 3: 32}, run, Prunes())
    assert run.calls
    for e in run.calls:
        assert e.gradient_accumulation_steps == cap // (e.micro_batch_size * dp)
        assert e.train_batch_size(dp) <= cap
    assert len({e.gradient_accumulation_steps for e in run.calls}) > 1
    assert max(e.micro_batch_size for e in run.calls) <= cap // dp


def test_fixed_train_batch_size_uses_only_exact_divisors():
    total, dp = 48, 2
    s = space(data_parallel_size=dp, global_batch_size=total, global_batch_exact=True)
    run = FakeRun({0: 7, 1: 20, 2: 30, 3: 30})
    run_search(s, policy(), {0: 10, 1: 20, 2: 30, 3: 40}, run, Prunes())
    assert run.calls
    for e in run.calls:
        assert total % (e.micro_batch_size * dp) == 0
        assert e.train_batch_size(dp) == total


def test_fixed_micro_batch_sizes_are_exactly_what_is_evaluated():
    s = space(stages=(0, 1, 2, 3), fixed_micro_batch_sizes=(2, 8))
    run = FakeRun({0: 100, 1: 100, 2: 100, 3: 100})
    prunes = Prunes()
    run_search(s, policy(), {0: 100, 1: 100, 2: 100, 3: 100}, run, prunes)
    assert prunes == []  # no "cannot help": the user asked for these sizes
    assert sorted(run.calls) == sorted(Experiment(stage, m) for stage in range(4) for m in (2, 8))


def test_fixed_micro_batch_size_is_not_bisected_on_oom():
    s = space(stages=(0,), fixed_micro_batch_sizes=(8,))
    run = FakeRun({0: 4})
    results = run_search(s, policy(), {0: 16}, run, Prunes())
    assert run.calls == [Experiment(0, 8)]
    assert results[0].state is TrialState.OOM


def test_fixed_stage_tuple_is_not_swept():
    run = FakeRun({0: 100, 1: 100, 2: 100, 3: 100})
    run_search(space(stages=(1,)), policy(), {0: 64, 1: 16, 2: 64, 3: 64}, run, Prunes())
    assert set(run.stages()) == {1}
    run = FakeRun({0: 100, 1: 100, 2: 100, 3: 100})
    run_search(space(stages=(0, 3)), policy(), {0: 8, 1: 16, 2: 32, 3: 64}, run, Prunes())
    assert set(run.stages()) == {0, 3}


def test_fixed_stage_and_fixed_micro_batch_sizes():
    s = space(stages=(2,), fixed_micro_batch_sizes=(4,))
    run = FakeRun({2: 100})
    run_search(s, policy(), {0: 100, 1: 100, 2: 100, 3: 100}, run, Prunes())
    assert run.calls == [Experiment(2, 4)]


def test_early_stopping_limits_evaluations():
    def shrinking(experiment):  # the largest micro-batch is the best; every later try is worse
        return float(experiment.micro_batch_size)

    s = space(stages=(0,), num_micro_batch_sizes=8)
    patient = FakeRun({0: 128}, shrinking)
    run_search(s, policy(early_stopping=50), {0: 128}, patient, Prunes())
    assert [e.micro_batch_size for e in patient.calls] == [128, 64, 32, 16, 8, 4, 2, 1]

    impatient = FakeRun({0: 128}, shrinking)
    run_search(s, policy(early_stopping=2), {0: 128}, impatient, Prunes())
    assert len(impatient.calls) < len(patient.calls)
    assert len(impatient.calls) <= 1 + 1 + 2  # the confirmation, then at most one improvement + 2 without


def test_early_stopping_counts_from_the_confirmed_result():
    s = space(stages=(0,), num_micro_batch_sizes=8)
    run = FakeRun({0: 128}, lambda e: float(e.micro_batch_size))
    run_search(s, policy(early_stopping=2), {0: 128}, run, Prunes())
    assert [e.micro_batch_size for e in run.calls] == [128, 64, 32]


def test_num_trials_limits_evaluations_per_stage():
    s = space(stages=(0,), num_micro_batch_sizes=8)
    run = FakeRun({0: 128}, lambda e: float(e.micro_batch_size))
    run_search(s, policy(num_trials=3), {0: 128}, run, Prunes())
    assert len(run.calls) == 3


def test_latency_objective_selects_the_minimum():
    def latency(experiment):  # a smooth bowl: stage 1, micro 4 is fastest
        return 1.0 + (math.log2(experiment.micro_batch_size) - 2) ** 2 + 0.5 * (experiment.zero_stage - 1) ** 2

    run = FakeRun({0: 16, 1: 16, 2: 16, 3: 16}, latency)
    s = space(stages=(0, 1), num_micro_batch_sizes=5)
    results = run_search(s, policy(objective=LATENCY), {0: 8, 1: 16}, run, Prunes())
    ok = [r for r in results if r.state is TrialState.OK]
    best = LATENCY.best(results)
    assert best.value == min(r.value for r in ok)
    assert best.experiment == Experiment(1, 4)


def test_full_mode_tunes_knobs_on_the_best_stages():
    knob_values = {stage: dict(values) for stage, values in DEFAULT_KNOBS.items()}
    s = space(knob_values=knob_values, num_micro_batch_sizes=2)
    run = FakeRun({0: 4, 1: 8, 2: 16, 3: 32})
    fast = run_search(s, policy(), {0: 4, 1: 8, 2: 16, 3: 32}, FakeRun({0: 4, 1: 8, 2: 16, 3: 32}), Prunes())
    results = run_search(s, policy(fast=False), {0: 4, 1: 8, 2: 16, 3: 32}, run, Prunes())

    assert [r.experiment for r in results[:len(fast)]] == [r.experiment for r in fast]  # fast part unchanged
    tuned = [r.experiment for r in results[len(fast):]]
    assert tuned and all(e.knobs for e in tuned)
    # The default value grows with micro-batch and stage: stages 3 and 2 are the best two.
    assert {e.zero_stage for e in tuned} == {2, 3}
    for stage in (2, 3):
        best_micro = sorted((r for r in fast if r.experiment.zero_stage == stage and r.state is TrialState.OK),
                            key=lambda r: r.value, reverse=True)[:2]
        micros = {r.experiment.micro_batch_size for r in best_micro}
        expected = {Experiment(stage, m).with_knobs(dict(zip(sorted(knob_values[stage]), combo)))
                    for m in micros for combo in _product(knob_values[stage])}
        assert {e for e in tuned if e.zero_stage == stage} == expected
    for e in tuned:
        assert dict(e.knobs).keys() == knob_values[e.zero_stage].keys()
        for knob in dict(e.knobs):
            assert f"_{tag(knob)}" in e.name
    assert any("_oc" in e.name and "_ppt" in e.name for e in tuned if e.zero_stage == 3)


def _product(values: dict[str, list]) -> list[tuple]:
    import itertools

    return list(itertools.product(*(values[name] for name in sorted(values))))


def test_full_mode_on_ddp_stages_uses_bucket_knobs():
    knob_values = {stage: dict(values) for stage, values in DEFAULT_KNOBS.items()}
    s = space(stages=(0, 1), knob_values=knob_values)
    run = FakeRun({0: 8, 1: 16})
    run_search(s, policy(fast=False), {0: 8, 1: 16}, run, Prunes())
    tuned = [e for e in run.calls if e.knobs]
    assert {e.zero_stage for e in tuned} == {0, 1}
    assert all("_rbs" in e.name and "_cg" in e.name for e in tuned)
    assert any(e.name.startswith("z1_cgT_rbs5.0e07_gas1_mbs") for e in tuned)


def test_full_mode_without_knob_values_adds_nothing():
    run = FakeRun({0: 8, 1: 16})
    fast_calls = FakeRun({0: 8, 1: 16})
    run_search(space(stages=(0, 1)), policy(), {0: 8, 1: 16}, fast_calls, Prunes())
    run_search(space(stages=(0, 1)), policy(fast=False), {0: 8, 1: 16}, run, Prunes())
    assert run.calls == fast_calls.calls


def test_full_mode_with_latency_tunes_the_fastest_stage():
    knob_values = {stage: dict(values) for stage, values in DEFAULT_KNOBS.items()}
    s = space(stages=(0, 1, 2), knob_values=knob_values)
    latency = {0: 3.0, 1: 1.0, 2: 2.0}
    run = FakeRun({0: 4, 1: 8, 2: 16}, lambda e: latency[e.zero_stage] + 0.01 * e.micro_batch_size)
    results = run_search(s, policy(objective=LATENCY, fast=False), {0: 4, 1: 8, 2: 16}, run, Prunes())
    tuned_stages = {r.experiment.zero_stage for r in results if r.experiment.knobs}
    assert tuned_stages == {1, 2}
    assert LATENCY.best(results).experiment.zero_stage == 1


def test_fast_mode_launches_the_same_experiments_whichever_tuner():
    # Fast mode has at most num_tuning_micro_batch_sizes candidates per stage, fewer than the early
    # stopping patience, so every tuner that does not stop itself measures all of them: only the
    # order differs; one with a stop rule of its own (first_fit) measures some of them. (The tuners
    # differ in full mode, and the tuning-quality benchmark runs them there.)
    from autotuner.tuning.tuners import TUNERS, Tuner, make_tuner

    def launched(tuner_type: str) -> set[Experiment]:
        run = FakeRun({0: 24, 1: 24, 2: 48, 3: 64}, slower_with_stage)
        run_search(space(data_parallel_size=2, global_batch_size=128, max_micro_batch_size=64),
                   policy(tuner_type=tuner_type, early_stopping=5), {0: 32, 1: 32, 2: 48, 3: 64}, run, Prunes())
        return set(run.calls)

    try:
        import optuna  # noqa: F401
        names = list(TUNERS)
    except ImportError:  # the bayes tuner's extra is not installed
        names = [name for name in TUNERS if name != "bayes"]
    sets = {tuner_type: launched(tuner_type) for tuner_type in names}
    assert len(sets["gridsearch"]) > 6
    stops_itself = {name for name in names
                    if type(make_tuner(name, [], THROUGHPUT)).should_stop is not Tuner.should_stop}
    assert all(sets[name] == sets["gridsearch"] for name in names if name not in stops_itself)
    assert all(sets[name] <= sets["gridsearch"] for name in stops_itself)


# ----- edge extension -----

def peaked_at(optimum: int) -> Callable[[Experiment], float]:
    return lambda e: 100.0 - (math.log2(e.micro_batch_size) - math.log2(optimum)) ** 2


@pytest.mark.parametrize("optimum, expected", [
    (4, [64, 32, 16, 8, 4, 2]),  # beyond the quarter until a size stops improving
    (1, [64, 32, 16, 8, 4, 2, 1]),  # down to the smallest valid size
    (32, [64, 32, 16]),  # inside the candidates: nothing beyond is tried
], ids=["below-the-candidates", "at-the-minimum", "inside"])
def test_the_search_looks_past_its_smallest_candidate(optimum, expected):
    run = FakeRun({0: 64}, peaked_at(optimum))
    results = run_search(space(stages=(0,)), policy(), {0: 64}, run, Prunes())
    assert [e.micro_batch_size for e in run.calls] == expected
    assert THROUGHPUT.best(results).experiment.micro_batch_size == optimum


def test_edge_extension_stops_where_the_memory_model_says_no():
    run = FakeRun({0: 64}, peaked_at(1))
    fits = lambda e: e.micro_batch_size >= 8  # noqa: E731 (e.g. a larger gas costs more below 8)
    run_search(space(stages=(0,)), policy(), {0: 64}, run, Prunes(), fits=fits)
    assert [e.micro_batch_size for e in run.calls] == [64, 32, 16, 8]


def test_edge_extension_keeps_to_valid_sizes_and_the_trial_budget():
    # Global batch 96 on 1 rank: only divisors of 96 are valid micro-batches (gas = 96 / micro).
    s = space(stages=(0,), global_batch_size=96, global_batch_exact=True)
    run = FakeRun({0: 96}, peaked_at(1))
    run_search(s, policy(), {0: 96}, run, Prunes())
    assert all(96 % e.micro_batch_size == 0 for e in run.calls)
    assert [e.micro_batch_size for e in run.calls][3:] == [12, 6, 3, 2, 1]
    limited = FakeRun({0: 96}, peaked_at(1))
    run_search(s, policy(num_trials=5), {0: 96}, limited, Prunes())
    assert len(limited.calls) == 5


def test_one_measured_size_is_not_extended():
    run = FakeRun({0: 64}, peaked_at(1))
    run_search(space(stages=(0,), num_micro_batch_sizes=1), policy(), {0: 64}, run, Prunes())
    assert [e.micro_batch_size for e in run.calls] == [64]
