"""`initialize` and `add_config_arguments`: the DeepSpeed-style entry points of a training script."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from autotuner.config.batch import resolve_split_batch
from autotuner.config.loader import ConfigSource
from autotuner.config.models import DeepSpeedConfig
from autotuner.config.sections import refuse_unsettled
from autotuner.core.errors import AutotunerError, ConfigError, UnsupportedError
from autotuner.runtime.deepspeed_side import gather_deepspeed_partitions
from autotuner.runtime.distributed import dist_timeout_s, init_distributed, warn_once
from autotuner.runtime.engine import Engine
from autotuner.runtime.measure.census import census_degrees, census_initialize, census_requested
from autotuner.runtime.script_config import config_from
from autotuner.runtime.training.tp_plan import plan_styles, tp_plan
from autotuner.runtime.measure.gradient_noise import GradientNoiseProbe, MicroStepNoiseProbe
from autotuner.runtime.measure.measurement import measurement_request
from autotuner.runtime.saving.rank_zero_gather import arm as arm_rank_zero_gather
from autotuner.runtime.saving.whole_weights import mark_zero3_parameters, register_root, whole_state_dict_on_rank_zero
from autotuner.runtime.training.activation_checkpointing import apply_activation_checkpointing, repeated_blocks
from autotuner.runtime.training.compiling import compile_blocks
from autotuner.runtime.training.grad_reduction import GradientReduction
from autotuner.runtime.training.optim import (build_optimizer, build_scheduler, optimizer_class, optimizer_kwargs,
                                              remap_groups)
from autotuner.runtime.training.sharding import settle_offload, unwrap, wrap_model, zero_redundancy
from autotuner.runtime.parallel_setup import check_mpu, check_tp_group, layout_for
from autotuner.runtime.pipeline.module import PipelineModule
from autotuner.runtime.training.batch_ramp import ResizableBatchSampler, batch_ramp, ramp_wanted
from autotuner.runtime.training.split_zero import SplitShadows
from autotuner.runtime.training.tensor_parallel import ParallelLayout, split_model
from autotuner.runtime.tp_init import merge_into_config

OptimizerArg = Union[torch.optim.Optimizer, Callable[[Iterable], torch.optim.Optimizer], None]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--deepspeed PATH` (alias `--deepspeed_config PATH`). A bare `--deepspeed` is accepted
    for DeepSpeed's `--deepspeed --deepspeed_config PATH` form; `--deepscale[_config]` are
    DeepSpeed's deprecated spellings. Like DeepSpeed, no `--local_rank`: scripts declare it."""
    group = parser.add_argument_group("autotuner", "DeepSpeed-style configuration")
    group.add_argument("--deepspeed", dest="deepspeed", nargs="?", const=None, default=None, metavar="PATH",
                       help="DeepSpeed-compatible JSON/hjson config")
    group.add_argument("--deepspeed_config", dest="deepspeed_config", default=None, metavar="PATH",
                       help="alias of --deepspeed PATH")
    group.add_argument("--deepscale", action="store_true", default=False, help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, help=argparse.SUPPRESS)
    return parser


def _settle_local_rank(args: Any, local_rank: int) -> None:
    """DeepSpeed overwrites args.local_rank with the launcher's LOCAL_RANK, refusing a mismatch."""
    given = getattr(args, "local_rank", None)
    if args is None or given is None or "LOCAL_RANK" not in os.environ:
        return
    if not isinstance(given, int):
        raise ConfigError(f"args.local_rank: got {given!r}; declare it with type=int")
    if given >= 0 and given != local_rank:
        raise ConfigError(f"args.local_rank={given} but LOCAL_RANK={local_rank} in the environment; "
                          "let the launcher pass --local_rank")
    args.local_rank = local_rank


def _gradient_noise_wanted(cfg: DeepSpeedConfig, stage: int) -> bool:
    """A tuner's launch that asks for it (metric goodput), or a training run whose batch ramp reads
    it (autotuning.adapt_batch), at ZeRO 0 or 1, where each rank's gradient is whole. fp16's loss
    scale, which changes between steps, would scale the norms."""
    request = measurement_request(cfg)
    asked = (request is not None and request.gradient_noise) or ramp_wanted(cfg)
    return stage <= 1 and cfg.precision != "fp16" and asked


def gradient_noise_probe(cfg: DeepSpeedConfig, stage: int, batch, world_size: int,
                         layout: ParallelLayout | None = None) -> GradientNoiseProbe | None:
    """With two ranks or more: read around the all-reduce (measure/gradient_noise.py). Built before DDP
    wraps the model, which takes its hook."""
    if _gradient_noise_wanted(cfg, stage) and layout is not None and layout.tensor_parallel:
        raise UnsupportedError("autotuning.metric \"goodput\": the gradient noise is not read under tensor_parallel "
                               "yet (a rank's gradient is a shard); use metric \"throughput\"")
    if not _gradient_noise_wanted(cfg, stage) or world_size < 2:
        return None
    return GradientNoiseProbe(None, batch.micro_batch_size * batch.gradient_accumulation_steps, world_size)


