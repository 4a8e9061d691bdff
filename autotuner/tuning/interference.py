"""A window another process disturbed is measured again, not trusted.

The ranks record the largest share of a node's CPU time that processes other than our own took
during the profile window (runtime/window_load.py). Above INTERFERENCE_SHARE the window measured
the machine's other work as much as the configuration, so the tuner launches it once more and
keeps that measurement (with its own share on record if the machine is still busy).
"""

from __future__ import annotations

from autotuner.tuning.records import TrialResult, TrialState

# A quarter of the node's CPUs: on our 2-core machines, half a core of someone else's work.
INTERFERENCE_SHARE = 0.25


def interference_share(result: TrialResult) -> float | None:
    """The share other processes took during the window, when it is large enough to distrust."""
    measurement = result.measurement
    if result.state is not TrialState.OK or measurement is None or measurement.cpu_taken_by_others is None:
        return None
    share = measurement.cpu_taken_by_others
    return share if share >= INTERFERENCE_SHARE else None
