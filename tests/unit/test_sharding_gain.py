"""Leaving the sharded engine out when it cannot win (autotuner/tuning/models/sharding_gain.py), and the
orchestrator skipping its profile launch and its search. No processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from autotuner.core.boundary import Measurement
from autotuner.core.probe_records import CollectiveTiming
from autotuner.config import load_config
from autotuner.tuning.orchestrator import Autotuner
from autotuner.tuning.models.comm_fit import LinkFit
from autotuner.tuning.models.cost_model import CostContext
from autotuner.tuning.trials.trial import Trial
from autotuner.tuning.space.records import TrialResult, TrialState
from autotuner.tuning.models.sharding_gain import sharding_cannot_win
from fakes import FakeRunner, model_info, orchestrator

MiB = 2**20
LINKS = (LinkFit("all_reduce", 1e-4, 1e9), LinkFit("all_gather", 1e-4, 1e9), LinkFit("reduce_scatter", 1e-4, 1e9))


def test_sharding_is_left_out_only_when_everything_fits_unsharded_and_its_collectives_save_nothing():
    fp32 = CostContext(num_params=10_000_000, world_size=2, compute_bytes=4, links=LINKS)
    assert sharding_cannot_win((0, 1, 2, 3), True, fp32, step_time_s=0.5, noise=0.03).startswith("cost model")
    assert sharding_cannot_win((0, 1, 2, 3), False, fp32, 0.5, 0.03) is None  # memory: sharding may allow more
    assert sharding_cannot_win((0, 2, 3), True, fp32, 0.5, 0.03) is None  # no ZeRO 1: FSDP2's sharded step may win
    assert sharding_cannot_win((0, 1), True, fp32, 0.5, 0.03) is None  # nothing sharded to leave out
    assert sharding_cannot_win((0, 1, 2), True, CostContext(10_000_000, 2, 4, ()), 0.5, 0.03) is None  # no links
    # bf16: FSDP2 gathers half of ZeRO 1's bytes; 40 MB at 1 GB/s is 20 ms saved: beyond 3% of a
    # 0.5 s step it may win, within 3% of a 1 s step it cannot.
    bf16 = dataclasses.replace(fp32, compute_bytes=2)
    assert sharding_cannot_win((0, 1, 2, 3), True, bf16, 0.5, 0.03) is None
    assert sharding_cannot_win((0, 1, 2, 3), True, bf16, 1.0, 0.03) is not None


def test_on_deepspeeds_engine_its_own_zero_collectives_are_costed_and_named():
    # DeepSpeed's ZeRO 2 reduce-scatters where its ZeRO 1 all-reduces, and both gather the same
    # compute copy: with a reduce-scatter at half an all-reduce's cost, 40 MB of fp32 gradients at
    # 1 GB/s saves 20 ms, which may win on a 0.5 s step (FSDP2's rule would prune it: ZeRO 1's fp32
    # gather against its own reduce-scatter and gather).
    links = (LinkFit("all_reduce", 1e-4, 1e9), LinkFit("all_gather", 1e-4, 1e9), LinkFit("reduce_scatter", 1e-4, 2e9))
    ours = CostContext(num_params=10_000_000, world_size=2, compute_bytes=4, links=links)
    theirs = dataclasses.replace(ours, engine="deepspeed")
    assert theirs.communication_s(1, 1) - theirs.communication_s(2, 1) > 0.019
    assert sharding_cannot_win((0, 1, 2, 3), True, theirs, 0.5, 0.03) is None
    # On gloo (no reduce-scatter: costed as the all-reduce) it saves nothing, and says whose ZeRO 2 it costed.
    gloo = dataclasses.replace(theirs, links=LINKS[:2])
    reason = sharding_cannot_win((0, 1, 2, 3), True, gloo, 0.5, 0.03)
    assert reason is not None and "DeepSpeed's ZeRO 2 saves 0.0 ms" in reason and "FSDP2" not in reason
    assert "FSDP2 saves" in sharding_cannot_win((0, 1, 2, 3), True, dataclasses.replace(gloo, engine="autotuner"),
                                                0.5, 0.03)


def probed(trial: Trial) -> TrialResult:
    """5 samples/s per sample of the micro-batch, FSDP2 20% slower; a profile launch also carries a collective probe (1 GB/s)."""
    micro = trial.experiment.micro_batch_size
    value = 5.0 * micro * (1.0 if trial.experiment.zero_stage < 2 else 0.8)
    measurement = Measurement(throughput=value, latency=2 * micro / value, peak_memory_bytes=200 * MiB)
    result = TrialResult(trial.experiment, TrialState.OK, value=value, measurement=measurement,
                         measured_memory_bytes=200 * MiB, wall_time_s=1.0)
    if not trial.profile:
        return result
    timings = tuple(CollectiveTiming(op, size, 1e-4 + size / 1e9) for op in ("all_reduce", "all_gather")
                    for size in (2**20, 2**24))
    info = model_info(micro, trial.experiment.zero_stage, activation_bytes=micro * MiB, collective_timings=timings,
                      num_params=10_000_000)
    return dataclasses.replace(result, model_info=info)


def autotuner(tmp_path: Path, runner: FakeRunner, budget: int, lines: list) -> Autotuner:
    config = load_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "all"},
                          "autotuning": {"enabled": True, "memory_per_rank_bytes": budget, "fast": True,
                                         "max_train_micro_batch_size_per_gpu": 4, "tuner_type": "gridsearch"}})
    return orchestrator(tmp_path, config, runner, report=lines.append)


def test_with_room_to_spare_the_sharded_engine_is_neither_profiled_nor_searched(tmp_path):
    runner, lines = FakeRunner(probed), []
    outcome = autotuner(tmp_path, runner, 4 * 2**30, lines).tune()
    assert not any(name.startswith(("z2", "z3")) for name in runner.names)
    assert "ZeRO 2: pruned, not launched (cost model: every micro-batch fits unsharded" in "\n".join(lines)
    assert "ZeRO 3: pruned, not launched (cost model:" in "\n".join(lines)
    assert outcome.best.experiment.zero_stage < 2


def test_when_memory_is_tight_the_sharded_engine_is_still_profiled(tmp_path):
    # 10M fp32 parameters with Adam: 160 MB of state per rank unsharded; 150 MiB leaves no room
    # at ZeRO 0/1 for the largest size, so sharding may be what lets it run.
    runner, lines = FakeRunner(probed), []
    autotuner(tmp_path, runner, 150 * MiB, lines).tune()
    assert any("(sharded engine)" in line for line in lines)
    assert not any("cost model:" in line for line in lines)
