"""DeepSpeed features we do not carry, each refused with one line saying what to do instead."""

from __future__ import annotations

from autotuner.errors import UnsupportedError

REASONS = {
    "zero.Init": "ZeRO-3 here is torch FSDP2, which shards a model built the ordinary way; build the model "
                 "without zero.Init and set zero_optimization.stage to 3",
    "zero.GatheredParameters": "FSDP2 parameters are DTensors; read a full copy with param.full_tensor(), or "
                               "use stage 0-2 where each rank holds the full parameters",
    "moe": "mixture-of-experts layers (expert parallelism) are not supported; every rank is data parallel here",
    "pipe": "pipeline parallelism is not supported; every rank is data parallel here, so train the model with "
            "deepspeed.initialize at ZeRO stage 0-3 instead",
    "init_inference": "inference engines are not supported; autotuner tunes and runs training",
}


def refuse(feature: str) -> UnsupportedError:
    return UnsupportedError(f"deepspeed.{feature} is not supported by autotuner: {REASONS[feature]}")
