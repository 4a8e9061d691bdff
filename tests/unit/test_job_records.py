"""The tuning job is frozen: settled before any launch, then the profile's own record. The
orchestrator replaces neither after building it, and the ledger holds every trial by kind."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from autotuner.core.frozen import FrozenError
from autotuner.tuning.trials.ledger import TrialKind
from fakes import FakeRunner, by_micro, tuner

MiB = 2**20


def test_the_settled_and_profiled_jobs_are_frozen_and_not_replaced_after_they_are_built(tmp_path):
    autotuner = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), {"memory_per_rank_bytes": 3 * MiB})
    settled = autotuner.job
    # A snapshot (deep copies), not the objects themselves: a write into them would change both sides.
    before = copy.deepcopy((dataclasses.asdict(settled.policy), dataclasses.asdict(settled.settings),
                            dataclasses.asdict(settled.space)))
    autotuner.tune()
    assert autotuner.job is settled  # the settled job stays what it was
    assert (dataclasses.asdict(settled.policy), dataclasses.asdict(settled.settings),
            dataclasses.asdict(settled.space)) == before
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


def _writes(mapping):
    """Every way of writing into a config mapping, at its top and one level down."""
    nested = next((v for v in mapping.values() if isinstance(v, (dict, list))), None)
    yield lambda: mapping.__setitem__("written", 1)
    yield lambda: mapping.update(written=1)
    yield lambda: mapping.setdefault("written", 1)
    yield lambda: mapping.pop(next(iter(mapping)))
    yield mapping.clear
    if isinstance(nested, dict):
        yield lambda: nested.__setitem__("written", 1)
    elif isinstance(nested, list):
        yield lambda: nested.append(1)


def test_writing_into_any_records_mapping_after_it_is_built_raises(tmp_path):
    autotuner = tuner(tmp_path, FakeRunner(by_micro({2: 10.0, 4: 20.0})), {"memory_per_rank_bytes": 3 * MiB},
                      zero_optimization={"stage": [0, 1]})
    autotuner.tune()
    settings = autotuner.profiled.job.settings
    space = autotuner.profiled.job.space
    mappings = {"base_config": settings.base_config, "user_config": settings.user_config,
                "arg_mappings": settings.arg_mappings,
                "knob_values": space.knob_values, "variants": space.variants, "finishes": space.finishes}
    writable = {}
    for name, mapping in mappings.items():
        if not mapping:
            continue  # empty here: nothing to write into (its freezing is the same code)
        before = copy.deepcopy(mapping)
        for write in _writes(mapping):
            try:
                write()
            except FrozenError:
                continue
            writable[name] = write
        assert mapping == before  # nothing was written
        # What a caller changes is a copy, writable, and the record is as it was.
        changed = copy.deepcopy(mapping)
        changed["written"] = 1
        assert "written" not in mapping
    assert not writable, f"written into after it was built: {sorted(writable)}"
    assert settings.base_config and space.knob_values  # (the ones this tune holds something in)
    # The ledger's records are frozen and append-only from outside.
    record = autotuner.ledger.records[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.kind = TrialKind.SEARCH
    assert isinstance(autotuner.ledger.records, tuple)


def test_the_config_a_job_holds_is_read_only_at_every_depth():
    # The DeepSpeed config is a frozen pydantic model; the dicts and lists its sections hold are frozen too.
    from autotuner.config import load_config

    config = load_config({"train_micro_batch_size_per_gpu": [2, 4],
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
                          "compile": {"kwargs": {"mode": "default"}},
                          "autotuning": {"enabled": True, "arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"}}})
    writes = {
        "optimizer.params": lambda: config.optimizer.params.__setitem__("lr", 1.0),
        "optimizer.params.betas": lambda: config.optimizer.params["betas"].append(0.5),
        "compile.kwargs": lambda: config.compile.kwargs.update(mode="max-autotune"),
        "autotuning.arg_mappings": lambda: config.autotuning.arg_mappings.pop("train_micro_batch_size_per_gpu"),
        "train_micro_batch_size_per_gpu": lambda: config.train_micro_batch_size_per_gpu.append(8),
    }
    for name, write in writes.items():
        with pytest.raises(FrozenError):
            write()
    with pytest.raises(Exception, match="frozen"):
        config.optimizer.type = "Adam"  # pydantic's own refusal
    assert config.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.99]} and config.train_micro_batch_size_per_gpu == [2, 4]
    # What a caller changes is a dump or a copy, writable, and the config is as it was.
    dumped = config.model_dump()
    dumped["optimizer"]["params"]["betas"].append(0.5)
    assert config.optimizer.params["betas"] == [0.9, 0.99]


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


def test_the_runners_placement_goes_into_the_job_as_it_is_built_and_nothing_is_laid_over_it(tmp_path, monkeypatch):
    # settle() reads a typed request (no argparse Namespace); the job the tuner runs is built once,
    # from the settled request and where the runner places the experiments.
    import json

    from autotuner.app.cli import build_parser
    from autotuner.app.request import TuneRequest
    from autotuner.app.settle import settle, tuning_job
    from autotuner.tuning.trials.journal import this_device
    from autotuner.tuning.trials.runner import Placement

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("import autotuner\n")
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                                  "autotuning": {"enabled": True}}))
    args = build_parser().parse_args(["--autotuning", "tune", "--nproc_per_node", "2", "train.py",
                                      "--deepspeed", "ds.json"])
    args.nproc_per_node = 2  # as cli.main settles it
    request = TuneRequest.of(args)
    assert request.mode == "tune" and request.script == "train.py" and request.backend.backend == "local"
    settled = settle(request)
    here = tuning_job(settled, Placement())
    assert here.fingerprint.device == this_device() and here.placement == Placement()
    cluster = Placement("slurm: 2 x node (cpu)", ("--launcher", "slurm", "--num_nodes", "2"))
    there = tuning_job(settled, cluster)
    assert there.fingerprint.device == "slurm: 2 x node (cpu)" and there.placement is cluster
    # The settings are the settled ones, not copies with fields laid over them; only the device differs.
    assert there.settings is settled.settings and here.settings is settled.settings
    assert dataclasses.replace(there.fingerprint, device=here.fingerprint.device) == here.fingerprint
    with pytest.raises(dataclasses.FrozenInstanceError):
        there.placement = Placement()
    # The orchestrator takes the job as built: it derives no policy or job of its own.
    from autotuner.tuning.orchestrator import Autotuner
    from fakes import FakeRunner, by_micro

    tuner_over = Autotuner(there, tmp_path / "results", tmp_path / "exps", FakeRunner(by_micro({2: 1.0})))
    assert tuner_over.job is there
