"""One contract for every tuner in TUNERS (a new tuner is covered by registering it),
plus ModelBasedTuner's own promise: it picks the best predicted untried experiment, and
FirstFitTuner's: it stops at the first experiment that runs.
A tuner keeps no trials of its own: they are in its `TunerTrials` (in the run's ledger), and a
tuner made again over them asks the same.

A tuner is two things the contract checks apart: the order it asks in (checked with the driver's
rules, its own stop rule held aside by `ordering_only`), and its own stop rule (tuners/stopping.py,
`Tuner.should_stop`), which a drive must honour exactly, serial or parallel, and which reads only
the drive's progress. A toy tuner that stops after N checks the extension point itself.

Pure: tuners are driven with a fake `evaluate`; nothing is launched."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.trials.ledger import TrialLedger
from autotuner.tuning.tuners import (TUNERS, DriveProgress, FirstFitTuner, GridSearchTuner, ModelBasedTuner, Tuner,
                                     TunerSpec, drive, make_tuner)

try:
    import optuna  # noqa: F401  (the bayes tuner's optional extra)
    HAVE_OPTUNA = True
except ImportError:
    HAVE_OPTUNA = False
needs_optuna = pytest.mark.skipif(not HAVE_OPTUNA, reason="optuna not installed (pip install 'autotuner[bayes]')")


def pytest_generate_tests(metafunc):
    """The contract's tuners are read when its tests are collected, after the installed plugins have
    registered theirs (entry point group autotuner.plugins), not fixed when this module is imported."""
    if "name" in metafunc.fixturenames and metafunc.cls is TestTunerContract:
        from autotuner.core.plugins import load_plugins

        load_plugins()
        metafunc.parametrize("name", [pytest.param(name, marks=needs_optuna) if name == "bayes" else name
                                      for name in sorted(TUNERS)])


THROUGHPUT = Objective("throughput")
LATENCY = Objective("latency")


def grid(stages=(0, 1, 2), micros=(1, 2, 4, 8)) -> list[Experiment]:
    """12 experiments by default: stage x micro-batch."""
    return [Experiment(s, m) for s, m in itertools.product(stages, micros)]


def smooth_value(experiment: Experiment) -> float:
    """A smooth surface with one optimum, at micro-batch 4 on stage 1."""
    return 100.0 - 10.0 * (math.log2(experiment.micro_batch_size) - 2) ** 2 - 5.0 * (experiment.zero_stage - 1) ** 2


def ok(experiment: Experiment, value: float) -> TrialResult:
    return TrialResult(experiment, TrialState.OK, value=value)


def evaluate_smooth(experiment: Experiment) -> TrialResult:
    return ok(experiment, smooth_value(experiment))


class Counting:
    """An evaluate whose n-th call returns `first + step * n`: only the first call ever improves
    (for step < 0 under throughput, step > 0 under latency), whatever order the tuner picks."""

    def __init__(self, first: float, step: float):
        self.first, self.step, self.calls = first, step, []

    def __call__(self, experiment: Experiment) -> TrialResult:
        value = self.first + self.step * len(self.calls)
        self.calls.append(experiment)
        return ok(experiment, value)


class Slots:
    """A parallel evaluate with `capacity` slots whose launches finish last-in-first-out (so
    results arrive out of the order asked); it records how many ran at once."""

    def __init__(self, capacity: int, evaluate=evaluate_smooth):
        self.capacity, self.evaluate = capacity, evaluate
        self.running: list[Experiment] = []
        self.submitted: list[Experiment] = []
        self.most_at_once = 0

    def __call__(self, experiment: Experiment) -> TrialResult:
        raise AssertionError("a parallel drive submits; it never calls")

    def submit(self, experiment: Experiment) -> None:
        assert experiment not in self.submitted, f"{experiment.name} submitted twice"
        self.running.append(experiment)
        self.submitted.append(experiment)
        self.most_at_once = max(self.most_at_once, len(self.running))
        assert len(self.running) <= self.capacity

    def next_result(self) -> TrialResult:
        return self.evaluate(self.running.pop())


def exhaust(tuner: Tuner, evaluate=evaluate_smooth) -> list[Experiment]:
    """ask/tell until ask() returns None; the order asked."""
    order = []
    for _ in range(10 * len(tuner.space) + 10):  # a guard against a tuner that never stops
        experiment = tuner.ask()
        if experiment is None:
            return order
        order.append(experiment)
        tuner.tell(evaluate(experiment))
    pytest.fail(f"{type(tuner).__name__}.ask() never returned None")


def ordering_only(tuner: Tuner) -> Tuner:
    """`tuner` with its own stop rule held aside (the default's: never), for the tests of the order
    it asks in and of the driver's rules; its own rule has tests of its own (`TestTunerContract`'s
    stop-rule tests)."""
    tuner.should_stop = lambda progress: False  # type: ignore[method-assign]
    return tuner


def its_rule_says_stop(name: str, space: list[Experiment], objective: Objective, seed: int,
                       results: list[TrialResult]) -> bool:
    """What the stop rule of a tuner of `name` made again, and told `results` (in that order), says
    after a drive that gave them: the rule reads only the progress, so it says what the driven
    tuner's rule said at that point."""
    again = make_tuner(name, space, objective, seed=seed)
    for result in results:
        again.tell(result)
    return again.should_stop(DriveProgress.now(again.results, results))


