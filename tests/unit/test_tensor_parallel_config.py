"""The tensor_parallel section as DeepSpeed 0.19.8 reads it, and the batch triad under it: counted
over every rank without an mpu (DeepSpeed's rule, TP replicas counted), over dp with one; a step
trains micro x gas x dp samples either way (issue 69)."""

from __future__ import annotations

import pytest

from autotuner.config import load_config
from autotuner.config.batch import resolve_split_batch
from autotuner.core.errors import ConfigError


def test_deepspeeds_section_loads_with_its_nesting_and_defaults():
    section = load_config({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}, "tp_overlap_comm": True}},
                          name="ds.json").tensor_parallel
    assert (section.autotp_size, section.size, section.tp.tp_size, section.tp.tp_grain_size) == (2, 2, 2, 1)
    # DeepSpeed's field is `tensor_parallel` with the alias `tp`: both spellings load.
    assert load_config({"tensor_parallel": {"tensor_parallel": {"tp_size": 2}}}).tensor_parallel.tp.tp_size == 2
    off = load_config({}).tensor_parallel
    assert (off.autotp_size, off.size) == (0, 1)  # DeepSpeed's default 0: no tensor parallelism
    assert load_config({"data_parallel_size": 2}).data_parallel_size == 2  # DeepSpeedExamples' AutoTP configs state it


def test_a_typo_inside_the_section_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key 'tensor_parallel.autotp_sise'; did you mean 'autotp_size'"):
        load_config({"tensor_parallel": {"autotp_sise": 2}}, name="ds.json")


@pytest.mark.parametrize("given, counts_every_rank, expected", [
    # train_batch_size 8 with micro 2 on 4 ranks at tp 2: DeepSpeed without an mpu divides by 4 ranks (gas 1),
    # with an mpu by dp 2 (gas 2).
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, True, (4, 2, 1, 2)),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, False, (8, 2, 2, 2)),
    # micro and gas given: both counts agree.
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, True, (12, 2, 3, 2)),
    # All three consistent over dp only (the tuner writes those): taken.
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, True,
     (8, 2, 2, 2)),
])
def test_the_triad_under_tensor_parallelism_counts_as_deepspeed_does(given, counts_every_rank, expected):
    batch, note = resolve_split_batch(load_config(given), world_size=4, tp_size=2, counts_every_rank=counts_every_rank)
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps,
            batch.data_parallel_size) == expected
    # The config's train_batch_size is said to differ from what a step trains only where it does.
    assert (note is not None) == (counts_every_rank and "gradient_accumulation_steps" not in given)
    if note:
        assert note.startswith("train_batch_size 8 counts all 4 ranks, as DeepSpeed does without an mpu")


def test_a_degree_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size: got 3; it must divide the world size \(4\)"):
        resolve_split_batch(load_config({"train_micro_batch_size_per_gpu": 2}), 4, 3, counts_every_rank=True)
