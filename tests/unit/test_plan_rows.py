"""`--autotuning plan`'s rows (searches/plan_search.py) on synthetic profile results: the rows are
the predictive search's own candidates with the search's own predictions, plus the ladder past the
memory limit with the reason; the written table's figures follow from the rows. Pure: no launches."""

from __future__ import annotations

import pandas as pd
import pytest

from autotuner.tuning.reports.plan_table import PlanReport, csv_rows, plan_text, write_plan
from autotuner.tuning.searches.plan_search import PlanModels, plan_rows, predicted_pick
from autotuner.tuning.searches.predictive_search import candidate_space
from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.space.search_space import SearchSpace
from autotuner.tuning.trials.evaluator import TuningFailed
from autotuner.tuning.tuners import PredictiveTuner
from test_predictive import CONTEXT, THROUGHPUT, WORLD, measured

SPACE = SearchSpace(stages=(0, 3), data_parallel_size=WORLD, max_micro_batch_size=64, global_batch_size=128,
                    global_batch_exact=True)
MIB = 2**20


def memory(e: Experiment) -> int:
    """ZeRO 3 holds less state; each sample 10 MiB: ZeRO 0 fits up to 16, ZeRO 3 up to 32."""
    return (300 if e.zero_stage == 0 else 100) * MIB + 10 * MIB * e.micro_batch_size


def fits(e: Experiment) -> bool:
    return memory(e) <= 480 * MIB


def largest() -> dict:
    return {s: max(m for m in SPACE.valid_micro_batch_sizes(64) if fits(SPACE.experiment(s, m))) for s in SPACE.stages}


MODELS = PlanModels(fits, memory, largest(), lambda stage, variant=(): None, CONTEXT)
PROFILE = [measured(SPACE.experiment(0, 2)), measured(SPACE.experiment(0, 8)), measured(SPACE.experiment(3, 8))]


def rows():
    return plan_rows(SPACE, THROUGHPUT, MODELS, PROFILE, lambda line: None)


def test_the_candidates_are_the_searchs_and_carry_its_predictions():
    found = rows()
    candidates = candidate_space(SPACE, largest(), fits, lambda *a, **k: None, MODELS.offload_fallback,
                                 lambda line: None)
    assert [r.experiment for r in found if r.candidate] == sorted(candidates, key=lambda e: (e.zero_stage,
                                                                                           e.micro_batch_size))
    tuner = PredictiveTuner(candidates, THROUGHPUT, context=CONTEXT)
    for result in PROFILE:
        tuner.observe(result)
    for row in found:
        assert row.predicted_value == tuner.predict(row.experiment).value
        assert row.predicted_memory_bytes == memory(row.experiment) and row.fits == fits(row.experiment)
        assert row.predicted_step_low_s <= row.predicted_step_s <= row.predicted_step_high_s
    # The profile's own experiments carry what they measured.
    profiled = {r.experiment: r.measurement.latency for r in PROFILE}
    assert {r.experiment: r.measured_step_s for r in found if r.measured_step_s} == profiled


def test_the_ladder_past_the_memory_limit_is_listed_left_out_with_the_reason():
    found = rows()
    too_big = [r for r in found if not r.fits]
    assert {(r.experiment.zero_stage, r.experiment.micro_batch_size) for r in too_big} == {(0, 32), (0, 64), (3, 64)}
    for row in too_big:
        assert not row.candidate and row.left_out.startswith("out of memory by the memory model (predicted ")
    # Micro-batch 1 fits but is not among the search's sizes: left out, and said why.
    one = next(r for r in found if r.experiment == SPACE.experiment(0, 1))
    assert one.fits and not one.candidate and "micro-batch 1 only where nothing larger fits" in one.left_out


def test_the_pick_is_the_best_predicted_candidate_and_the_table_follows_the_rows(tmp_path):
    found = rows()
    pick = predicted_pick(found, THROUGHPUT)
    assert pick.candidate and pick.predicted_value == max(r.predicted_value for r in found if r.candidate)
    report = PlanReport(tuple(found), pick, ("a line",), THROUGHPUT, 200, "none", 2.0)
    table = pd.read_csv(write_plan(tmp_path, report))
    assert len(table) == len(found) and table.picked.sum() == 1 and table[table.picked].name.iloc[0] == pick.experiment.name
    for row, written in zip(found, csv_rows(report)):
        steps_s = 200 * row.predicted_step_s
        assert written["planned_run_s"] == float(f"{steps_s:.5g}")
        assert written["planned_cost"] == float(f"{steps_s * WORLD / 3600 * 2.0:.5g}")
        assert written["train_batch_size"] == 128 and written["tp"] == 1 and written["pp"] == 1
    text = plan_text(report)
    assert f"plan: predicted pick {pick.experiment.name} (*)" in text and "a line" in text
    assert "*" + pick.experiment.name in text


def test_a_layout_whose_profile_measured_no_step_is_refused_not_predicted_from_nothing():
    failed = [TrialResult(SPACE.experiment(0, 2), TrialState.OOM, error="peak over the budget")]
    with pytest.raises(TuningFailed, match="no profile launch measured a step"):
        plan_rows(SPACE, THROUGHPUT, MODELS, failed, lambda line: None)