class Watching(Slots):
    """`Slots` that, at each submit, asks the tuner's stop rule what it says over the progress the
    driver saw before that ask (what has arrived, what is running): it must not be "stop"."""

    def __init__(self, capacity: int, tuner: Tuner, evaluate=evaluate_smooth):
        super().__init__(capacity, evaluate)
        self.tuner, self.arrived, self.said_stop_at_a_submit = tuner, [], []

    def submit(self, experiment: Experiment) -> None:
        if self.tuner.should_stop(DriveProgress.now(self.tuner.results, self.arrived, len(self.running))):
            self.said_stop_at_a_submit.append(experiment)
        super().submit(experiment)

    def next_result(self) -> TrialResult:
        result = super().next_result()
        self.arrived.append(result)
        return result


def first_failing(count: int):
    """An evaluate whose first `count` calls fail and whose later ones run (the smooth surface)."""
    calls = []

    def evaluate(experiment: Experiment) -> TrialResult:
        calls.append(experiment)
        if len(calls) <= count:
            return TrialResult(experiment, TrialState.FAILED, error="boom")
        return evaluate_smooth(experiment)

    return evaluate


def results_held_outside_the_trials(tuner: Tuner) -> list[str]:
    """The tuner's attributes, other than its trials, that hold a result."""
    held = []
    for name, value in vars(tuner).items():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, set, tuple)) else [value]
        if name != "trials" and any(isinstance(item, TrialResult) for item in items):
            held.append(name)
    return held


def test_registry_is_what_make_tuner_builds():
    expected = {"gridsearch": "GridSearchTuner", "random": "RandomTuner", "model_based": "ModelBasedTuner",
                "bayes": "BayesTuner", "predictive": "PredictiveTuner", "first_fit": "FirstFitTuner"}
    assert expected.items() <= {name: type(make_tuner(name, grid(), THROUGHPUT)).__name__ for name in TUNERS}.items()
    for name, spec in TUNERS.items():
        tuner = make_tuner(name, grid(), THROUGHPUT, seed=3)
        assert spec.name == name and isinstance(tuner, Tuner)
        assert tuner.seed == 3


