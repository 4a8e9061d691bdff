"""The tuning history in optuna's storage: every launch a trial, readable by optuna's own API; a
storage that is locked, unreachable or of a newer schema costs one line, never the tuning run."""

from __future__ import annotations

import sqlite3

import pytest

from autotuner.app.history import history_rows
from autotuner.tuning.trials.history import default_url, study_name
from autotuner.tuning.tuners import TUNERS

optuna = pytest.importorskip("optuna")

from fakes import FakeRunner, by_micro, fingerprint, profiled, tuner as plain_tuner  # noqa: E402


def tuner(tmp_path, runner, autotuning=None, **kwargs):
    """The orchestrator's fake tuning run with the history on (the default; off in other tests)."""
    return plain_tuner(tmp_path, runner, autotuning={"history": True, **(autotuning or {})}, **kwargs)


def test_every_launch_is_a_trial_of_the_workloads_study_readable_by_optuna(tmp_path):
    lines: list[str] = []
    outcome = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), print_to=lines).tune()
    url = default_url(tmp_path / "results")
    study = optuna.load_study(study_name=study_name(fingerprint()), storage=url)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert study.metric_names == ["throughput (samples/s)"]  # the dashboard's axis name
    trials = study.get_trials()
    assert [t.user_attrs["name"] for t in trials] == ["z0_gas1_mbs2", "z0_gas1_mbs4"]
    assert [t.user_attrs["phase"] for t in trials] == ["profile", "search"]
    assert [t.params["micro_batch_size"] for t in trials] == [2, 4]
    assert all(t.params["zero_stage"] == 0 and t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert study.best_trial.user_attrs["name"] == outcome.best.name and study.best_value == 20.0
    assert trials[1].user_attrs["measured_memory_bytes"] == 200 * 2**20
    assert study.user_attrs["fingerprint"]["script"] == "/work/train.py"
    assert any(line.startswith("history: 2 launches recorded") for line in lines)
    # A second run of the same workload adds to the same study; --history shows one row for it.
    tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), autotuning={"overwrite": True}).tune()
    assert len(optuna.load_study(study_name=study_name(fingerprint()), storage=url).trials) == 4
    rows = history_rows(url)
    assert len(rows) == 1 and rows[0]["pick"] == "z0_gas1_mbs4" and rows[0]["launches"] == 4
    assert rows[0]["throughput"] == "20 samples/s" and "train.py --width 256" in rows[0]["workload"]


def test_a_failed_launch_is_a_failed_trial(tmp_path):
    from fakes import ok

    from autotuner.tuning.space.records import TrialResult, TrialState

    def answer(trial):
        if trial.experiment.micro_batch_size == 4:
            return TrialResult(trial.experiment, TrialState.OOM, error="out of memory on rank 1")
        return ok(trial, 10.0, 100 * 2**20)

    tuner(tmp_path, FakeRunner(by_micro_answer(answer))).tune()
    trials = optuna.load_study(study_name=study_name(fingerprint()), storage=default_url(tmp_path / "results")).trials
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.user_attrs["state"] for t in failed] == ["oom"] and failed[0].user_attrs["error"].startswith("out of")


def by_micro_answer(answer):
    return profiled(answer)


def lock_exclusively(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE IF NOT EXISTS held (x)")
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def newer_schema(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    optuna.storages.RDBStorage(f"sqlite:///{path}")  # creates the tables
    with sqlite3.connect(path) as db:
        db.execute("UPDATE alembic_version SET version_num = 'v99.0.0.z'")


@pytest.mark.parametrize("storage", ["locked", "unreachable", "newer schema"])
def test_a_storage_that_cannot_be_written_costs_one_line_and_the_run_goes_on(tmp_path, storage):
    path = tmp_path / "results" / "history.db"
    holder = None
    autotuning = {}
    if storage == "locked":
        holder = lock_exclusively(path)
    elif storage == "unreachable":
        autotuning = {"storage": "sqlite:////proc/no_such_dir/history.db"}  # a path nothing can create
    else:
        newer_schema(path)
    lines: list[str] = []
    try:
        outcome = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), autotuning=autotuning,
                        print_to=lines).tune()
    finally:
        if holder is not None:
            holder.close()
    assert outcome.best.name == "z0_gas1_mbs4"  # the tuning run is whole
    said = [line for line in lines if line.startswith("history:")]
    assert len(said) == 1 and "not recorded from here on" in said[0] and "exp.json" in said[0], lines
    assert (tmp_path / "exps" / "z0_gas1_mbs4" / "exp.json").is_file()  # the journal holds everything


