"""The ledger's contract over a whole tune (fake runner): one append-only list of frozen records,
a launch counted once as a record of a kind that launches (a repeat after interference
included), and every value computed again from the record's measurement alone."""

from __future__ import annotations

import dataclasses
import re

from autotuner.tuning.space.records import TrialState
from autotuner.tuning.trials.ledger import TrialKind
from autotuner.tuning.trials.trial import rescored
from fakes import FakeRunner, by_micro, tuner


def disturbed_once(name: str, answer):
    """`answer`, but the first launch of `name` reports half the CPUs taken by another process."""
    seen: set[str] = set()

    def run(trial):
        result = answer(trial)
        if trial.directory.name == name and name not in seen:
            seen.add(name)
            result = dataclasses.replace(result, measurement=dataclasses.replace(result.measurement,
                                                                                 cpu_taken_by_others=0.5))
        return result
    return run


def test_every_launch_is_one_record_and_every_value_comes_from_its_measurement(tmp_path):
    runner = FakeRunner(disturbed_once("z0_gas1_mbs4", by_micro({2: 10.0, 4: 20.0, 8: 15.0})))
    autotuner = tuner(tmp_path, runner, {"remeasure_rounds": 2},
                      train_micro_batch_size_per_gpu=[2, 4, 8], zero_optimization={"stage": [0, 1]})
    outcome = autotuner.tune()
    ledger = autotuner.ledger
    records = ledger.records
    # Launches: the runner's count, the ledger's, the records that launched, and the summary's, alike.
    launched = [r for r in records if r.launched]
    assert len(runner.trials) == ledger.launches == len(launched)
    assert int(re.search(r"Launches: (\d+)", outcome.summary).group(1)) == len(runner.trials)
    assert "1 launched again after interference" in outcome.summary
    # The disturbed launch is a record of its own (its directory: test_window.py); the repeat is the result.
    repeat = next(r for r in records if r.kind is TrialKind.REPEAT)
    first = records[repeat.repeats]
    assert first.experiment == repeat.experiment and first.result.measurement.cpu_taken_by_others == 0.5
    result = next(r for r in ledger.results() if r.experiment == repeat.experiment)
    assert result.measurement.cpu_taken_by_others is None
    # Numbered in order, frozen, and each value computed again from the measurement alone.
    assert [r.number for r in records] == list(range(len(records)))
    settings = autotuner.profiled.job.settings
    for record in records:
        if record.result.measurement is None or record.kind in (TrialKind.PRUNED, TrialKind.REFUSED):
            continue
        again = rescored(dataclasses.replace(record.result, value=None, value_std=None), settings)
        assert (again.state, again.value) == (ledger.scored(record).state, ledger.scored(record).value), record
    assert {r.kind for r in records} >= {TrialKind.PROFILE, TrialKind.SEARCH, TrialKind.REMEASURE, TrialKind.REPEAT}


def test_a_new_objective_changes_the_values_read_never_the_records(tmp_path):
    autotuner = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})))
    autotuner.tune()
    ledger = autotuner.ledger
    before = ledger.records
    values = [r.value for r in ledger.results()]
    settings = autotuner.profiled.job.settings
    ledger.score_with(lambda result: dataclasses.replace(result, value=(result.value or 0) * 2)
                      if result.state is TrialState.OK else result)
    assert ledger.records == before and all(a is b for a, b in zip(ledger.records, before))
    assert [r.value for r in ledger.results()] == [2 * v for v in values]
    ledger.score_with(lambda result: rescored(result, settings))
    assert [r.value for r in ledger.results()] == values