class TestTunerContract:
    def test_asks_each_experiment_exactly_once_then_none(self, name):
        space = grid()
        tuner = make_tuner(name, space, THROUGHPUT, seed=0)
        order = exhaust(tuner)
        assert len(order) == len(space)
        assert sorted(order) == sorted(space)
        assert tuner.ask() is None
        assert tuner.ask() is None  # stays exhausted

    def test_duplicates_in_space_are_removed(self, name):
        space = grid()
        doubled = space + list(reversed(space)) + [Experiment(0, 1), Experiment(0, 1, 1, ())]
        tuner = make_tuner(name, doubled, THROUGHPUT, seed=0)
        assert len(tuner.space) == len(space)
        assert set(tuner.space) == set(space)
        order = exhaust(tuner)
        assert len(order) == len(set(order)) == len(space)

    @pytest.mark.parametrize("seed", [0, 1, 1234])
    def test_same_seed_same_order(self, name, seed):
        first = exhaust(make_tuner(name, grid(), THROUGHPUT, seed=seed))
        second = exhaust(make_tuner(name, grid(), THROUGHPUT, seed=seed))
        assert first == second

    def test_what_it_is_told_and_has_running_is_kept_in_its_trials_in_the_ledger(self, name):
        ledger = TrialLedger()
        trials = ledger.open_tuner_trials("ZeRO 0")
        tuner = make_tuner(name, grid(), THROUGHPUT, seed=0, trials=trials)
        results = drive(tuner, evaluate_smooth, early_stopping=100, max_trials=5)
        running = tuner.ask_batch(2)
        assert ledger.tuner_trials() == (trials,)
        assert list(trials.told.values()) == results and trials.running == set(running)
        assert tuner.results == trials.told and tuner.pending == trials.running
        assert results_held_outside_the_trials(tuner) == []
        with pytest.raises(TypeError):
            tuner.results[running[0]] = ok(running[0], 1.0)  # read-only: `tell` writes

    @pytest.mark.parametrize("seed", [0, 5])
    def test_a_tuner_made_again_over_the_same_trials_asks_the_same(self, name, seed):
        space = grid()
        first = make_tuner(name, space, THROUGHPUT, seed=seed)
        for experiment in first.ask_batch(4):
            first.tell(evaluate_smooth(experiment))
        running = first.ask_batch(2)
        again = make_tuner(name, space, THROUGHPUT, seed=seed, trials=first.trials)
        assert again.results == first.results and again.pending == set(running)
        for _ in range(3):
            asked = first.ask()
            first.abandon([asked])
            assert again.ask() == asked
            again.tell(evaluate_smooth(asked))  # told through either, both read it

    def test_tell_outside_space_raises_value_error(self, name):
        tuner = make_tuner(name, grid(), THROUGHPUT, seed=0)
        stranger = Experiment(3, 1024, 7)
        with pytest.raises(ValueError, match=stranger.name):
            tuner.tell(ok(stranger, 1.0))
        # A knob variant of an experiment in the space is a different experiment.
        with pytest.raises(ValueError):
            tuner.tell(ok(Experiment(0, 1).with_knobs({"overlap_comm": True}), 1.0))
        assert tuner.results == {}

    def test_drive_stops_at_max_trials(self, name):
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        results = drive(tuner, evaluate_smooth, early_stopping=100, max_trials=5)
        assert len(results) == 5
        assert len(tuner.results) == 5
        assert len({r.experiment for r in results}) == 5

    def test_drive_with_zero_trials_runs_nothing(self, name):
        tuner = make_tuner(name, grid(), THROUGHPUT, seed=0)
        assert drive(tuner, evaluate_smooth, early_stopping=5, max_trials=0) == []

    @pytest.mark.parametrize("early_stopping", [1, 3, 6])
    def test_drive_stops_after_early_stopping_results_without_improvement(self, name, early_stopping):
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        evaluate = Counting(first=100.0, step=-1.0)  # only the first result improves
        results = drive(tuner, evaluate, early_stopping=early_stopping, max_trials=100)
        assert len(results) == 1 + early_stopping

    def test_drive_early_stopping_counts_for_latency_too(self, name):
        tuner = ordering_only(make_tuner(name, grid(), LATENCY, seed=0))
        evaluate = Counting(first=1.0, step=+0.5)  # larger latency: never an improvement after the first
        results = drive(tuner, evaluate, early_stopping=3, max_trials=100)
        assert len(results) == 4

    def test_drive_early_stopping_counts_failures(self, name):
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        results = drive(tuner, lambda e: TrialResult(e, TrialState.OOM, error="oom"), early_stopping=4,
                        max_trials=100)
        assert len(results) == 4
        assert tuner.best is None

    def test_drive_stops_when_exhausted(self, name):
        space = grid(stages=(0,), micros=(1, 2, 4, 8))
        tuner = ordering_only(make_tuner(name, space, THROUGHPUT, seed=0))
        results = drive(tuner, evaluate_smooth, early_stopping=100, max_trials=100)
        assert sorted(r.experiment for r in results) == sorted(space)
        assert tuner.ask() is None

    def test_failures_never_become_best(self, name):
        space = grid()
        tuner = ordering_only(make_tuner(name, space, THROUGHPUT, seed=0))

        def evaluate(experiment):
            if experiment.micro_batch_size == 8:
                return TrialResult(experiment, TrialState.OOM, error="out of memory")
            if experiment.zero_stage == 2:
                return TrialResult(experiment, TrialState.FAILED, error="boom")
            return ok(experiment, float(experiment.micro_batch_size))

        drive(tuner, evaluate, early_stopping=100, max_trials=100)
        assert tuner.best is not None
        assert tuner.best.state is TrialState.OK
        assert tuner.best.value == 4.0
        assert tuner.best.experiment.zero_stage in (0, 1)

    def test_failed_state_with_a_value_is_still_not_best(self, name):
        tuner = make_tuner(name, grid(), THROUGHPUT, seed=0)
        tuner.tell(TrialResult(Experiment(0, 8), TrialState.FAILED, value=1e9, error="boom"))
        tuner.tell(TrialResult(Experiment(0, 4), TrialState.TIMEOUT, value=1e9, error="slow"))
        assert tuner.best is None
        tuner.tell(ok(Experiment(0, 1), 3.0))
        assert tuner.best.experiment == Experiment(0, 1)

    def test_all_failures_give_no_best(self, name):
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        drive(tuner, lambda e: TrialResult(e, TrialState.FAILED, error="boom"), early_stopping=100, max_trials=100)
        assert len(tuner.results) == 12
        assert tuner.best is None

    def test_best_maximises_throughput(self, name):
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        drive(tuner, lambda e: ok(e, float(e.micro_batch_size * (e.zero_stage + 1))), early_stopping=100,
              max_trials=100)
        assert tuner.best.experiment == Experiment(2, 8)
        assert tuner.best.value == 24.0

    def test_best_minimises_latency(self, name):
        tuner = ordering_only(make_tuner(name, grid(), LATENCY, seed=0))
        drive(tuner, lambda e: ok(e, float(e.micro_batch_size * (e.zero_stage + 1))), early_stopping=100,
              max_trials=100)
        assert tuner.best.experiment == Experiment(0, 1)
        assert tuner.best.value == 1.0

    @pytest.mark.parametrize("seed", [0, 7])
    def test_finds_the_optimum_of_a_smooth_space(self, name, seed):
        space = grid()
        optimum = max(space, key=smooth_value)
        assert sorted(smooth_value(e) for e in space)[-2] < smooth_value(optimum)  # unique
        tuner = ordering_only(make_tuner(name, space, THROUGHPUT, seed=seed))
        drive(tuner, evaluate_smooth, early_stopping=len(space), max_trials=len(space))
        assert tuner.best.experiment == optimum == Experiment(1, 4)

    def test_a_batch_ask_gives_distinct_untried_experiments_and_results_may_arrive_in_any_order(self, name):
        space = grid()
        tuner = make_tuner(name, space, THROUGHPUT, seed=0)
        first = tuner.ask_batch(3)
        assert len(first) == len(set(first)) == 3 and set(first) <= set(space)
        second = tuner.ask_batch(4)
        assert len(second) == 4 and not set(second) & set(first)  # the running ones are never asked again
        for experiment in reversed(first + second):  # told in the opposite order
            tuner.tell(evaluate_smooth(experiment))
        assert tuner.pending == set()
        rest = tuner.ask_batch(100)
        assert sorted(first + second + rest) == sorted(space)
        assert tuner.ask_batch(2) == []

    @pytest.mark.parametrize("capacity", [2, 3])
    def test_a_parallel_drive_fills_every_slot_and_finds_the_optimum(self, name, capacity):
        space = grid()
        tuner = ordering_only(make_tuner(name, space, THROUGHPUT, seed=0))
        slots = Slots(capacity)
        results = drive(tuner, slots, early_stopping=len(space), max_trials=len(space))
        assert slots.most_at_once == capacity
        assert sorted(r.experiment for r in results) == sorted(space) == sorted(slots.submitted)
        assert tuner.best.experiment == Experiment(1, 4)

    def test_a_parallel_drive_stops_starting_at_max_trials_and_early_stopping(self, name):
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        assert len(drive(tuner, Slots(3), early_stopping=100, max_trials=5)) == 5
        tuner = ordering_only(make_tuner(name, grid(), THROUGHPUT, seed=0))
        slots = Slots(2, Counting(first=100.0, step=-1.0))  # only the first result to arrive improves
        results = drive(tuner, slots, early_stopping=3, max_trials=100)
        # Stopped once 3 in a row brought nothing; the one still running then is waited for and kept.
        assert 4 <= len(results) <= 5 and len(results) == len(slots.submitted)

    def test_finds_the_minimum_latency_of_a_smooth_space(self, name):
        space = grid()
        tuner = ordering_only(make_tuner(name, space, LATENCY, seed=0))
        drive(tuner, lambda e: ok(e, 200.0 - smooth_value(e)), early_stopping=len(space), max_trials=len(space))
        assert tuner.best.experiment == Experiment(1, 4)

    # ----- its own stop rule -----

    @pytest.mark.parametrize("failures", [0, 3])
    @pytest.mark.parametrize("seed", [0, 5])
    def test_a_drive_stops_exactly_when_its_own_stop_rule_first_says_so(self, name, failures, seed):
        space = grid()
        tuner = make_tuner(name, space, THROUGHPUT, seed=seed)
        results = drive(tuner, first_failing(failures), early_stopping=100, max_trials=100)
        assert results and list(tuner.results.values()) == results
        # Before each of its results the rule said go on (asked again over the same trials, it says
        # the same: it reads only the progress); after the last it said stop, or the space ran out.
        for count in range(len(results)):
            assert not its_rule_says_stop(name, space, THROUGHPUT, seed, results[:count]), count
        assert len(results) == len(space) or its_rule_says_stop(name, space, THROUGHPUT, seed, results)
        assert tuner.pending == set()

    @pytest.mark.parametrize("capacity", [2, 3])
    def test_a_parallel_drive_starts_nothing_once_its_own_stop_rule_says_stop(self, name, capacity):
        space = grid()
        tuner = make_tuner(name, space, THROUGHPUT, seed=0)
        slots = Watching(capacity, tuner)
        results = drive(tuner, slots, early_stopping=100, max_trials=100)
        assert slots.said_stop_at_a_submit == []
        # What was running when it said stop was still waited for and told.
        assert sorted(r.experiment for r in results) == sorted(slots.submitted) == sorted(tuner.results)
        assert tuner.pending == set()
        assert len(results) == len(space) or tuner.should_stop(DriveProgress.now(tuner.results, slots.arrived))

    def test_its_stop_rule_reads_only_the_progress(self, name):
        space = grid()
        first = ordering_only(make_tuner(name, space, THROUGHPUT, seed=0))
        results = drive(first, first_failing(2), early_stopping=100, max_trials=4)
        driven = make_tuner(name, space, THROUGHPUT, seed=0, trials=first.trials)
        progress = DriveProgress.now(driven.results, results)
        said = {driven.should_stop(progress) for _ in range(5)}  # asked again and again: the same answer
        again = make_tuner(name, space, THROUGHPUT, seed=0, trials=first.trials)
        assert said == {again.should_stop(progress)}


