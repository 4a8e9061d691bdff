"""Fakes for the tuner's unit tests: a runner that launches nothing, records and their defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from autotuner.core.boundary import Measurement, ModelInfo
from autotuner.config import DeepSpeedConfig, load_config
from autotuner.tuning.space.config_space import base_config
from autotuner.tuning.trials.trial import ExperimentSettings, Trial
from autotuner.tuning.trials.journal import Fingerprint
from autotuner.tuning.space.records import Objective, TrialResult, TrialState
from autotuner.tuning.orchestrator import Autotuner
from autotuner.tuning.trials.runner import OneSlot


def model_info(micro_batch_size: int = 1, zero_stage: int = 0, precision: str = "fp32", **values) -> ModelInfo:
    defaults = dict(num_params=1000, trainable_num_params=1000, activation_bytes=1000,
                    optimizer_state_bytes_per_param=8.0, peak_memory_bytes=100 * 2**20, world_size=2)
    return ModelInfo(micro_batch_size=micro_batch_size, zero_stage=zero_stage, precision=precision,
                     **{**defaults, **values})


def experiment_settings(config: DeepSpeedConfig, **values) -> ExperimentSettings:
    """A fake tuning run's settings: train.py on 2 ranks of one node, from `config`; `values` override."""
    defaults = dict(script="train.py", script_args=("--deepspeed", "ds.json"), base_config=base_config(config),
                    nproc_per_node=2, data_parallel_size=2, objective=Objective("throughput"), timeout_s=30.0)
    return ExperimentSettings(**{**defaults, **values})


def fingerprint(**changes) -> Fingerprint:
    values = dict(script="/work/train.py", script_sha256="a" * 64, script_args=("--width", "256"),
                  config_sha256="b" * 64, nproc_per_node=2, num_nodes=1, launcher_args=(), torch_version="2.13.0",
                  device="cpu test")
    return Fingerprint(**{**values, **changes})


class FakeRunner(OneSlot):
    """Answers each trial with `answer(trial)`; remembers what it was asked. Launches nothing."""

    name = "fake"

    def __init__(self, answer: Callable[[Trial], TrialResult]):
        super().__init__()
        self.answer = answer
        self.trials: list[Trial] = []

    def run(self, trial: Trial) -> TrialResult:
        self.trials.append(trial)
        return self.answer(trial)

    def close(self) -> None:
        pass

    @property
    def names(self) -> list[str]:
        return [trial.directory.name for trial in self.trials]


def ok(trial: Trial, throughput: float, peak_bytes: int | None = None) -> TrialResult:
    measurement = Measurement(throughput=throughput, latency=1.0 / throughput, peak_memory_bytes=peak_bytes)
    return TrialResult(trial.experiment, TrialState.OK, value=throughput, measurement=measurement,
                       predicted_memory_bytes=trial.predicted_memory_bytes, measured_memory_bytes=peak_bytes,
                       wall_time_s=1.0)


def never_called(trial: Trial) -> TrialResult:
    raise AssertionError(f"the runner was asked for {trial.directory.name}")


class ParallelFakeRunner(FakeRunner):
    """A FakeRunner with `capacity` slots: `submit` queues a trial, `next_result` answers the most
    recently submitted one first (so results arrive out of the order submitted). Remembers the
    most trials it held at once."""

    def __init__(self, answer: Callable[[Trial], TrialResult], capacity: int):
        super().__init__(answer)
        self.capacity = capacity
        self.held: list[Trial] = []
        self.most_at_once = 0
        self.finished_order: list[str] = []

    def submit(self, trial: Trial) -> None:
        self.trials.append(trial)
        self.held.append(trial)
        self.most_at_once = max(self.most_at_once, len(self.held))
        assert len(self.held) <= self.capacity

    def next_result(self) -> tuple[Trial, TrialResult]:
        trial = self.held.pop()
        self.finished_order.append(trial.directory.name)
        return trial, self.answer(trial)


# ----- an orchestrator over a fake runner, shared by the orchestrator, history and transfer tests -----
MiB = 2**20


def tuner(tmp_path: Path, runner: FakeRunner, autotuning: dict | None = None, print_to: list | None = None,
          print_fingerprint=None, **top) -> Autotuner:
    config = load_config({"train_micro_batch_size_per_gpu": [2, 4], "zero_optimization": {"stage": 0}, **top,
                          "autotuning": {"enabled": True, "memory_per_rank_bytes": 4 * 2**30,
                                                         "tuner_type": "gridsearch", "history": False,
                                                         **(autotuning or {})}})
    settings = experiment_settings(config, objective=Objective(config.autotuning.metric),
                                   memory_budget_bytes=config.autotuning.memory_per_rank_bytes)
    lines = print_to if print_to is not None else []
    return orchestrator(tmp_path, config, runner, settings, report=lines.append,
                        run_fingerprint=print_fingerprint or fingerprint())


