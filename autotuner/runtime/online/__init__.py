"""Online tuning of communication knobs inside a training job (Horovod's and Bagua's autotune)."""

from __future__ import annotations

import os
from typing import Any

from autotuner.core.boundary import ONLINE_ENV
from autotuner.runtime.online.knobs import KnobPlan, plan_knobs


def online_enabled(config: Any) -> bool:
    """The config switch, or `launcher --autotuning online` (which sets ONLINE_ENV for the ranks)."""
    return bool(config.autotuning.online.enabled or os.environ.get(ONLINE_ENV) == "1")


def start_online(engine: Any, shard_units: int):
    """At engine creation, on every rank together: the fixed knobs applied, and an OnlineTuning
    when tuning is on (None otherwise). A tuner's measurement launch never tunes online."""
    config = engine.config
    online = config.autotuning.online
    tuning = online_enabled(config) and engine._request is None
    if not tuning and not online.knobs:
        return None
    if engine.layout.tensor_parallel:
        from autotuner.core.errors import UnsupportedError

        raise UnsupportedError("autotuning.online: communication knobs are not tuned under tensor_parallel yet (at "
                               "stage 0 no DDP reduces there); turn online tuning off, or use autotp_size 1")
    plan: KnobPlan = plan_knobs(stage=engine.zero_stage, zero=config.zero_optimization, online=online,
                                world_size=engine.ctx.world_size,
                                gradient_accumulation_steps=engine.batch.gradient_accumulation_steps,
                                shard_units=shard_units)
    if not tuning:
        if plan.fixed:
            engine.apply_knobs(plan.fixed_values())
        return None
    from autotuner.runtime.online.coordinator import OnlineTuning
    from autotuner.runtime.online.log import paths_for

    paths = paths_for(config.autotuning.results_dir, online.log_file, online.best_knobs_file)
    return OnlineTuning(plan, online, rank=engine.ctx.rank, world_size=engine.ctx.world_size, device=engine.ctx.device,
                        global_batch=engine.batch.train_batch_size, zero_stage=engine.zero_stage, paths=paths,
                        target=engine)
