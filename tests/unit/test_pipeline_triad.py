"""The launch's check of a fixed batch triad beside a pipeline: counted as DeepSpeed's pipeline
engine counts it, over world / (stages x tp), before anything launches."""

from __future__ import annotations

import pytest

from autotuner.config import load_config
from autotuner.config.batch import check_fixed_triad
from autotuner.core.errors import ConfigError

TRIAD = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}


def test_the_configs_stages_divide_the_ranks_the_triad_counts():
    check_fixed_triad(load_config({**TRIAD, "pipeline": {"stages": 2}}), 4, "ds.json")  # 4 x 4 x dp 2
    check_fixed_triad(load_config({**TRIAD, "pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2}}),
                      8, "ds.json")  # dp = 8 / (2 x 2)
    with pytest.raises(ConfigError, match=r"^ds\.json: batch triad is inconsistent: .*data-parallel world size \(1\)"):
        check_fixed_triad(load_config({**TRIAD, "pipeline": {"stages": 4}}), 4, "ds.json")
    with pytest.raises(ConfigError, match=r"^ds\.json: pipeline\.stages 3: must divide the number of ranks \(4\)$"):
        check_fixed_triad(load_config({**TRIAD, "pipeline": {"stages": 3}}), 4, "ds.json")


def test_stages_left_to_the_script_take_any_count_that_divides_the_ranks_and_nothing_else():
    config = load_config(TRIAD)  # stages "auto": the script's PipelineModule decides
    check_fixed_triad(config, 4, "ds.json", stages_from_script=True)  # 2 stages would make it agree
    with pytest.raises(ConfigError, match="batch triad is inconsistent"):
        check_fixed_triad(config, 4, "ds.json")  # no PipelineModule: counted over every rank
    with pytest.raises(ConfigError, match="batch triad is inconsistent"):
        check_fixed_triad(load_config({**TRIAD, "train_batch_size": 48}), 4, "ds.json", stages_from_script=True)
