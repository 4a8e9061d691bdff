"""What each built-in tuner launches, end to end through the orchestrator over a fake runner, held
against a committed record (golden/tuner_launches.json): a change in the spine (the ledger, the
job records, the searches) that changes which experiments a tuner launches, or in what order, or
what it picks, shows here. Regenerate deliberately with AUTOTUNER_WRITE_GOLDEN=1 and say why in
the commit."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.tuners import BUILT_IN_TUNERS, TUNERS
from fakes import FakeRunner, MiB, model_info, ok, tuner

GOLDEN = Path(__file__).parent / "golden" / "tuner_launches.json"
BUILT_IN = tuple(sorted(BUILT_IN_TUNERS))  # the registry's own: a plugin's tuner is not on record
BUDGET = 2 * 2**30  # per rank


def landscape(trial) -> TrialResult:
    """A model whose peak grows 40 MiB per sample over a per-stage base (sharding lowers it), and
    whose throughput peaks at micro-batch 8 on ZeRO 1; above the budget it runs out of memory."""
    experiment = trial.experiment
    stage, micro = experiment.zero_stage, experiment.micro_batch_size
    peak = (900 - 150 * stage) * MiB + 40 * MiB * micro
    if peak > BUDGET:
        return TrialResult(experiment, TrialState.OOM, error="out of memory on rank 0", wall_time_s=1.0)
    knob_bonus = sum(len(str(kv)) % 7 for kv in experiment.knobs) / 10  # fixed per knob value
    value = 100.0 - 8.0 * (math.log2(micro) - 3) ** 2 - 6.0 * (stage - 1) ** 2 + knob_bonus
    result = ok(trial, value / experiment.gradient_accumulation_steps ** 0.1, peak)
    if trial.profile:
        import dataclasses

        info = model_info(micro, stage, activation_bytes=micro * 40 * MiB, peak_memory_bytes=peak,
                          num_params=20_000_000, trainable_num_params=20_000_000,
                          device_memory_bytes=None)
        result = dataclasses.replace(result, model_info=info)
    return result


SCENARIOS = {
    "auto sizes, every stage": dict(train_micro_batch_size_per_gpu="auto", zero_optimization={"stage": "all"}),
    "fixed sizes, stages 0-2": dict(train_micro_batch_size_per_gpu=[2, 4, 8, 16], zero_optimization={"stage": [0, 1, 2]}),
    "full mode, stages 0-1": dict(train_micro_batch_size_per_gpu="auto", zero_optimization={"stage": [0, 1]},
                                  fast=False),
}


def launches(tmp_path, tuner_type: str, scenario: dict) -> dict:
    top = {k: v for k, v in scenario.items() if k != "fast"}
    autotuning = {"tuner_type": tuner_type, "memory_per_rank_bytes": BUDGET, "fast": scenario.get("fast", True),
                  "tuner_num_trials": 12, "tuner_early_stopping": 4, "max_train_micro_batch_size_per_gpu": 64}
    runner = FakeRunner(landscape)
    outcome = tuner(tmp_path, runner, autotuning, **top).tune()
    return {"launched": runner.names, "pick": outcome.best.name if outcome.best else None}


def test_the_record_covers_every_built_in_tuner():
    assert set(BUILT_IN) <= set(TUNERS)
    assert sorted(json.loads(GOLDEN.read_text())) == sorted(BUILT_IN)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("tuner_type", BUILT_IN)
def test_each_tuner_launches_what_it_launched_when_recorded(tmp_path, tuner_type, scenario):
    if tuner_type == "bayes":
        pytest.importorskip("optuna")
    got = launches(tmp_path, tuner_type, SCENARIOS[scenario])
    if os.environ.get("AUTOTUNER_WRITE_GOLDEN"):
        record = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        record.setdefault(tuner_type, {})[scenario] = got
        GOLDEN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(GOLDEN.read_text())[tuner_type][scenario]
