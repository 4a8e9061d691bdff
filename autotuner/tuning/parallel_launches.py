"""The orchestrator's evaluate with the parallel side a runner with `capacity` above 1 offers
(tuners/base.py `drive_parallel`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from autotuner.tuning.records import TrialResult
from autotuner.tuning.space import Experiment

if TYPE_CHECKING:
    from autotuner.tuning.autotuner import Autotuner


class ParallelLaunches:
    """The orchestrator's evaluate, with the parallel side a runner with `capacity` above 1 offers
    (tuners/base.py `drive_parallel`): results are recorded and journalled as they finish."""

    def __init__(self, tuner: "Autotuner"):
        self._tuner = tuner
        self.capacity = max(1, int(tuner.runner.capacity))
        self._ready: deque[TrialResult] = deque()

    def __call__(self, experiment: Experiment) -> TrialResult:
        return self._tuner._evaluate(experiment)

    def submit(self, experiment: Experiment) -> None:
        tuner = self._tuner
        known = tuner._results.get(experiment) or tuner._journal.get(experiment.name)
        if known is not None:
            if experiment not in tuner._results:
                tuner._record(known, True)
            self._ready.append(known)
            return
        tuner.runner.submit(tuner._trial(experiment))
        tuner._launched += 1

    def next_result(self) -> TrialResult:
        if self._ready:
            return self._ready.popleft()
        tuner = self._tuner
        trial, result = tuner.runner.next_result()
        tuner._journal_result(trial, result)
        tuner._record(result, False)
        return result
