"""The noise-aware final pick (autotuner/tuning/searches/final_pick.py), and the orchestrator re-measuring
contenders interleaved with a fake runner. No processes."""

from __future__ import annotations

import dataclasses

import pandas as pd

from autotuner.config import load_config
from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.models.noise import NoiseLevel
from autotuner.tuning.searches.final_pick import Contender, contenders, pick, stands_apart
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from fakes import FakeRunner, experiment_settings, model_info, never_called, ok, orchestrator

THROUGHPUT = Objective("throughput")
MiB = 2**20


def result(micro, value, std=None, stage=0):
    return TrialResult(Experiment(stage, micro), TrialState.OK, value=value, value_std=std)


def test_contenders_are_the_best_and_those_within_its_spread():
    results = [result(1, 100.0), result(2, 98.0), result(4, 90.0), result(8, 97.5, std=0.5),
               TrialResult(Experiment(0, 16), TrialState.OOM, error="oom")]
    chosen = contenders(results, THROUGHPUT, top=3)
    assert [r.experiment.micro_batch_size for r in chosen] == [1, 2, 8]  # 90 is 10% off: not a contender
    assert [r.experiment.micro_batch_size for r in contenders(results, THROUGHPUT, top=2)] == [1, 2]
    assert contenders([result(1, 100.0), result(2, 80.0)], THROUGHPUT, top=3) == [result(1, 100.0)]


def test_a_wide_step_spread_widens_the_band():
    assert len(contenders([result(1, 100.0, std=10.0), result(2, 88.0)], THROUGHPUT, top=3)) == 2


def test_the_noise_level_comes_from_configurations_measured_more_than_once():
    assert NoiseLevel.of({}) == NoiseLevel(0.03)  # nothing repeated: the floor, and it says it is assumed
    assert "assumed" in NoiseLevel.of({}).describe()
    a, b = Experiment(0, 1), Experiment(0, 2)
    level = NoiseLevel.of({a: [100.0, 110.0], b: [50.0, 50.0], Experiment(0, 4): [70.0]})
    assert level.repeated == 2 and abs(level.relative - (7.0711 / 105 + 0) / 2) < 1e-3  # the median of 2 spreads
    assert "2 configuration(s) measured more than once" in level.describe()


def test_the_best_stands_apart_only_beyond_twice_the_noise():
    a, b = Experiment(0, 1), Experiment(0, 2)
    assert stands_apart({a: [100.0, 101.0], b: [90.0, 91.0]}, THROUGHPUT, noise=0.04)  # 10% > 8%
    assert not stands_apart({a: [100.0, 101.0], b: [94.0, 95.0]}, THROUGHPUT, noise=0.04)  # 6% < 8%
    assert stands_apart({a: [100.0]}, THROUGHPUT, noise=0.5)


def test_the_best_median_wins_over_a_lucky_single_run_and_close_medians_are_ties():
    lucky = Contender(Experiment(0, 1), (110.0, 95.0, 96.0))
    steady = Contender(Experiment(0, 2), (104.0, 103.0, 103.5))
    close = Contender(Experiment(0, 4), (101.0, 103.0, 102.0))
    final = pick([lucky, steady, close], THROUGHPUT)
    assert final.chosen is steady
    assert final.ties == (close.experiment, lucky.experiment)  # ranges overlap the chosen one's


def test_a_contender_that_failed_a_remeasurement_cannot_win():
    flaky = Contender(Experiment(0, 1), (120.0, 121.0), failed_runs=1)
    steady = Contender(Experiment(0, 2), (100.0, 101.0))
    assert pick([flaky, steady], THROUGHPUT).chosen is steady


# ----- the orchestrator -----

def tuner(tmp_path, runner, **autotuning):
    """The grid search: the final pick's own rules, which every tuner shares (the predictive
    tuner's model may also rule contenders out: its own test below)."""
    autotuning = {"tuner_type": "gridsearch", **autotuning}
    config = load_config({"train_micro_batch_size_per_gpu": [2, 4, 8], "zero_optimization": {"stage": 0},
                          "autotuning": {"enabled": True, "memory_per_rank_bytes": 4 * 2**30, **autotuning}})
    settings = experiment_settings(config, objective=THROUGHPUT)
    lines: list[str] = []
    return orchestrator(tmp_path, config, runner, settings, report=lines.append), lines


