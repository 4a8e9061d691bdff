"""`initialize(model=PipelineModule(...))`: the pipeline engine, as DeepSpeed builds it.

What a pipeline trains with here: ZeRO 0 (each stage's gradients averaged over its data-parallel
group) or ZeRO 1 (torch's ZeroRedundancyOptimizer over that group); fp32, bf16 or fp16 (each
stage's forward under autocast, fp32 weights, as our engine's ZeRO 0 and 1 run them; fp16 with
its loss scaler, one overflow verdict over every stage); the config's optimizer and scheduler (or
the script's); gradient clipping over the whole pipeline's norm; and tensor_parallel.autotp_size
inside each stage (one (pp, dp, tp) mesh; the stage's layers split by AutoTP's rule; ZeRO 1 then
steps the shards' shadows, training/split_zero.py); under a schedule of several stages per rank,
the module's layers re-placed over pipeline.stages_per_rank chunks first. What would train otherwise is refused in one
line (ConfigError/UnsupportedError, exit status 2): ZeRO 2 and 3 (DeepSpeed refuses them with
pipelines too), torch.compile, activation_checkpointing's policy (a pipeline checkpoints by
activation_checkpoint_interval), the gradient-reduction keys and a batch ramp. A tuner's launch
measures the engine over its train_batch() calls (measure.py)."""

from __future__ import annotations

from dataclasses import dataclass
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
from autotuner.config.pipeline import v_shaped
from autotuner.runtime.pipeline.schedules import stages_per_rank
from autotuner.runtime.training.optim import remap_groups
from autotuner.runtime.training.split_zero import SplitShadows
from autotuner.runtime.training.tensor_parallel import ParallelLayout, SplitModel, refuse_on_device, split_model


def refuse_beside_pipeline(cfg: DeepSpeedConfig, stage: int) -> None:
    """What the pipeline engine does not train as the config says, each in one line."""
    where = "with pipeline parallelism"
    if stage >= 2:
        raise ConfigError(f"zero_optimization.stage {stage}: ZeRO 2 and 3 are not supported {where} (DeepSpeed refuses "
                          "them too); use stage 0 or 1")
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
                        measured: bool = True, tuned_over_script: tuple[str, ...] = (),
                        ) -> tuple[PipelineEngine, Any, Any, Any]:
    """`measured`: the engine a tuner's launch measures (script_config's rule: the first built with
    an optimizer); `tuned_over_script`: the tuned keys laid over the script's own config."""
    if mpu is not None:
        raise UnsupportedError("initialize(mpu=...): a PipelineModule brings its own process grid; pass mpu=None (as "
                               "DeepSpeed asks)")
    stage = cfg.zero_optimization.stage
    refuse_beside_pipeline(cfg, stage)
    ctx = init_distributed()
    refuse_unsettled(cfg, None, in_rank=True)
    stages = cfg.pipeline.stages
    if isinstance(stages, list):
        raise ConfigError(f"pipeline.stages: got {stages}; a list is settled by --autotuning tune|run (it searches "
                          "them); give one number, or \"auto\" to train as the script's PipelineModule builds")
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
    moved = _place_virtual_stages(model, cfg, optimizer)
    split, layout = _split_stages(model, cfg, ctx)
    topo = model.topology()
    dp = topo.get_dim("data")
    batch = resolve_batch(cfg, dp)  # a step trains micro x gas x the data-parallel size, as DeepSpeed counts it
    opt = local_opt = scheduler = shadows = None
    if optimizer is not None or cfg.optimizer is not None:
        params = [p for p in model.parameters() if p.requires_grad] if model_parameters is None \
            else list(model_parameters)
        if isinstance(optimizer, torch.optim.Optimizer):
            groups = [dict(group) for group in optimizer.param_groups]
        else:
            groups = [{"params": params}] if params and not isinstance(params[0], dict) else params
        if moved is not None and model_parameters is not None:  # re-placed: the script's parameters are the old ones
            groups = _onto_the_replaced_layers(groups, moved, model)
        if split is not None:  # the script's parameters were swapped for the split ones: the same by name
            groups = remap_groups(groups, split.names_before, dict(model.named_parameters()))
        if split is not None and stage == 1:  # ZeroRedundancyOptimizer over dp, on the shards' shadows
            shadows, groups = SplitShadows.over(groups)
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
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    model.compute_in(compute)
    scaler = None
    if cfg.precision == "fp16":
        from autotuner.runtime.training.loss_scale import LossScaler

        scaler = LossScaler(cfg.fp16, ctx.device, sharded=True)  # one overflow verdict over every stage
    engine = PipelineEngine(model, opt, scheduler, cfg, batch, ctx.device, training_dataloader=loader,
                            local_optimizer=local_opt, request=measurement_request(cfg) if measured else None,
                            tuned_over_script=tuned_over_script, split=split.model if split else None,
                            layout=layout, loss_scaler=scaler, shadows=shadows)
    return engine, opt, engine.training_dataloader, scheduler