def micro_step_noise_probe(cfg: DeepSpeedConfig, stage: int, batch, world_size: int,
                           parameters) -> MicroStepNoiseProbe | None:
    """One rank with gradient accumulation: read over the micro-steps (measure/gradient_noise.py)."""
    if not _gradient_noise_wanted(cfg, stage) or world_size != 1 or batch.gradient_accumulation_steps < 2:
        return None
    return MicroStepNoiseProbe(list(parameters), batch.micro_batch_size, batch.gradient_accumulation_steps)


def _build_optimizer(
    client: OptimizerArg, config: DeepSpeedConfig, groups: list[dict], stage: int, dp_group: Any = None
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(optimizer the user steps, optimizer whose state this rank holds). A client optimizer wins
    over the config's 'optimizer' section, as in DeepSpeed, which is then not used. `dp_group`:
    ZeRO 1's group under tensor parallelism (its `groups` then hold the split parameters' shadows)."""
    if client is not None and config.optimizer is not None:
        warn_once(f"optimizer: using the optimizer passed to initialize() ({_optimizer_label(client)}); the "
                  f"config's 'optimizer' section ({config.optimizer.type}) is not used, as in DeepSpeed")
    if isinstance(client, torch.optim.Optimizer):
        if stage == 1:  # the client's groups with their own settings (a bias group's weight decay, say)
            zero = zero_redundancy(_with_settings(client.param_groups, groups), type(client), dict(client.defaults),
                                   dp_group)
            return zero, zero.optim
        # Same optimizer object, pointed at the wrapped parameters; it has no state yet.
        for group, new in zip(client.param_groups, groups):
            group["params"] = new["params"]
        return client, client
    if callable(client):
        built = client(groups)
        if stage == 1:
            zero = zero_redundancy(_with_settings(built.param_groups, groups), type(built), dict(built.defaults),
                                   dp_group)
            return zero, zero.optim
        return built, built
    if config.optimizer is None:
        raise ConfigError("no optimizer: add an 'optimizer' section to the config or pass initialize(optimizer=...)")
    if stage == 1:
        zero = zero_redundancy(groups, optimizer_class(config.optimizer), optimizer_kwargs(config.optimizer), dp_group)
        return zero, zero.optim
    built = build_optimizer(config.optimizer, groups)
    return built, built


def _with_settings(settings: list[dict], groups: list[dict]) -> list[dict]:
    """Each group's parameters with the hyperparameters the client's optimizer gave that group."""
    return [{**{key: value for key, value in setting.items() if key != "params"}, "params": group["params"]}
            for setting, group in zip(settings, groups)]


def _optimizer_label(client: Any) -> str:
    return type(client).__name__ if isinstance(client, torch.optim.Optimizer) else "a callable"


def _build_scheduler(client: Any, config: DeepSpeedConfig, optimizer: torch.optim.Optimizer, stage: int):
    """A client scheduler (or callable optimizer -> scheduler) wins over the config's, as in DeepSpeed."""
    if client is None:
        return build_scheduler(config.scheduler, optimizer) if config.scheduler is not None else None
    if config.scheduler is not None:
        warn_once(f"scheduler: using the lr_scheduler passed to initialize(); the config's 'scheduler' section "
                  f"({config.scheduler.type}) is not used, as in DeepSpeed")
    if callable(client) and not hasattr(client, "step"):
        return client(optimizer)
    if stage == 1 and getattr(client, "optimizer", None) is not optimizer:
        _drive(client, optimizer)
    return client


