"""Our engine's side of a measurement launch: the tuner's request, and the view of the engine the
shared protocol (rank_measurement.py) reads."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from autotuner.core.boundary import MeasurementRequest, request_from_env
from autotuner.config.models import DeepSpeedConfig
from autotuner.runtime.measure.memory_probes import optimizer_state_bytes
from autotuner.runtime.measure.profile import SplitRegions
from autotuner.runtime.training.sharding import shard_units, unwrap


def measurement_request(config: DeepSpeedConfig) -> MeasurementRequest | None:
    """What this launch must measure: the tuner's request (a file the launcher named), else
    DeepSpeed's own keys in the user's autotuning section (metric_path, model_info_path)."""
    request = request_from_env()
    if request is not None:
        return request
    tuning = config.autotuning
    if not tuning.enabled or (tuning.metric_path is None and tuning.model_info_path is None):
        return None
    return MeasurementRequest(tuning.start_profile_step, tuning.end_profile_step, tuning.metric_path,
                              tuning.model_info_path, bool(tuning.model_info and tuning.model_info.profile),
                              tuning.metric_path)


PIPELINE_STAGES_KEY = "pipeline.stages"
STAGES_PER_RANK_KEY = "pipeline.stages_per_rank"

# Read from the Measurement's own fields (stage, micro-batch, gas), not from `built`.
TRIAD_KEYS = ("zero_optimization.stage", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def values_at(config: dict[str, Any], keys: list[str]) -> tuple[tuple[str, Any], ...]:
    """(key, value) for each dotted key in a DeepSpeed config dict; None where it is not set."""
    found = []
    for key in keys:
        if key in TRIAD_KEYS:
            continue
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        found.append((key, node))
    return tuple(found)


class BatchView:
    """What both of our engines' views read alike: the batch triad the engine settled (`batch`)."""

    _engine: Any

    @property
    def micro_batch_size(self) -> int:
        return self._engine.batch.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._engine.batch.gradient_accumulation_steps

    @property
    def train_batch_size(self) -> int:
        return self._engine.batch.train_batch_size


class OurEngineView(BatchView):
    """The protocol's view of our Engine (runtime/engine.py)."""

    name = "autotuner"

    def __init__(self, engine: Any):
        self._engine = engine

    @property
    def device(self) -> torch.device:
        return self._engine.ctx.device

    @property
    def rank(self) -> int:
        return self._engine.ctx.rank

    @property
    def world_size(self) -> int:
        return self._engine.ctx.world_size

    @property
    def zero_stage(self) -> int:
        return self._engine.zero_stage

    @property
    def precision(self) -> str:
        return self._engine.precision

    @property
    def engines_in_process(self) -> int:
        return self._engine.created_in_process

    def model(self) -> nn.Module:
        return self._engine.wrapped

    @property
    def tuned_over_script(self) -> tuple[str, ...]:
        return self._engine.tuned_over_script

    def built_values(self, keys: list[str]) -> tuple[tuple[str, Any], ...]:
        """The config the engine trains with (after settling), at the tuned keys; pipeline stages 0:
        this engine is no pipeline, whatever the config says (a script that took the mapped flag
        and built a plain model did not train the experiment's pipeline)."""
        return tuple((key, 0 if key == PIPELINE_STAGES_KEY else value)
                     for key, value in values_at(self._engine.config.dump(by_alias=True), keys))

    def parameter_counts(self) -> None:
        return None  # the wrapped module's tensors (FSDP2's DTensors included) count themselves

    def num_shard_units(self) -> int:
        return len(shard_units(self._engine.wrapped, 0))

    def optimizer_state_bytes(self) -> int:
        return optimizer_state_bytes(self._engine._local_optimizer)

    def tensor_parallel(self) -> tuple[int, int, int]:
        """(the degree, the parameters its plan split counted whole, the trainable elements this rank
        holds): under tensor parallelism a rank's optimizer state covers its local shards only."""
        split = self._engine._split
        if split is None:
            return 1, 0, 0
        named = list(unwrap(self._engine.wrapped).named_parameters())
        split_count = sum(param.numel() for name, param in named if name in split.split_parameters)
        local = sum((param.to_local() if hasattr(param, "to_local") else param).numel()
                    for _, param in named if param.requires_grad)
        return self._engine.layout.tp_size, split_count, local

    def activation_bytes(self) -> int:
        return self._engine._activation_probe.bytes_saved

    def splittable(self) -> SplitRegions:
        probe = self._engine._activation_probe
        return probe.split_regions() if probe is not None else SplitRegions()

    def activation_bytes_by_policy(self) -> dict[str, int]:
        return self._engine._activation_probe.bytes_by_policy()

    def sequence_length(self) -> int:
        return self._engine._activation_probe.sequence_length

    def gradient_noise(self):
        """The gradient noise probe's figures (ZeRO 0/1 with two ranks or more), else None."""
        return self._engine._noise

    def flops_per_micro_step(self) -> int | None:
        probe = self._engine._flop_probe
        return probe.total if probe is not None else None

    def pipeline_position(self) -> None:
        return None