def test_history_off_writes_no_database(tmp_path):
    tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), autotuning={"history": False}).tune()
    assert not (tmp_path / "results" / "history.db").exists()


@pytest.mark.parametrize("tuner_type", sorted(TUNERS))
def test_every_tuner_records_each_of_its_launches(tmp_path, tuner_type):
    runner = FakeRunner(by_micro({2: 10.0, 4: 20.0, 8: 30.0}))
    tuner(tmp_path, runner, autotuning={"tuner_type": tuner_type},
          train_micro_batch_size_per_gpu=[2, 4, 8]).tune()
    trials = optuna.load_study(study_name=study_name(fingerprint()), storage=default_url(tmp_path / "results")).trials
    assert sorted(t.user_attrs["name"] for t in trials) == sorted(runner.names) != []
    assert {t.user_attrs["tuner_type"] for t in trials} == {tuner_type}
    searched = [t for t in trials if t.user_attrs["phase"] == "search"]
    predicted = [t for t in searched if t.user_attrs["predicted_metric"] is not None]
    if tuner_type == "predictive":  # what the model expected of each launch, before it ran
        assert predicted == searched != []
        for t in predicted:
            attrs = t.user_attrs
            assert attrs["predicted_metric_low"] <= attrs["predicted_metric"] <= attrs["predicted_metric_high"]
    else:
        assert predicted == []
    assert all(t.user_attrs["predicted_metric"] is None for t in trials if t.user_attrs["phase"] == "profile")


def test_a_dimensions_param_keeps_one_distribution_whatever_form_the_value_takes():
    # A study refuses a param whose distribution kind changes: 5e8 (a float in JSON) and 50000000
    # must record alike, and a categorical dimension's choices must not depend on the run's value.
    from optuna.distributions import check_distribution_compatibility

    from autotuner.tuning.trials.history import _distribution

    check_distribution_compatibility(_distribution("reduce_bucket_size", 5e8),
                                     _distribution("reduce_bucket_size", 50_000_000))
    check_distribution_compatibility(_distribution("stage3_param_persistence_threshold", 0),
                                     _distribution("stage3_param_persistence_threshold", 1e4))
    check_distribution_compatibility(_distribution("activation_checkpointing", "none"),
                                     _distribution("activation_checkpointing", "full"))
    check_distribution_compatibility(_distribution("overlap_comm", True), _distribution("overlap_comm", False))


def test_an_experiments_dimensions_are_its_trials_params(tmp_path):
    from fakes import ok

    from autotuner.tuning.trials.trial import Trial
    from autotuner.tuning.trials.history import History
    from autotuner.tuning.space.records import Objective
    from autotuner.tuning.space.experiment import Experiment

    knobs = (("activation_checkpointing", "full"), ("compile", True), ("reduce_bucket_size", 5e8))
    trial = Trial(Experiment(1, 4, 2, knobs), tmp_path / "exp", None)  # type: ignore[arg-type]
    url = f"sqlite:///{tmp_path / 'history.db'}"
    lines: list[str] = []
    history = History(url, fingerprint(), Objective("throughput"), "gridsearch", lines.append)
    history.record(ok(trial, 12.0), "search")
    assert not lines and history.recorded == 1
    (recorded,) = optuna.load_study(study_name=history.study_name, storage=url).trials
    assert recorded.params == {"zero_stage": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 2,
                               "activation_checkpointing": "full", "compile": True, "reduce_bucket_size": 5e8}