def _drive(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point a scheduler built on the client's optimizer at the ZeroRedundancyOptimizer that replaced
    it at stage 1 (same groups, same order), as DeepSpeed's ZeRO optimizer keeps the client's groups."""
    old = getattr(scheduler, "optimizer", None)
    if not isinstance(old, torch.optim.Optimizer) or len(old.param_groups) != len(optimizer.param_groups):
        raise ConfigError("lr_scheduler: under ZeRO stage 1 the optimizer is rebuilt as ZeroRedundancyOptimizer and "
                          "this scheduler's optimizer does not match it group for group; pass a callable optimizer "
                          "-> scheduler, or use the config's 'scheduler'")
    for group, was in zip(optimizer.param_groups, old.param_groups):
        group.update({key: value for key, value in was.items() if key != "params"})
    scheduler.optimizer = optimizer
    # torch's schedulers check, at their first step, that the optimizer's step is the one they
    # wrapped to note it was called; the new optimizer's is marked the same way.
    step = optimizer.step

    def noted_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    noted_step._wrapped_by_lr_sched = True
    optimizer._opt_called = getattr(old, "_opt_called", False)
    optimizer.step = noted_step


def _grad_scaler(config: DeepSpeedConfig, device: torch.device, stage: int, split: bool = False):
    """fp16's scaler; where a rank holds shards (FSDP2, or a split model) the overflow check is
    agreed over every rank, so all skip a step together."""
    if config.precision != "fp16":
        return None
    from autotuner.runtime.training.loss_scale import LossScaler

    return LossScaler(config.fp16, device, sharded=stage >= 2 or split)


def _dataloader(dataset: Dataset, collate_fn: Any, batch_size: int, rank: int, world_size: int,
                resizable: bool = False) -> DataLoader:
    """DeepSpeed's training loader: each rank its shard, the batch the micro-batch; under a batch
    ramp its batches can grow between optimizer steps (training/batch_ramp.py)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    if not resizable:
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=True)
    loader = DataLoader(dataset, batch_sampler=ResizableBatchSampler(sampler, batch_size), collate_fn=collate_fn)
    # Scripts call loader.sampler.set_epoch(epoch) as on the plain loader: the same DistributedSampler
    # (DataLoader refuses to set it after construction, and would hold a default one otherwise).
    object.__setattr__(loader, "sampler", sampler)
    return loader


