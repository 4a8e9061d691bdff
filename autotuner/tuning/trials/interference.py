"""A window another process disturbed is measured again, not trusted.

The ranks record the largest share of a node's CPU time that processes other than our own took
during the profile window (runtime/measure/window_load.py). Above INTERFERENCE_SHARE the window measured
the machine's other work as much as the configuration, so a launch run on its own (evaluator.py
`RunnerLaunches.run`) is launched once more: the disturbed launch stays on record (and its files
in <name>_disturbed), and the repeat's measurement counts (with its own share on record if the
machine is still busy). A launch submitted to a runner's slots (`capacity` above 1)
is not: its result is kept as it arrives, and the final pick's interleaved re-measurement (one
launch at a time) compares the contenders.
"""

from __future__ import annotations

from autotuner.tuning.space.records import TrialResult, TrialState

# A quarter of the node's CPUs: on our 2-core machines, half a core of someone else's work.
INTERFERENCE_SHARE = 0.25


def interference_share(result: TrialResult) -> float | None:
    """The share other processes took during the window, when it is large enough to distrust."""
    measurement = result.measurement
    if result.state is not TrialState.OK or measurement is None or measurement.cpu_taken_by_others is None:
        return None
    share = measurement.cpu_taken_by_others
    return share if share >= INTERFERENCE_SHARE else None
