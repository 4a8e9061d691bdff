"""First fit: the space in the order it was given (grid's), stopping at the first experiment that
runs OK. Its stopping is its own stop rule (stopping.py), asked by the driver like the driver's own."""

from autotuner.tuning.space.experiment import Experiment
from autotuner.tuning.space.records import TrialState
from autotuner.tuning.tuners.base import Tuner
from autotuner.tuning.tuners.stopping import DriveProgress


class FirstFitTuner(Tuner):
    def _choose(self, untried: list[Experiment]) -> Experiment:
        return untried[0]

    def should_stop(self, progress: DriveProgress) -> bool:
        # Everything it was told counts, a result told before the drive too (a stage's
        # confirmation of its largest micro-batch): that experiment already fits.
        return any(result.state is TrialState.OK for result in progress.told.values())