def test_a_factory_that_makes_its_tuner_without_the_trials_still_writes_to_the_ledger(monkeypatch):
    monkeypatch.setitem(TUNERS, "plain", TunerSpec("plain", lambda a: GridSearchTuner(a.space, a.objective), "test"))
    ledger = TrialLedger()
    tuner = make_tuner("plain", grid(), THROUGHPUT, trials=ledger.open_tuner_trials("ZeRO 0"))
    drive(tuner, evaluate_smooth, early_stopping=100, max_trials=3)
    assert len(ledger.tuner_trials()[0].told) == 3


# ----- the stop-rule extension point, on a toy tuner -----

class StopsAfter(GridSearchTuner):
    """Grid's order; its own rule says stop once `count` results are told (`started`: once this
    drive has started that many)."""

    def __init__(self, *args, count: int, started: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.count, self.started = count, started

    def should_stop(self, progress: DriveProgress) -> bool:
        return (progress.started if self.started else len(progress.told)) >= self.count


def stops_after(monkeypatch, count: int, started: bool = False) -> Tuner:
    """The toy registered as a tuner (as a plugin would be) and made by the registry."""
    monkeypatch.setitem(TUNERS, "stops_after", TunerSpec(
        "stops_after", lambda a: StopsAfter(a.space, a.objective, trials=a.trials, count=count, started=started),
        "test"))
    return make_tuner("stops_after", grid(), THROUGHPUT)


@pytest.mark.parametrize("count", [1, 3, 5])
def test_a_tuner_whose_rule_says_stop_after_n_is_told_exactly_n(monkeypatch, count):
    tuner = stops_after(monkeypatch, count)
    results = drive(tuner, evaluate_smooth, early_stopping=100, max_trials=100)
    assert len(results) == len(tuner.results) == count
    assert [r.experiment for r in results] == grid()[:count]
    assert drive(tuner, evaluate_smooth, early_stopping=100, max_trials=100) == []  # it says stop still
    assert tuner.pending == set()


def test_results_told_before_the_drive_count_for_the_tuners_rule_and_the_drivers_rules_take_turns(monkeypatch):
    tuner = stops_after(monkeypatch, 5)
    for experiment in grid()[-2:]:
        tuner.tell(evaluate_smooth(experiment))  # a confirmation run's, say
    assert len(drive(tuner, evaluate_smooth, early_stopping=100, max_trials=100)) == 3
    tuner = stops_after(monkeypatch, 5)
    assert len(drive(tuner, evaluate_smooth, early_stopping=100, max_trials=2)) == 2  # max_trials first
    tuner = stops_after(monkeypatch, 5)
    assert len(drive(tuner, Counting(first=100.0, step=-1.0), early_stopping=1, max_trials=100)) == 2


@pytest.mark.parametrize("capacity", [2, 3])
@pytest.mark.parametrize("count", [1, 4])
def test_a_parallel_drive_submits_nothing_once_the_tuners_rule_says_stop(monkeypatch, capacity, count):
    tuner = stops_after(monkeypatch, count, started=True)
    slots = Watching(capacity, tuner)
    results = drive(tuner, slots, early_stopping=100, max_trials=100)
    assert len(slots.submitted) == len(results) == len(tuner.results) == count  # each started one told
    assert slots.said_stop_at_a_submit == []
    # A rule on what was told: the ones running when it says stop finish, and are told, but no more start.
    tuner = stops_after(monkeypatch, count)
    slots = Watching(capacity, tuner)
    results = drive(tuner, slots, early_stopping=100, max_trials=100)
    assert slots.said_stop_at_a_submit == []
    assert count <= len(results) == len(slots.submitted) == len(tuner.results) < count + capacity
    assert tuner.pending == set()


# ----- FirstFitTuner -----

def test_first_fit_asks_in_the_spaces_order_and_stops_at_the_first_that_runs():
    space = grid()
    tuner = make_tuner("first_fit", space, THROUGHPUT)
    assert isinstance(tuner, FirstFitTuner)
    results = drive(tuner, first_failing(3), early_stopping=100, max_trials=100)
    assert [r.experiment for r in results] == space[:4]
    assert [r.state for r in results] == [TrialState.FAILED] * 3 + [TrialState.OK]
    assert tuner.best.experiment == space[3]


def test_first_fit_runs_nothing_when_it_was_told_a_fit_before_the_drive():
    tuner = make_tuner("first_fit", grid(), THROUGHPUT)
    tuner.tell(evaluate_smooth(Experiment(2, 8)))  # a stage's confirmation of its largest micro-batch
    assert drive(tuner, evaluate_smooth, early_stopping=100, max_trials=100) == []


def test_first_fit_with_nothing_that_runs_tries_everything():
    tuner = make_tuner("first_fit", grid(), THROUGHPUT)
    results = drive(tuner, first_failing(100), early_stopping=100, max_trials=100)
    assert len(results) == 12 and tuner.best is None


def test_first_fit_in_parallel_waits_for_what_runs_and_starts_no_more():
    tuner = make_tuner("first_fit", grid(), THROUGHPUT)
    slots = Slots(3)  # last in, first out: the third asked arrives first and fits
    results = drive(tuner, slots, early_stopping=100, max_trials=100)
    assert slots.submitted == grid()[:3] and len(results) == 3


def test_random_tuner_seeds_change_the_order():
    orders = {tuple(exhaust(make_tuner("random", grid(), THROUGHPUT, seed=seed))) for seed in range(5)}
    assert len(orders) > 1


# ----- ModelBasedTuner -----

LADDER = [Experiment(0, 2**k) for k in range(9)]  # micro 1..256


def linear_in_log_micro(experiment: Experiment) -> float:
    return 10.0 + 5.0 * math.log2(experiment.micro_batch_size)


def _told(objective: Objective, value, tried=(1, 2, 4), **kwargs) -> ModelBasedTuner:
    tuner = ModelBasedTuner(LADDER, objective, seed=0, initial_trials=2, explore=0.0, **kwargs)
    for micro in tried:
        experiment = Experiment(0, micro)
        tuner.tell(ok(experiment, value(experiment)))
    return tuner


def test_model_based_picks_highest_predicted_untried_experiment():
    tuner = _told(THROUGHPUT, linear_in_log_micro)
    untried = [e for e in LADDER if e not in tuner.results]
    predicted = tuner.predict(untried)
    choice = tuner.ask()
    assert choice == untried[int(np.argmax(predicted))]
    assert choice == Experiment(0, 256)
    # The surface is fitted: predictions follow the linear law on untried points.
    np.testing.assert_allclose(predicted, [linear_in_log_micro(e) for e in untried], rtol=0.05)


def test_model_based_picks_lowest_predicted_for_latency():
    tuner = _told(LATENCY, lambda e: 100.0 - linear_in_log_micro(e))
    untried = [e for e in LADDER if e not in tuner.results]
    choice = tuner.ask()
    assert choice == untried[int(np.argmin(tuner.predict(untried)))]
    assert choice == Experiment(0, 256)


def test_model_based_follows_the_fit_not_the_space_order():
    # Throughput falls with micro-batch: the best predicted untried point is the smallest one,
    # though the space lists it first and the tuner's last tries were larger.
    tuner = _told(THROUGHPUT, lambda e: 100.0 - linear_in_log_micro(e), tried=(2, 8, 32))
    assert tuner.ask() == Experiment(0, 1)


def test_model_based_extrapolates_a_linear_surface():
    tuner = _told(THROUGHPUT, lambda e: 100.0 - linear_in_log_micro(e), tried=(64, 128, 256))
    assert tuner.ask() == Experiment(0, 1)


def test_model_based_steers_away_from_failures():
    tuner = ModelBasedTuner(LADDER, THROUGHPUT, seed=0, initial_trials=2, explore=0.0)
    for micro in (1, 2, 4):
        tuner.tell(ok(Experiment(0, micro), linear_in_log_micro(Experiment(0, micro))))
    for micro in (128, 256):
        tuner.tell(TrialResult(Experiment(0, micro), TrialState.OOM, error="oom"))
    assert tuner.ask().micro_batch_size < 128


def test_model_based_initial_trials_are_seeded_random():
    def first_two(seed):
        tuner = ModelBasedTuner(LADDER, THROUGHPUT, seed=seed, initial_trials=2, explore=0.0)
        return exhaust(tuner, lambda e: ok(e, linear_in_log_micro(e)))[:2]

    assert first_two(5) == first_two(5)


def test_model_based_with_no_initial_trials_still_asks():
    tuner = ModelBasedTuner(LADDER, THROUGHPUT, seed=0, initial_trials=0, explore=0.0)
    assert tuner.ask() in LADDER


# ----- BayesTuner -----

def _wide_space() -> list[Experiment]:
    return [Experiment(s, m) for s, m in itertools.product((0, 1, 2, 3), (1, 2, 4, 8, 16, 32, 64, 128))]


def _peaked(experiment: Experiment) -> float:
    """One optimum, at stage 2 and micro-batch 16, in a 32-point space."""
    return 100.0 - 10.0 * (math.log2(experiment.micro_batch_size) - 4) ** 2 - 5.0 * (experiment.zero_stage - 2) ** 2


@needs_optuna
@pytest.mark.parametrize("seed", range(6))
def test_bayes_reaches_the_optimum_within_half_the_space(seed):
    space = _wide_space()
    optimum = max(space, key=_peaked)
    tuner = make_tuner("bayes", space, THROUGHPUT, seed=seed)
    order = exhaust(tuner, lambda e: ok(e, _peaked(e)))
    assert order.index(optimum) < len(space) // 2