def orchestrator(tmp_path: Path, config: DeepSpeedConfig, runner: FakeRunner, settings: ExperimentSettings | None = None,
                 report: Callable[[str], None] = lambda line: None, run_fingerprint: Fingerprint | None = None,
                 settle_engine: Callable[[str], str] | None = None, **job) -> Autotuner:
    """The orchestrator over `config` and a fake runner, with the job as the settle pass builds it
    (device facts and search space, `settled`), writing under `tmp_path`; `job` replaces fields of
    TuningJob.settled (space, devices, layouts, left_out, placement)."""
    from autotuner.tuning.profiling.job import TuningJob

    settings = settings or experiment_settings(config)
    built = TuningJob.settled(config, settings, fingerprint=run_fingerprint or fingerprint(),
                              **{**settled(config, settings), **job})
    extra = {} if settle_engine is None else {"settle_engine": settle_engine}
    return Autotuner(built, tmp_path / "results", tmp_path / "exps", runner, report=report, **extra)


def settled(config, settings: ExperimentSettings) -> dict:
    """The device facts and the search space the settle pass gives the orchestrator (app/settle.py)."""
    from autotuner.tuning.space.config_space import search_space
    from autotuner.tuning.space.devices import read_device_facts

    devices = read_device_facts()
    return {"devices": devices,
            "space": search_space(config, settings.data_parallel_size, settings.engine, devices.on_gpu)}


class BookOverLedger:
    """A memory book on given facts over a ledger of its own, as the orchestrator holds one after
    the profile: `learn` records a launch's result in the ledger, which the book reads its peaks
    from; `with_facts` gives the book other facts (a record is never changed) over the same ledger."""

    def __init__(self, facts, report: Callable[[str], None] = lambda line: None):
        from autotuner.tuning.models.memory_book import MemoryBook
        from autotuner.tuning.trials.ledger import TrialLedger

        self.ledger = TrialLedger()
        self.space = facts.space
        self.memory = MemoryBook(facts, self.ledger.results, report)

    def learn(self, result) -> None:
        self.ledger.record(result)
        self.memory.learn(result)

    def with_facts(self, **changes) -> None:
        from dataclasses import replace

        from autotuner.tuning.models.memory_book import MemoryBook

        self.memory = MemoryBook(replace(self.memory.facts, **changes), self.ledger.results, self.memory.report)


def book_over_ledger(config, settings: ExperimentSettings, profile, precision: str = "fp32",
                     budget_bytes: int = 2**30, device_type: str = "cpu", report=lambda line: None) -> BookOverLedger:
    """The orchestrator's memory book for `config` as settled (its space), on `profile`."""
    from autotuner.tuning.models.memory_book import memory_facts

    facts = memory_facts(config, settled(config, settings)["space"], profile, precision,
                         2**30 if device_type == "cuda" else None, 0, settings.nproc_per_node,
                         settings.base_config["zero_optimization"])
    from dataclasses import replace

    return BookOverLedger(replace(facts, budget_bytes=budget_bytes), report)


def profiled(answer):
    """Every trial gets `answer(trial)`; a profile trial (an experiment that also measures the
    model) gets a model info too."""
    def run(trial: Trial) -> TrialResult:
        result = answer(trial)
        if trial.profile and result.state is TrialState.OK:
            info = model_info(trial.experiment.micro_batch_size, trial.experiment.zero_stage,
                              activation_bytes=trial.experiment.micro_batch_size * MiB)
            return dataclasses.replace(result, model_info=info)
        return result
    return run


def by_micro(values: dict[int, float]):
    return profiled(lambda trial: ok(trial, values[trial.experiment.micro_batch_size], 200 * MiB))


# Full mode's values before the registry existed, written out: the registry must give exactly these.
BUCKETS = [1_000_000, 6_553_600, 50_000_000]
OUR_ENGINE_KNOBS = {
    0: {"reduce_bucket_size": BUCKETS, "contiguous_gradients": [False, True]},
    1: {"reduce_bucket_size": BUCKETS, "contiguous_gradients": [False, True]},
    2: {"overlap_comm": [False, True]},
    3: {"overlap_comm": [False, True], "stage3_param_persistence_threshold": [0, 100_000]},
}