def noisy_runner(values):
    """Each experiment answers its values in turn: the first is the search's, then re-measurements."""
    calls: dict[str, int] = {}

    def answer(trial: Trial) -> TrialResult:
        name = trial.experiment.name
        calls[name] = calls.get(name, 0) + 1
        measured = ok(trial, values[trial.experiment.micro_batch_size][calls[name] - 1], 200 * MiB)
        if trial.profile:
            info = model_info(trial.experiment.micro_batch_size, 0, activation_bytes=MiB)
            measured = dataclasses.replace(measured, model_info=info)
        return measured
    return FakeRunner(answer)


def test_contenders_are_remeasured_interleaved_and_the_best_median_is_the_pick(tmp_path):
    # mbs 8's first run is lucky (105); re-measured it is 95 and 96, while mbs 4 holds 104.
    runner = noisy_runner({2: [50.0], 4: [104.0, 104.0, 103.0], 8: [105.0, 95.0, 96.0]})
    autotuner, lines = tuner(tmp_path, runner, remeasure_rounds=2)
    outcome = autotuner.tune()
    # Round 1 in the search's order, round 2 rotated by one. After round 1 the medians (104, 100)
    # are 4% apart with a noise of 3.5%: beyond the noise (a gain worth having) and within twice
    # it (not apart), so round 2 runs.
    assert runner.names[3:] == ["z0_gas1_mbs8_remeasure1", "z0_gas1_mbs4_remeasure1",
                                "z0_gas1_mbs4_remeasure2", "z0_gas1_mbs8_remeasure2"]
    assert outcome.best.name == "z0_gas1_mbs4" and outcome.best.value == 104.0
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "| global" in summary and "z0_gas1_mbs4" in summary.split("| global")[1].split("\n")[0]
    assert "z0_gas1_mbs4: 104 (103-104; runs 104, 104, 103) chosen" in summary
    assert "z0_gas1_mbs8: 96 (95-105; runs 105, 95, 96) tie within noise with z0_gas1_mbs4" in summary
    assert "Noise level: ±" in summary and "2 configuration(s) measured more than once" in summary
    table = pd.read_csv(tmp_path / "results" / "experiments.csv")
    assert list(table[table.chosen].name) == ["z0_gas1_mbs4"]
    assert sorted(table[table.phase == "remeasure"].run) == [1, 1, 2, 2]
    # The ledger holds every trial: the re-measurements too, beside each experiment's first result.
    remeasured = autotuner.ledger.remeasurements()
    assert [(run, r.name, r.value) for run, r in remeasured] == [
        (1, "z0_gas1_mbs8", 95.0), (1, "z0_gas1_mbs4", 104.0), (2, "z0_gas1_mbs4", 103.0), (2, "z0_gas1_mbs8", 96.0)]
    assert {r.name: r.value for r in autotuner.ledger.results()}["z0_gas1_mbs8"] == 105.0
    assert list(table[table.phase == "profile"].name) == ["z0_gas1_mbs2", "z0_gas1_mbs4"]
    # A resumed run reads the re-measurements back rather than launching them again.
    again, _ = tuner(tmp_path, FakeRunner(never_called), remeasure_rounds=2)
    assert again.tune().best.name == "z0_gas1_mbs4"


def test_a_tie_the_first_round_confirms_is_not_measured_again(tmp_path):
    # 105 and 104, then 104 and 104.5: within the noise of each other, so a further round could
    # only find a gain smaller than the noise; the rounds stop after one.
    runner = noisy_runner({2: [50.0], 4: [104.0, 104.5, 104.0], 8: [105.0, 104.0, 110.0]})
    autotuner, lines = tuner(tmp_path, runner, remeasure_rounds=3)
    autotuner.tune()
    assert [n for n in runner.names if "remeasure" in n] == ["z0_gas1_mbs8_remeasure1", "z0_gas1_mbs4_remeasure1"]
    assert "tie within noise with" in (tmp_path / "results" / "summary.txt").read_text()