def _takes_degree(model: nn.Module, degree: int) -> bool:
    """Whether the tensor-parallel plan can split `model` over `degree` ranks (whole heads each)."""
    try:
        tp_plan(model, degree)
    except AutotunerError:
        return False
    return True


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable | None = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: ConfigSource | None = None,
    mesh_param: Any = None,
    config_params: ConfigSource | None = None,
) -> tuple[Engine, torch.optim.Optimizer, DataLoader | None, Any]:
    """Wrap `model` for the configured ZeRO stage; returns (engine, optimizer, dataloader, lr_scheduler)
    as deepspeed.initialize does, with its parameters in DeepSpeed 0.19's positional order.
    `distributed_port` is used only without a launcher's MASTER_PORT. Every unsupported
    combination fails here, before training."""
    if model is None:
        raise ConfigError("initialize: model is required")
    if dist_init_required is False and not dist.is_initialized():
        raise ConfigError("initialize(dist_init_required=False): the process group is not initialised; call "
                          "init_distributed() first or leave dist_init_required unset")
    cfg, tuned_over_script, measured = config_from(args, config if config is not None else config_params,
                                                   client_optimizer=optimizer is not None,
                                                   training_engines_before=Engine.training_engines_in_process)
    if census_requested():  # a plan for hardware not here: count one step on the meta device (census.py)
        micro = cfg.train_micro_batch_size_per_gpu
        if isinstance(model, PipelineModule):  # every stage counted in this one process (pipeline/census.py)
            from autotuner.runtime.pipeline.census import pipeline_census_initialize

            return pipeline_census_initialize(model, micro if isinstance(micro, int) else 1, training_data,
                                              collate_fn, {"bf16": torch.bfloat16,
                                                           "fp16": torch.float16}.get(cfg.precision), cfg)
        asked = census_degrees()
        styles = plan_styles(model) if asked else ()
        return census_initialize(model, repeated_blocks(model), micro if isinstance(micro, int) else 1, training_data,
                                 collate_fn, styles, tuple(k for k in asked if styles and _takes_degree(model, k)),
                                 {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision), cfg)
    trains = optimizer is not None or cfg.optimizer is not None
    if not trains and lr_scheduler is not None:
        raise ConfigError("initialize(lr_scheduler=...): this engine has no optimizer (no optimizer=... and no "
                          "'optimizer' section), so the schedule would drive nothing; pass the optimizer too")
    stage = cfg.zero_optimization.stage
    if not isinstance(stage, int):
        raise ConfigError(
            f"zero_optimization.stage: got {stage!r}; a list or \"all\" is only for the autotuner "
            "(launcher --autotuning tune|run); give 0, 1, 2 or 3 to train"
        )
    ctx = init_distributed(default_port=distributed_port)
    _settle_local_rank(args, ctx.local_rank)
    if isinstance(model, PipelineModule):  # DeepSpeed's pipeline engine: train_batch(), per-stage layers
        # (torch.distributed.pipelining imports torch.export and dynamo: a second, paid only by pipelines)
        from autotuner.runtime.pipeline.initialize import initialize_pipeline

        return initialize_pipeline(args, model, optimizer, model_parameters, training_data, lr_scheduler, mpu,
                                   collate_fn, cfg.with_device_precision(ctx.device.type == "cuda"
                                                                         and torch.cuda.is_bf16_supported()),
                                   _build_optimizer, _build_scheduler, measured, tuned_over_script)
    cfg = cfg.with_device_precision(ctx.device.type == "cuda" and torch.cuda.is_bf16_supported())
    cfg = cfg.model_copy(update={"zero_optimization": settle_offload(cfg.zero_optimization, stage, ctx.device)})
    cfg, tp_group = merge_into_config(cfg, mpu)  # what deepspeed.tp_model_init noted, as DeepSpeed merges it
    layout = layout_for(cfg, ctx, stage)
    check_mpu(mpu, mesh_param, layout)
    check_tp_group(tp_group, layout)
    batch, batch_note = resolve_split_batch(cfg, ctx.world_size, layout.tp_size, counts_every_rank=mpu is None)
    if batch_note:
        warn_once(batch_note)
    id_to_name = {id(p): name for name, p in model.named_parameters()}
    if isinstance(optimizer, torch.optim.Optimizer):
        source = [dict(group) for group in optimizer.param_groups]
    else:
        source = list(model_parameters) if model_parameters is not None else list(model.parameters())
    gather_deepspeed_partitions(model)  # a model built under DeepSpeed's own zero.Init; groups map by name
    refuse_unsettled(cfg, None, in_rank=True)  # the tuner writes a value into each experiment's config
    split = split_model(model.to(ctx.device), layout) if layout.tensor_parallel else None  # torchtitan's order
    apply_activation_checkpointing(model, cfg.activation_checkpointing.policy)  # before DDP/FSDP2 wrap
    if cfg.compile.enabled:
        compile_blocks(model, cfg.compile.backend, cfg.compile.kwargs)  # after checkpointing, before sharding
    noise = gradient_noise_probe(cfg, stage, batch, ctx.world_size, layout) if measured else None
    wrapped = wrap_model(model, stage, cfg.zero_optimization, cfg.precision, ctx, GradientReduction.from_config(cfg),
                         noise, dp_mesh=layout.mesh["dp"] if layout.tensor_parallel else None, forward_only=not trains)
    if measured:
        noise = noise or micro_step_noise_probe(cfg, stage, batch, ctx.world_size, unwrap(wrapped).parameters())
    ramp = batch_ramp(cfg, ctx.rank, noise is not None, stage) if measured else None
    shadows = opt = local_opt = scheduler = None
    if trains:
        groups = remap_groups(source, id_to_name, dict(unwrap(wrapped).named_parameters()))
        if split is not None and stage == 1:  # ZeroRedundancyOptimizer over the dp group, on the shards' shadows
            shadows, groups = SplitShadows.over(groups)
        opt, local_opt = _build_optimizer(optimizer, cfg, groups, stage, layout.dp_group if shadows else None)
        scheduler = _build_scheduler(lr_scheduler, cfg, opt, stage)
    loader = None
    if training_data is not None:
        if not isinstance(training_data, Dataset):
            raise ConfigError(f"initialize(training_data=...): got {type(training_data).__name__}; "
                              "training data must be a torch Dataset")
        # By data-parallel rank: the ranks of a tensor-parallel group draw the same batches.
        loader = _dataloader(training_data, collate_fn, batch.micro_batch_size, layout.dp_rank, layout.dp_size,
                             resizable=ramp is not None)
    engine = Engine(
        wrapped, opt, scheduler, cfg, batch, ctx,
        local_optimizer=local_opt,
        grad_scaler=_grad_scaler(cfg, ctx.device, stage, split is not None) if trains else None,
        training_dataloader=loader,
        client_optimizer=optimizer is not None,
        gradient_noise=noise,
        layout=layout,
        split=split,
        shadows=shadows,
        ramp=ramp,
        measured=measured,
    )
    engine.tuned_over_script = tuned_over_script
    if stage >= 2:  # FSDP2's shards: whole weights where a DeepSpeed script reads them (saving/whole_weights.py)
        user_module = unwrap(wrapped)
        register_root(user_module)
        if stage == 3:
            mark_zero3_parameters(user_module)
        service = arm_rank_zero_gather(user_module, stage, ctx.world_size, engine.step_gate, dist_timeout_s()) \
            if split is None else None  # FSDP2 over split parameters: 2-D shards, refused on rank 0 alone
        whole_state_dict_on_rank_zero(user_module, ctx.rank, service)
    elif split is not None:  # the split parameters of a TP group, served to rank 0 like FSDP2's shards
        service = arm_rank_zero_gather(unwrap(wrapped), stage, ctx.world_size, engine.step_gate, dist_timeout_s(),
                                       split=True)
        whole_state_dict_on_rank_zero(unwrap(wrapped), ctx.rank, service)
    return engine, opt, loader, scheduler
