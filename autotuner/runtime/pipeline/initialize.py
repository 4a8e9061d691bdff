"""`initialize(model=PipelineModule(...))`: the pipeline engine, as DeepSpeed builds it.

What a pipeline trains with here: ZeRO 0 (each stage's gradients averaged over its data-parallel
group) or ZeRO 1 (torch's ZeroRedundancyOptimizer over that group), fp32, the config's optimizer
and scheduler (or the script's), gradient clipping over the whole pipeline's norm. What would
train otherwise is refused in one line (ConfigError/UnsupportedError, exit status 2): ZeRO 2 and 3
(DeepSpeed refuses them with pipelines too), fp16 and bf16, tensor parallelism inside a stage,
torch.compile, activation_checkpointing's policy (a pipeline checkpoints by
activation_checkpoint_interval), the gradient-reduction keys, a batch ramp, and a tuner's
measured launch (tuning pipelines is not carried yet)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from autotuner.config.batch import resolve_batch
from autotuner.config.models import DeepSpeedConfig
from autotuner.config.sections import refuse_unsettled
from autotuner.core.errors import ConfigError, UnsupportedError
from autotuner.runtime.distributed import init_distributed, warn_once
from autotuner.runtime.measure.measurement import measurement_request
from autotuner.core.repeating_loader import RepeatingLoader
from autotuner.runtime.pipeline.engine import PipelineEngine
from autotuner.runtime.pipeline.module import PipelineModule


def refuse_beside_pipeline(cfg: DeepSpeedConfig, stage: int) -> None:
    """What the pipeline engine does not train as the config says, each in one line."""
    where = "with pipeline parallelism"
    if stage >= 2:
        raise ConfigError(f"zero_optimization.stage {stage}: ZeRO 2 and 3 are not supported {where} (DeepSpeed refuses "
                          "them too); use stage 0 or 1")
    if cfg.fp16.enabled is True or cfg.bf16.enabled is True:
        which = "fp16" if cfg.fp16.enabled is True else "bf16"
        raise UnsupportedError(f"{which}.enabled: mixed precision is not supported {where} yet; train in fp32 "
                               f"(set {which}.enabled false)")
    if cfg.tensor_parallel.size > 1:
        raise UnsupportedError(f"tensor_parallel.autotp_size {cfg.tensor_parallel.size}: tensor parallelism inside "
                               f"pipeline stages is not supported yet; leave autotp_size at 0 or 1")
    if cfg.compile.enabled is True:
        raise UnsupportedError(f"compile.enabled: torch.compile is not supported {where} yet; set it false")
    policy = cfg.activation_checkpointing.policy
    if policy not in (None, "none"):
        raise ConfigError(f"activation_checkpointing.policy {policy!r}: a pipeline checkpoints by "
                          "pipeline.activation_checkpoint_interval (or PipelineModule(activation_checkpoint_"
                          "interval=...)); leave the policy out")
    if cfg.communication_data_type is not None or cfg.prescale_gradients or cfg.gradient_predivide_factor != 1.0:
        raise UnsupportedError(f"communication_data_type / prescale_gradients / gradient_predivide_factor: not "
                               f"supported {where} yet, whose gradients are averaged in their own dtype; leave them "
                               "out")
    if cfg.autotuning.adapt_batch:
        raise UnsupportedError(f"autotuning.adapt_batch: a batch ramp is not supported {where}")


def initialize_pipeline(args: Any, model: PipelineModule, optimizer: Any, model_parameters: Any,
                        training_data: Dataset | None, lr_scheduler: Any, mpu: Any, collate_fn: Callable | None,
                        cfg: DeepSpeedConfig, build_optimizer: Callable, build_scheduler: Callable,
                        ) -> tuple[PipelineEngine, Any, Any, Any]:
    if mpu is not None:
        raise UnsupportedError("initialize(mpu=...): a PipelineModule brings its own process grid; pass mpu=None (as "
                               "DeepSpeed asks)")
    stage = cfg.zero_optimization.stage
    refuse_beside_pipeline(cfg, stage)
    if measurement_request(cfg) is not None:
        raise UnsupportedError("autotuning a pipeline-parallel script is not supported yet: its launches cannot "
                               "report their timings; train it with launcher (no --autotuning)")
    ctx = init_distributed()
    refuse_unsettled(cfg, None, in_rank=True)
    stages = cfg.pipeline.stages
    if isinstance(stages, int) and stages != model.num_stages:
        raise ConfigError(f"pipeline.stages {stages}: the script's PipelineModule built {model.num_stages} stages; "
                          "make them agree (or leave pipeline.stages \"auto\")")
    interval = cfg.pipeline.activation_checkpoint_interval
    if interval > 0:  # the config's over the module's, as DeepSpeed's engine sets it
        model.set_checkpoint_interval(interval)
    for key, default in (("partition", "best"), ("seed_layers", False)):
        if getattr(cfg.pipeline, key) != default:
            warn_once(f"pipeline.{key}: DeepSpeed reads it from PipelineModule's arguments, not the config; so does "
                      "this engine, and the config's value has no effect there or here")
    topo = model.topology()
    dp = topo.get_dim("data")
    batch = resolve_batch(cfg, dp)  # a step trains micro x gas x the data-parallel size, as DeepSpeed counts it
    opt = local_opt = scheduler = None
    if optimizer is not None or cfg.optimizer is not None:
        params = [p for p in model.parameters() if p.requires_grad] if model_parameters is None \
            else list(model_parameters)
        if isinstance(optimizer, torch.optim.Optimizer):
            groups = [dict(group) for group in optimizer.param_groups]
        else:
            groups = [{"params": params}] if params and not isinstance(params[0], dict) else params
        data_group = _data_group(topo)
        opt, local_opt = build_optimizer(optimizer, cfg, groups, stage, data_group if stage == 1 else None)
        scheduler = build_scheduler(lr_scheduler, cfg, opt, stage)
    elif lr_scheduler is not None:
        raise ConfigError("initialize(lr_scheduler=...): this engine has no optimizer (no optimizer=... and no "
                          "'optimizer' section), so the schedule would drive nothing; pass the optimizer too")
    loader = None
    if training_data is not None:
        if not isinstance(training_data, Dataset):
            raise ConfigError(f"initialize(training_data=...): got {type(training_data).__name__}; training data "
                              "must be a torch Dataset")
        # Each pipeline reads its data-parallel share in order (DeepSpeed: no shuffle), the first
        # and the last stage the same batches.
        coord = topo.get_coord(dist.get_rank())
        sampler = DistributedSampler(training_data, num_replicas=dp, rank=coord.data, shuffle=False)
        loader = RepeatingLoader(DataLoader(training_data, batch_size=batch.micro_batch_size, sampler=sampler,
                                            collate_fn=collate_fn, drop_last=True))
    engine = PipelineEngine(model, opt, scheduler, cfg, batch, ctx.device, training_dataloader=loader,
                            local_optimizer=local_opt)
    return engine, opt, engine.training_dataloader, scheduler


def _data_group(topo: Any) -> Any:
    """This rank's data-parallel group (its stage's replicas). Collective: every rank makes every group."""
    rank = dist.get_rank()
    mine = None
    for ranks in topo.get_axis_comm_lists("data"):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
