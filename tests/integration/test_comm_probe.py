"""The collective probe of a profile launch: its record in ModelInfo, and real 2-rank gloo
profile launches whose model_info.json carries the timings of the job's own process group: the
tuner's (which goes on to time its window, so the probe runs after it) and DeepSpeed's
model_info.profile (whose ranks leave after the model info, so the probe runs before)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from autotuner.core.boundary import ModelInfo, RecordError, read_record
from autotuner.core.probe_records import CollectiveTiming
from autotuner.runtime.measure.comm_probe import probe_collectives
from autotuner.tuning.models.comm_fit import fit_collectives

from autotuner.config import read_config_file

from conftest import CONFIGS, MINIMAL, run_launcher
from fakes import model_info

TIMINGS = (CollectiveTiming("all_reduce", 2**16, 2e-4), CollectiveTiming("all_gather", 2**20, 1e-3),
           CollectiveTiming("all_reduce", 2**12, 1e-4, group_size=2))


def test_model_info_round_trips_its_collective_timings_and_backend(tmp_path):
    info = model_info(backend="gloo", collective_timings=TIMINGS)
    path = tmp_path / "model_info.json"
    path.write_text(json.dumps(info.to_json()))
    assert read_record(path, ModelInfo) == info
    assert json.loads(path.read_text())["collective_timings"][1] == {"op": "all_gather", "bytes": 2**20,
                                                                     "seconds": 1e-3, "group_size": 0}
    # A subgroup's timings fit apart from the whole group's.
    assert set(fit_collectives(TIMINGS)) == {"all_reduce", "all_gather"}
    assert fit_collectives(TIMINGS, group_size=2)["all_reduce"].seconds(2**12) == pytest.approx(1e-4)


def test_a_model_info_file_from_before_the_probe_still_reads(tmp_path):
    data = model_info().to_json()
    del data["collective_timings"], data["backend"]
    path = tmp_path / "model_info.json"
    path.write_text(json.dumps(data))
    info = read_record(path, ModelInfo)
    assert info.collective_timings == () and info.backend is None


@pytest.mark.parametrize("timing, message", [({"op": "all_reduce", "bytes": 65536, "seconds": 0},
                                               "seconds must be finite and > 0"),
                                              ({"op": "all_reduce", "bytes": 65536}, "without 'seconds'")])
def test_a_damaged_collective_timing_makes_the_file_a_record_error(tmp_path, timing, message):
    data = model_info().to_json()
    data["collective_timings"] = [timing]
    path = tmp_path / "model_info.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=f"model_info.json: model info record: .*{message}"):
        read_record(path, ModelInfo)


def test_one_rank_has_no_collectives_to_time():
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert probe_collectives(torch.device("cpu")) == ()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_rank_profile_launch_records_the_collectives_of_its_process_group(tmp_path, no_orphans):
    from autotuner.config import load_config
    from autotuner.tuning.space.config_space import base_config
    from autotuner.tuning.trials.trial import ExperimentSettings, Trial
    from autotuner.tuning.space.records import Objective, TrialState
    from autotuner.execution.cold import ColdRunner
    from autotuner.tuning.space.experiment import Experiment

    config = load_config({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {}}})
    settings = ExperimentSettings(script=str(MINIMAL), script_args=("--deepspeed", "unused.json", "--width", "64"),
                                  base_config=base_config(config), nproc_per_node=2, data_parallel_size=2,
                                  objective=Objective("throughput"), timeout_s=240,
                                  arg_mappings={"train_micro_batch_size_per_gpu": "--micro_batch_size"})
    result = ColdRunner().run(Trial(Experiment(0, 4), tmp_path / "profile", settings, profile=True))
    assert result.state is TrialState.OK, result.error
    info = result.model_info
    assert info.backend == "gloo" and info.world_size == 2
    assert_timings_of_two_ranks(info)

    fits = fit_collectives(info.collective_timings)
    for op in ("all_reduce", "all_gather"):
        assert fits[op].bytes_per_s > 0 and fits[op].latency_s >= 0
        print(f"{op}: latency {fits[op].latency_s * 1e6:.0f} us, {fits[op].bytes_per_s / 2**30:.2f} GiB/s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_deepspeed_profile_run_that_leaves_after_the_model_info_records_them_too(tmp_path, no_orphans):
    info_path = tmp_path / "model_info.json"
    config = read_config_file(CONFIGS / "zero2.json")
    config["autotuning"] = {"enabled": True, "model_info_path": str(info_path), "model_info": {"profile": True}}
    config_file = tmp_path / "ds.json"
    config_file.write_text(json.dumps(config))
    result = run_launcher("--nproc_per_node", "2", MINIMAL, "--deepspeed", config_file, "--width", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    info = read_record(info_path, ModelInfo)
    assert info.zero_stage == 2 and info.backend == "gloo"
    assert_timings_of_two_ranks(info)


def assert_timings_of_two_ranks(info: ModelInfo) -> None:
    by_op: dict[str, dict[int, float]] = {}
    for timing in info.collective_timings:
        by_op.setdefault(timing.op, {})[timing.bytes] = timing.seconds
    assert set(by_op) == {"all_reduce", "reduce_scatter", "all_gather"}  # gloo runs all three on CPU
    for op, seconds_by_size in by_op.items():
        sizes = sorted(seconds_by_size)
        assert len(sizes) >= 3, op
        assert all(size % (2 * 4) == 0 for size in sizes)  # whole fp32 shards on 2 ranks
        assert all(seconds > 0 for seconds in seconds_by_size.values())
        # 256x the bytes: a loaded 2-core machine may be noisy, but not that much faster.
        assert seconds_by_size[sizes[-1]] > seconds_by_size[sizes[0]] / 3, (op, seconds_by_size)
