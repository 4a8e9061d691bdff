"""Every stop path under randomized timing: 5 faults at random instants (tests/fault_fuzz.py), every
launcher mode and all but one fault among them (the benchmark runs every pair; each CI run draws a new
seed, so the fault left out changes).

The seed is new each run unless AUTOTUNER_FAULT_FUZZ_SEED is set; it is part of every case's
test id, so a failure replays with
    AUTOTUNER_FAULT_FUZZ_SEED=S pytest tests/integration/test_fault_fuzz.py -k caseNN
or  python benchmarks/fault_fuzz.py --seed S --only NN
The benchmark script runs hundreds (its note in docs/ gives the counts).
"""

from __future__ import annotations

import os
import random

import pytest

from fault_fuzz import FAULTS, SCENARIOS, draw_cases, run_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SEED = int(os.environ.get("AUTOTUNER_FAULT_FUZZ_SEED") or random.SystemRandom().randrange(1, 10**6))
COUNT = 5  # every one of the 5 scenarios, and 5 of the 6 faults (which one waits rotates with the seed)
# Each scenario's clean run length on a 2-core machine (benchmarks/fault_fuzz.py measures them);
# instants are drawn uniformly up to a little past it.
NOMINAL_LENGTH_S = {"tune": 9.0, "tune_cold": 20.0, "plain": 7.0, "hostfile": 9.5, "run": 10.0}
CASES = draw_cases(SEED, COUNT, NOMINAL_LENGTH_S, SCENARIOS, FAULTS)


@pytest.mark.parametrize("case", CASES, ids=[f"seed{SEED}-case{c.index:02d}-{c.scenario}-{c.fault}-{c.delay_s:.2f}s"
                                             for c in CASES])
def test_a_fault_at_a_random_instant_leaves_nothing_behind(case, tmp_path):
    outcome = run_case(case, tmp_path / "run", NOMINAL_LENGTH_S[case.scenario])
    assert outcome.ok, f"{case.describe(SEED)}: " + " | ".join(outcome.problems)
