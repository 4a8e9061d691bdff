"""The tuning job is frozen: settled before any launch, then the profile's own record. The
orchestrator replaces neither after building it, and the ledger holds every trial by kind."""

from __future__ import annotations

import dataclasses

import pytest

from autotuner.tuning.trials.ledger import TrialKind
from fakes import FakeRunner, by_micro, tuner

MiB = 2**20


def test_the_settled_and_profiled_jobs_are_frozen_and_not_replaced_after_they_are_built(tmp_path):
    autotuner = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), {"memory_per_rank_bytes": 3 * MiB})
    settled = autotuner.job
    settled_fields = dataclasses.asdict(settled.policy), settled.settings, settled.space
    autotuner.tune()
    assert autotuner.job is settled  # the settled job stays what it was
    assert (dataclasses.asdict(settled.policy), settled.settings, settled.space) == settled_fields
    profiled = autotuner.profiled
    for record, name in ((settled, "space"), (profiled, "job"), (profiled, "memory"), (profiled.job, "settings"),
                         (profiled.memory, "budget_bytes"), (profiled.memory, "profile")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, name, None)
    # The memory book reads its facts from the profiled job and holds no settable copy of them.
    assert autotuner.memory.facts is profiled.memory
    for name in ("space", "profile", "budget_bytes", "device_type", "precision", "engine"):
        with pytest.raises(AttributeError):
            setattr(autotuner.memory, name, None)


def test_the_ledger_holds_the_profile_launches_the_search_and_what_was_pruned_by_kind(tmp_path):
    # A budget of 3 MiB: the memory model prunes what the profile shows cannot fit.
    autotuner = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), {"memory_per_rank_bytes": 3 * MiB},
                      zero_optimization={"stage": "all"})
    outcome = autotuner.tune()
    ledger = autotuner.ledger
    profile = ledger.of_kind(TrialKind.PROFILE)
    search = ledger.of_kind(TrialKind.SEARCH)
    assert profile and set(profile) | set(search) == set(ledger.results()) and not set(profile) & set(search)
    assert ledger.pruned() and all(r.state.value == "pruned" and r.error for r in ledger.pruned())
    # What the outcome reports is the ledger's, every kind: nothing kept elsewhere.
    assert set(outcome.results) == set(ledger.results()) | set(ledger.pruned())
