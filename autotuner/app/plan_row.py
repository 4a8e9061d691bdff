"""One row of a hardware plan's table (plan.csv): a candidate layout with its predicted memory
and step, whether it fits, and why not. Shared by the data-parallel and the pipeline plans."""

from __future__ import annotations

from typing import Any


def candidate_row(name: str, zero_stage: int, tp: int, pp: int, micro: int, gas: int, dp: int, policy: str,
                  memory: float, budget: int, step: Any, efficiency: float, heaviest: str = "",
                  **extra: Any) -> dict:
    """`step`: a StepPrediction (tuning/models/hardware_step.py); `heaviest`: what the memory is
    of where a layout's ranks differ (a pipeline's heaviest stage), said when it does not fit."""
    fits = memory <= budget
    return {"name": name, "zero_stage": zero_stage, "tp": tp, "pp": pp, **extra, "micro_batch_size": micro,
            "gradient_accumulation_steps": gas, "train_batch_size": micro * gas * dp,
            "activation_checkpointing": policy, "fits": fits, "predicted_memory_bytes": int(memory),
            "predicted_step_s": step.step_s, "predicted_samples_per_s": micro * gas * dp / step.step_s,
            "predicted_tokens_per_s_per_rank": step.tokens_per_s_per_rank,
            "predicted_mfu": step.model_flops_utilization, "compute_efficiency": efficiency,
            "left_out": "" if fits else (f"out of memory: {memory / 2**30:.1f} GiB a rank{heaviest} against "
                                         f"{budget / 2**30:.1f} usable"),
            "picked": False}
