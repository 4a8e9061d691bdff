"""The trial ledger and the one evaluator over it, with no runner: what is known is not launched
again, a failed variant is refused, an earlier run's record is reused, and the stores keep launches."""

from __future__ import annotations

from pathlib import Path

from autotuner.tuning.trials.evaluator import Evaluator, FunctionLaunches, evaluator_of
from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.trials.ledger import TrialLedger
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.space.search_space import SearchSpace
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.searches.variant_rules import FailedVariants
from fakes import fingerprint

FULL = (("activation_checkpointing", "full"),)
NONE = (("activation_checkpointing", "none"),)


class Launches:
    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def __call__(self, experiment: Experiment) -> TrialResult:
        self.asked.append(experiment)
        return self.answer(experiment)


def ok(experiment: Experiment) -> TrialResult:
    return TrialResult(experiment, TrialState.OK, value=float(experiment.micro_batch_size))


class Store:
    fingerprint = fingerprint()

    def __init__(self, earlier=None):
        self._earlier, self.kept = earlier or {}, []

    def earlier(self):
        return dict(self._earlier)

    def keep(self, trial, result, prediction):
        self.kept.append((trial.directory.name, result.name, prediction))


def test_an_experiment_already_measured_is_answered_from_the_ledger_not_launched_again():
    launches = Launches(ok)
    evaluate = evaluator_of(launches)
    first = evaluate(Experiment(0, 4))
    assert evaluate(Experiment(0, 4)) is first and launches.asked == [Experiment(0, 4)]
    assert evaluate.ledger.results() == (first,) and Objective().best(list(evaluate.ledger.results())) is first


def test_an_earlier_runs_record_is_recorded_as_reused_and_each_record_is_heard_once():
    earlier = TrialResult(Experiment(0, 8), TrialState.OK, value=8.0)
    ledger = TrialLedger([Store({"z0_gas1_mbs8": earlier})])
    ledger.resume()
    heard = []
    ledger.on_record(lambda result, reused: heard.append((result.name, reused)))
    launches = Launches(ok)
    evaluate = Evaluator(ledger, FunctionLaunches(launches))
    assert evaluate(Experiment(0, 8)) is earlier and evaluate(Experiment(0, 2)).value == 2.0
    evaluate(Experiment(0, 8))
    assert launches.asked == [Experiment(0, 2)]
    assert heard == [("z0_gas1_mbs8", True), ("z0_gas1_mbs2", False)]


def test_a_searchs_evaluator_refuses_a_failed_variant_but_gives_its_earlier_answers_again():
    space = SearchSpace(stages=(0,), data_parallel_size=1, variants={0: (NONE, FULL)})
    failing = {Experiment(0, 2, 1, FULL)}
    launches = Launches(lambda e: TrialResult(e, TrialState.FAILED, error="x") if e in failing else ok(e))
    evaluator = evaluator_of(launches)
    search = evaluator.for_search(FailedVariants(space, evaluator.ledger.results))
    larger = search(Experiment(0, 4, 1, FULL))
    assert search(Experiment(0, 2, 1, FULL)).state is TrialState.FAILED
    assert search(Experiment(0, 4, 1, FULL)) is larger  # answered before the variant failed
    refused = search(Experiment(0, 8, 1, FULL))
    assert refused.state is TrialState.PRUNED and "failed in z0_acfull_gas1_mbs2" in refused.error
    assert search(Experiment(0, 8, 1, NONE)).state is TrialState.OK
    assert len(launches.asked) == 3
    # The refusal is an answer of the search, not a result of the run.
    assert refused in search.answered() and Experiment(0, 8, 1, FULL) not in search.ledger


def test_a_parallel_submit_answers_what_is_known_without_a_slot():
    class Slots:
        capacity = 2

        def __init__(self):
            self.running, self.submitted = [], []

        def __call__(self, experiment):
            raise AssertionError("sequential call on a parallel evaluate")

        def submit(self, experiment):
            self.running.append(experiment)
            self.submitted.append(experiment)

        def next_result(self):
            return ok(self.running.pop())

    slots = Slots()
    evaluate = evaluator_of(slots)
    assert evaluate.capacity == 2
    evaluate.submit(Experiment(0, 2))
    evaluate.submit(Experiment(0, 4))
    assert {evaluate.next_result().name, evaluate.next_result().name} == {"z0_gas1_mbs2", "z0_gas1_mbs4"}
    evaluate.submit(Experiment(0, 4))
    assert evaluate.next_result().name == "z0_gas1_mbs4" and len(slots.submitted) == 2


def test_the_stores_keep_each_launch_with_the_prediction_it_was_asked_on(tmp_path: Path):
    store = Store()
    ledger = TrialLedger([store])
    ledger.note_prediction(Experiment(0, 4), "predicted")
    trial = Trial(Experiment(0, 4), tmp_path / "z0_gas1_mbs4", settings=None)  # type: ignore[arg-type]
    ledger.keep(trial, ok(Experiment(0, 4)))
    assert store.kept == [("z0_gas1_mbs4", "z0_gas1_mbs4", "predicted")]
    assert ledger.results() == ()  # kept is not recorded: a re-measurement is not the experiment's result