def _place_virtual_stages(model: PipelineModule, cfg: DeepSpeedConfig, optimizer: Any) -> dict[int, str] | None:
    """Under a schedule of several stages per rank: the module's layers re-placed over stages x
    pipeline.stages_per_rank chunks (collective). Returns the trainable parameters' names by id
    from before, or None where nothing moved."""
    per_rank = stages_per_rank(cfg.pipeline.schedule, cfg.pipeline.stages_per_rank)
    in_a_v = v_shaped(cfg.pipeline.schedule)
    if (per_rank, in_a_v) == (model.stages_per_rank, model.v_shaped):
        return None
    if cfg.tensor_parallel.size > 1 or model.topology().get_dim("model") > 1:
        raise UnsupportedError(f"pipeline.schedule {cfg.pipeline.schedule}: several stages per rank beside tensor "
                               "parallelism is not supported yet; use 1F1B or GPipe with autotp_size")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedError(f"pipeline.schedule {cfg.pipeline.schedule}: the stages are re-placed at initialize, "
                               "so an optimizer built on the module's parameters before it would step the old ones; "
                               "pass the 'optimizer' section (or a callable taking the parameters) instead")
    names = {id(param): name for name, param in model.named_parameters() if param.requires_grad}
    model.place_virtual_stages(per_rank, in_a_v)
    return names


def _onto_the_replaced_layers(groups: list[dict], names_before: dict[int, str], model: PipelineModule) -> list[dict]:
    """The script's parameter groups after its layers were re-placed: it passed the module's
    trainable parameters (one group), and gets the re-placed module's; anything narrower (a
    frozen subset, several groups) cannot be carried onto layers this rank did not hold, so it
    is refused in one line."""
    given = [param for group in groups for param in group["params"]]
    if len(groups) != 1 or {names_before.get(id(p)) for p in given} != set(names_before.values()):
        raise UnsupportedError("initialize(model_parameters=...): with several stages per rank the layers are "
                               "re-placed, so model_parameters must be the module's trainable parameters in one "
                               "group; pass them all (or leave model_parameters out)")
    settings = {key: value for key, value in groups[0].items() if key != "params"}
    return [{**settings, "params": [p for p in model.parameters() if p.requires_grad]}]


def _data_group(topo: Any) -> Any:
    """This rank's data-parallel group (its stage's replicas). Collective: every rank makes every group."""
    rank = dist.get_rank()
    mine = None
    for ranks in topo.get_axis_comm_lists("data"):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


@dataclass(frozen=True)
class SplitStages:
    """What tensor parallelism inside the stages did: the split (tensor_parallel.py), and each
    parameter's name by the id it had before (the script's model_parameters hold those)."""

    model: SplitModel
    names_before: dict[int, str]


def _split_stages(model: PipelineModule, cfg: DeepSpeedConfig, ctx: Any) -> tuple[SplitStages | None, Any]:
    """tensor_parallel.autotp_size inside each stage (collective): the (pp, dp, tp) mesh built once,
    in torchtitan's order (pp outermost, tp fastest, DeepSpeed's PipeModelDataParallelTopology
    order too), and this stage's layers split over its `tp` sub-mesh by AutoTP's rule."""
    tp = cfg.tensor_parallel.size
    axis = model.topology().get_dim("model")
    if tp <= 1 and axis <= 1:
        return None, None
    if tp <= 1:
        raise ConfigError(f"PipelineModule(topology=...): its model axis of {axis} splits each stage by tensor "
                          f"parallelism; set tensor_parallel.autotp_size {axis} too (the stages' layers are split "
                          "by AutoTP's rule), or give num_mp=1")
    refuse_on_device(cfg.tensor_parallel.keep_module_on_host, ctx.device)
    model.split_stages_over(tp)
    topo = model.topology()
    if tp > ctx.local_world_size or ctx.local_world_size % tp:
        raise ConfigError(f"tensor_parallel.autotp_size {tp}: a tensor-parallel group must lie inside one node, so "
                          f"it must divide the ranks per node ({ctx.local_world_size})")
    from torch.distributed.device_mesh import init_device_mesh

    pp, dp = topo.get_dim("pipe"), topo.get_dim("data")
    mesh = init_device_mesh(ctx.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    coord = topo.get_coord(ctx.rank)
    layout = ParallelLayout(tp, dp, coord.model, coord.data, mesh["dp", "tp"])
    stage_groups = [dist.new_group(topo.get_axis_list("pipe", s)) for s in range(pp)]  # collective: every rank
    names_before = {id(param): name for name, param in model.named_parameters()}
    split = split_model(model, layout, source=(topo.get_axis_list("pipe", coord.pipe)[0], stage_groups[coord.pipe]))
    return SplitStages(split, names_before), layout