def test_the_band_uses_the_windows_standard_error_not_the_spread_of_single_steps():
    from autotuner.core.boundary import Measurement
    # 10% spread of single steps over 16 steps: the mean is known to 2.5%, under the 3% floor,
    # so 88 (12% off) is no contender; with the step count unknown the spread itself counts.
    window = Measurement(throughput=100.0, latency=0.01, throughput_std=10.0, start_profile_step=3,
                         end_profile_step=18)
    best = dataclasses.replace(result(1, 100.0, std=10.0), measurement=window)
    assert abs(best.relative_error - 0.025) < 1e-9
    assert len(contenders([best, result(2, 88.0)], THROUGHPUT, top=3)) == 1
    assert len(contenders([result(1, 100.0, std=10.0), result(2, 88.0)], THROUGHPUT, top=3)) == 2


def test_a_clear_winner_is_not_remeasured(tmp_path):
    runner = noisy_runner({2: [50.0], 4: [70.0], 8: [110.0]})
    autotuner, _ = tuner(tmp_path, runner)
    assert autotuner.tune().best.name == "z0_gas1_mbs8"
    assert not any("remeasure" in name for name in runner.names)


def test_remeasure_rounds_0_keeps_the_best_single_measurement(tmp_path):
    runner = noisy_runner({2: [50.0], 4: [104.0], 8: [105.0]})
    autotuner, _ = tuner(tmp_path, runner, remeasure_rounds=0)
    assert autotuner.tune().best.name == "z0_gas1_mbs8"
    assert len(runner.names) == 3


def test_rounds_stop_once_the_best_stands_apart(tmp_path):
    # mbs 8 and 4 look alike at first (105, 104); re-measured, mbs 8 holds 105 and mbs 4 drops to 80.
    # After round 1 mbs 4's own runs (104, 80) say the noise is about 9%, so 105 against 92 is not
    # yet apart; after round 2 (80 again) the medians are 105 and 80 with noise about 8%: done.
    runner = noisy_runner({2: [50.0], 4: [104.0, 80.0, 80.0, 80.0], 8: [105.0, 105.0, 105.0, 105.0]})
    autotuner, lines = tuner(tmp_path, runner, remeasure_rounds=3)
    assert autotuner.tune().best.name == "z0_gas1_mbs8"
    assert [n for n in runner.names if "remeasure" in n] == [
        "z0_gas1_mbs8_remeasure1", "z0_gas1_mbs4_remeasure1", "z0_gas1_mbs4_remeasure2", "z0_gas1_mbs8_remeasure2"]


def busy_window(trial: Trial, value: float | None, taken_by_others: float) -> TrialResult:
    """mbs 2, 4, 8 measure 50, 70, 110 (or `value`), with that share of the CPUs taken by others."""
    measured = ok(trial, value or {2: 50.0, 4: 70.0, 8: 110.0}[trial.experiment.micro_batch_size], 200 * MiB)
    measured = dataclasses.replace(measured, measurement=dataclasses.replace(
        measured.measurement, cpu_taken_by_others=taken_by_others))
    if trial.profile:
        measured = dataclasses.replace(measured, model_info=model_info(trial.experiment.micro_batch_size, 0,
                                                                      activation_bytes=MiB))
    return measured


def test_a_window_another_process_disturbed_is_measured_again(tmp_path):
    answers: dict[str, int] = {}

    def answer(trial: Trial) -> TrialResult:
        name = trial.directory.name
        answers[name] = answers.get(name, 0) + 1
        disturbed = trial.experiment.micro_batch_size == 8 and answers[name] == 1
        return busy_window(trial, 60.0 if disturbed else None, 0.6 if disturbed else 0.02)

    runner = FakeRunner(answer)
    autotuner, lines = tuner(tmp_path, runner)
    outcome = autotuner.tune()
    assert outcome.best.name == "z0_gas1_mbs8" and outcome.best.value == 110.0  # not the disturbed 60
    assert runner.names.count("z0_gas1_mbs8") == 2
    assert any("z0_gas1_mbs8: other processes took 60% of the CPUs during its profile window; measuring it again"
               in line for line in lines)


