"""Whether the sharded engine (FSDP2, ZeRO 2 and 3) could win at all, before it is launched. Pure.

Sharding buys memory. Its one speed gain, the optimizer step on 1/N of the parameters, ZeRO 1
(DDP + ZeroRedundancyOptimizer) has too, without FSDP2's per-step gathers. So when every
micro-batch of the space fits unsharded, FSDP2 can beat ZeRO 1 only where its collectives cost
less than ZeRO 1's (a bf16 gather moves half the bytes of ZeRO 1's fp32 one); by the links the
profile's collective probe timed, that gain is costed, and below the noise it is not worth a
launch. On DeepSpeed's engine the same question is put to its own ZeRO optimizers' collectives
(cost_model.communication_s: its ZeRO 2 reduce-scatters where its ZeRO 1 all-reduces). Overlap
of gathers with compute is not costed: a GPU job whose communication is large against its step
should leave the probe's verdict to a launch (it is shown in the summary).
"""

from __future__ import annotations

from autotuner.core.engine_kind import Engine
from autotuner.tuning.models.cost_model import CostContext

REASON_PREFIX = "cost model"


def sharding_cannot_win(stages: tuple[int, ...], every_size_fits_unsharded: bool, context: CostContext,
                        step_time_s: float, noise: float) -> str | None:
    """Why ZeRO 2 and 3 need neither a profile launch nor a place in the search, or None when
    they might win. `step_time_s`: the fastest step the profile measured (the smallest step makes
    a costed gain look largest); `noise`: the relative noise level of a measurement."""
    if not any(stage >= 2 for stage in stages) or 1 not in stages or not every_size_fits_unsharded:
        return None
    if context.world_size > 1 and (context.link("all_gather") is None or context.link("all_reduce") is None):
        return None  # nothing to cost the gathers with
    gain_s = context.communication_s(1, 1) - context.communication_s(2, 1)
    if gain_s > noise * step_time_s:
        return None
    sharded = "DeepSpeed's ZeRO 2 saves" if context.engine == Engine.DEEPSPEED else "FSDP2 saves"
    return (f"{REASON_PREFIX}: every micro-batch fits unsharded, and by the collective probe {sharded} "
            f"{max(gain_s, 0.0) * 1e3:.1f} ms of a {step_time_s * 1e3:.0f} ms step over ZeRO 1, under the "
            f"{noise:.0%} noise: sharding cannot be faster")