def test_on_a_machine_that_stays_busy_windows_are_measured_again_only_until_that_is_clear(tmp_path):
    runner = FakeRunner(lambda trial: busy_window(trial, None, 0.5))
    autotuner, lines = tuner(tmp_path, runner)
    assert autotuner.tune().best.name == "z0_gas1_mbs8"
    first = runner.names[0]
    assert runner.names.count(first) == 2 and len(runner.names) == len(set(runner.names)) + 1  # one retry in all
    assert sum("this machine stays busy" in line for line in lines) == 1


def test_one_interleaved_rule_serves_the_final_pick_and_the_online_tuner():
    # Both import the rule (the online tuner's order and ranking are tested in test_online_schedule.py).
    import autotuner.runtime.online.schedule as online
    import autotuner.tuning.searches.final_pick as final
    from autotuner.core.interleaved_pick import by_median, round_order

    assert online.round_order is final.round_order is round_order and online.by_median is final.by_median
    assert [round_order("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    values = {"a": [10, 30, 11], "b": [12, 12, 13], "c": [20, 20, 20]}
    assert by_median(values) == ["c", "b", "a"] and by_median(values, maximize=False) == ["a", "b", "c"]
    assert by_median(values, failed={"c": 1}) == ["b", "a", "c"]  # a failed run ranks behind every clean one



# ----- what a re-measurement's failure must not do (a review of 2026-11-27) -----

def _rounds(results, answers, rounds=1):
    """final_pick_rounds over `results`, each re-measurement answered from `answers[(micro, run)]`."""
    from autotuner.tuning.searches.final_pick import final_pick_rounds

    def remeasure(experiment, run, reuse):
        state, value = answers[(experiment.micro_batch_size, run)]
        return TrialResult(experiment, state, value=value, error=None if state is TrialState.OK else "x")
    return final_pick_rounds(results, THROUGHPUT, top=3, rounds=rounds, remeasure=remeasure, report=lambda line: None)


def test_a_round_reuses_earlier_records_only_when_every_contender_has_one():
    """A fresh launch compared with an earlier run's record is not interleaved with it."""
    from autotuner.tuning.searches.final_pick import final_pick_rounds

    for recorded, expected in (({(1, 1), (2, 1)}, [True, True]), ({(1, 1)}, [False, False]), (set(), [False, False])):
        asked = []

        def remeasure(experiment, run, reuse):
            asked.append(reuse)
            return TrialResult(experiment, TrialState.OK, value=100.0 - experiment.micro_batch_size)
        final_pick_rounds([result(1, 100.0), result(2, 99.5)], THROUGHPUT, top=3, rounds=1, remeasure=remeasure,
                          report=lambda line: None,
                          reusable=lambda experiment, run: (experiment.micro_batch_size, run) in recorded)
        assert asked == expected, recorded


def test_a_contender_whose_remeasurement_ran_out_of_memory_is_never_the_pick():
    # A measured 100 and B 99; A's re-measurement ran out of memory, B's timed out. Both failed
    # once, and A's single 100 used to win: a configuration that does not always fit.
    chosen, _, lines = _rounds([result(1, 100.0), result(2, 99.0)],
                               {(1, 1): (TrialState.OOM, None), (2, 1): (TrialState.TIMEOUT, None)})
    assert chosen.experiment == Experiment(0, 2)
    assert "z0_gas1_mbs1 ran out of memory when re-measured: not picked" in lines


def test_every_contender_out_of_memory_falls_back_to_the_best_that_fits():
    chosen, _, _ = _rounds([result(1, 100.0), result(2, 99.0), result(4, 80.0)],
                           {(1, 1): (TrialState.OOM, None), (2, 1): (TrialState.OOM, None)})
    assert chosen.experiment == Experiment(0, 4)


def test_a_contender_dropped_after_a_round_cannot_win_on_fewer_failed_runs():
    # C starts as a contender (96.5 against 100), then round 1 drops it (median 83.25 against 104 and
    # 97.5); in round 2 both A and B fail once. C ran once and never failed, and used to win on that:
    # the pick is among the last round's contenders.
    answers = {(1, 1): (TrialState.OK, 108.0), (2, 1): (TrialState.OK, 98.0), (4, 1): (TrialState.OK, 70.0),
               (1, 2): (TrialState.TIMEOUT, None), (2, 2): (TrialState.TIMEOUT, None),
               (1, 3): (TrialState.OK, 104.0), (2, 3): (TrialState.OK, 98.0)}
    chosen, remeasured, _ = _rounds([result(1, 100.0), result(2, 97.0), result(4, 96.5)], answers, rounds=3)
    assert {r.experiment.micro_batch_size for run, r in remeasured if run == 1} == {1, 2, 4}
    assert {r.experiment.micro_batch_size for run, r in remeasured if run > 1} == {1, 2}
    assert chosen.experiment == Experiment(0, 1)


def test_a_contender_is_remeasured_only_if_it_could_beat_the_best_by_the_worthwhile_gain():
    # The search's launch rule: at the 3% noise floor each, the difference of two measurements has a
    # spread of 4.24%; 1.64 of those on top of the contender's value must pass the best plus 3%.
    # So 96.5 (3.5% behind) is re-measured and 95.5 (4.5% behind) is not, though both are within
    # twice the noise of the best (the band used before).
    chosen = contenders([result(1, 100.0), result(2, 96.5), result(4, 95.5)], THROUGHPUT, top=3)
    assert [r.experiment.micro_batch_size for r in chosen] == [1, 2]
    # A lower worthwhile gain re-measures more; the latency objective mirrors it.
    assert len(contenders([result(1, 100.0), result(4, 95.5)], THROUGHPUT, top=3, worthwhile_gain=0.01)) == 2
    latency = Objective("latency")
    assert len(contenders([result(1, 1.0), result(2, 1.035), result(4, 1.045)], latency, top=3)) == 2


def test_a_model_may_rule_a_contender_out_never_in():
    """`ruled_out` (the predictive search's model on every launch) drops a contender the
    measurement band keeps; one outside the band stays out whatever it says. The model sees the
    best at its value so far."""
    results = [result(1, 100.0), result(2, 98.0), result(4, 90.0)]
    seen = []

    def rules_out_two(candidate: TrialResult, best: TrialResult) -> bool:
        seen.append((candidate.experiment.micro_batch_size, best.value))
        return candidate.experiment.micro_batch_size == 2

    assert [r.experiment.micro_batch_size for r in contenders(results, THROUGHPUT, top=3, ruled_out=rules_out_two)] == [1]
    assert seen == [(2, 100.0)]  # 4 is outside the band: never asked
    never = contenders(results, THROUGHPUT, top=3, ruled_out=lambda candidate, best: False)
    assert [r.experiment.micro_batch_size for r in never] == [1, 2]
    at_median = contenders(results, THROUGHPUT, top=3, medians={Experiment(0, 1): 99.0},
                           ruled_out=lambda candidate, best: seen.append(best.value) or False)
    assert seen[-1] == 99.0 and len(at_median) == 2


def test_the_predictive_tuners_model_rules_out_a_contender_its_curve_pins_behind(tmp_path):
    """Under the default tuner the step-time model, fitted on every launch, judges the final pick's
    contenders too: 104 samples/s at micro-batch 4 is within the measurement band of 105 at 8, but
    with 50 at 2 the saturating curve puts 4 more than 3% behind 8, so nothing is re-measured and
    the summary says why."""
    runner = noisy_runner({2: [50.0], 4: [104.0, 104.0], 8: [105.0, 105.0]})
    autotuner, lines = tuner(tmp_path, runner, tuner_type="predictive")
    assert autotuner.tune().best.name == "z0_gas1_mbs8"
    assert not any("remeasure" in name for name in runner.names)
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "Final pick: z0_gas1_mbs4 not re-measured: within the measurements' band of z0_gas1_mbs8" in summary
    # The grid search has no model: the same launches re-measure both.
    grid_runner = noisy_runner({2: [50.0], 4: [104.0, 104.0], 8: [105.0, 105.0]})
    grid, _ = tuner(tmp_path / "grid", grid_runner)
    grid.tune()
    assert {n for n in grid_runner.names if "remeasure" in n} == {"z0_gas1_mbs8_remeasure1", "z0_gas1_mbs4_remeasure1"}
