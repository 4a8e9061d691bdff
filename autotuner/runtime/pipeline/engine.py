"""DeepSpeed's pipeline engine API over torch.distributed.pipelining.

`train_batch()` runs gradient_accumulation_steps micro-batches through torch's schedule (1F1B
unless the config's pipeline.schedule says otherwise, DeepSpeed's own TrainSchedule being 1F1B),
then, as DeepSpeed orders it: tied weights' gradients summed over their stages, every gradient
averaged over the stage's data-parallel group, the optimizer step. It returns the mean loss over
the micro-batches and the data-parallel ranks, on every stage. Only the first and the last stage
read the data iterator (the inputs and the labels of each micro-batch), as in DeepSpeed.

The engine's forward, backward and step are DeepSpeed's refusals: a pipeline trains through
train_batch() only."""

from __future__ import annotations

import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from autotuner.config.batch import BatchSizes
from autotuner.config.models import DeepSpeedConfig
from autotuner.core.errors import ConfigError, UnsupportedError
from autotuner.runtime.pipeline.checkpoints import PipelineCheckpoints
from autotuner.core.boundary import MeasurementRequest
from autotuner.runtime.pipeline.measure import PipelineMeasurement
from autotuner.runtime.pipeline.micro_batches import as_tuple, join_labels, split_micro_batches
from autotuner.runtime.pipeline.module import PipelineModule
from autotuner.runtime.distributed import warn_once
from autotuner.runtime.pipeline.schedules import schedule_for
from autotuner.runtime.training.loss_scale import LossScaler
from autotuner.runtime.training.split_zero import SplitShadows
from autotuner.runtime.training.tensor_parallel import ParallelLayout, SplitModel


class PipelineError(Exception):
    """Raised by the engine's forward, backward and step, as DeepSpeed raises it."""


_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode."  # DeepSpeed's words


class PipelineEngine(PipelineCheckpoints, nn.Module):
    """What `initialize(model=PipelineModule(...))` returns. `local_optimizer`: the optimizer whose
    state this rank holds (ZeRO 1: its share), which checkpoints save."""

    def __init__(self, module: PipelineModule, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                 config: DeepSpeedConfig, batch: BatchSizes, device: torch.device, training_dataloader: Any = None,
                 local_optimizer: torch.optim.Optimizer | None = None, request: MeasurementRequest | None = None,
                 tuned_over_script: tuple[str, ...] = (), split: SplitModel | None = None,
                 layout: ParallelLayout | None = None, loss_scaler: LossScaler | None = None,
                 shadows: SplitShadows | None = None):
        super().__init__()
        self._shadows = shadows  # ZeRO 1 over split stages: what its optimizer steps (training/split_zero.py)
        # fp16: the last stage's loss scaled inside the schedule, every stage's gradients unscaled
        # before clipping, the step skipped on every rank together (the scaler agrees its overflow
        # check over the world), the scale by DeepSpeed's rule (training/loss_scale.py).
        self.loss_scaler = loss_scaler
        self.skipped_steps = 0
        if loss_scaler is not None:  # torch's scaler starts its scale at the first scale(): only the last
            loss_scaler.scale(torch.zeros((), device=device))  # stage scales a loss, every stage unscales
        self.split = split  # tensor parallelism inside the stages (initialize.py), over layout's tp group
        self.layout = layout
        self.module = module
        self.optimizer = optimizer
        self._local_optimizer = local_optimizer if local_optimizer is not None else optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config
        self.batch = batch
        self.device = device
        self.global_rank = dist.get_rank()
        self.global_steps = 0
        self.global_samples = 0
        self.micro_batches = batch.gradient_accumulation_steps
        self.micro_batch_size = batch.micro_batch_size
        topo = module.topology()
        coord = topo.get_coord(self.global_rank)
        self.stage_id, self.num_stages = coord.pipe, module.num_stages
        self.dp_world_size = topo.get_dim("data")
        self._pipe_groups = [dist.new_group(ranks) for ranks in topo.get_axis_comm_lists("pipe")]  # collective
        self._data_groups = [dist.new_group(ranks) for ranks in topo.get_axis_comm_lists("data")]
        self.pipe_ranks = next(r for r in topo.get_axis_comm_lists("pipe") if self.global_rank in r)
        self.pipe_group = self._pipe_groups[topo.get_axis_comm_lists("pipe").index(self.pipe_ranks)]
        self.data_ranks = next(r for r in topo.get_axis_comm_lists("data") if self.global_rank in r)
        self.data_group = self._data_groups[topo.get_axis_comm_lists("data").index(self.data_ranks)]
        self.training_dataloader = training_dataloader if self.is_first_stage() or self.is_last_stage() else None
        self.data_iterator: Iterator | None = iter(self.training_dataloader) \
            if self.training_dataloader is not None else None
        self.agg_train_loss: torch.Tensor | None = None
        # One PipelineStage per rank, or with virtual stages one per chunk (torch's multi-stage schedules).
        if module.stages_per_rank == 1:
            self._stage: Any = PipelineStage(module, self.stage_id, self.num_stages, device, group=self.pipe_group)
        else:
            total = self.num_stages * module.stages_per_rank
            self._stage = [PipelineStage(chunk, virtual, total, device, group=self.pipe_group)
                           for virtual, chunk in module.chunks()]
        loss_fn = module.loss_fn if module.loss_fn is not None else _output_is_loss
        if loss_scaler is not None:
            loss_fn = _scaled(loss_fn, loss_scaler)
        self._schedule_class, note = schedule_for(config.pipeline.schedule, self.micro_batches, self.num_stages)
        if note is not None and self.global_rank == 0:
            warn_once(note)
        # The gradients' mean over the micro-batches is taken once, here (_mean_over_micro_batches): torch
        # scales each stage's own parameters, and a V's embedding and head share one weight on a rank.
        self._train_schedule = self._schedule_class(self._stage, n_microbatches=self.micro_batches, loss_fn=loss_fn,
                                                    scale_grads=False)
        self._loss_fn = loss_fn
        self._eval_schedules: dict[int, Any] = {}
        # A tuner's launch: the protocol over train_batch() calls (measure.py); the engine a tuner
        # measures is the one with an optimizer.
        self._measurement = PipelineMeasurement(self, request, tuned_over_script) \
            if request is not None and optimizer is not None else None

    # ----- where this rank sits -----
    @property
    def pipeline_stages(self) -> list[Any]:
        """torch's PipelineStage this rank runs, or one per virtual stage."""
        return self._stage if isinstance(self._stage, list) else [self._stage]

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage, which computes the loss (under a V, the first rank)."""
        return self.stage_id == self._last_stage_rank

    @property
    def _last_stage_rank(self) -> int:
        return self.module.rank_of_virtual_stage(self.num_stages * self.module.stages_per_rank - 1)

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    # ----- data -----
    def set_dataiterator(self, iterator: Iterator) -> None:
        """Only the first and the last stage read data (DeepSpeed's rule; a middle stage ignores it)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def _micro_batches(self, count: int) -> tuple[tuple[torch.Tensor, ...] | None, Any]:
        """`count` micro-batches from the iterator, joined along the batch dimension (the schedule
        splits them again, into the same micro-batches): (inputs on the first stage, labels on the
        last). Each item is (inputs, labels), as DeepSpeed reads it."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if self.data_iterator is None:
            raise ConfigError("train_batch(): no data; pass initialize(training_data=...), train_batch(data_iter=...) "
                              "or call set_dataiterator() on the first and last stages")
        inputs, labels = [], []
        for _ in range(count):
            item = next(self.data_iterator)
            if not isinstance(item, (tuple, list)) or len(item) < 2:
                raise ConfigError(f"train_batch(): each batch must be (inputs, labels), as DeepSpeed's pipeline reads "
                                  f"it; got {type(item).__name__}")
            inputs.append(as_tuple(item[0], "inputs"))
            labels.append(item[1])
        sizes = {len(parts[0]) for parts in inputs}
        if len(sizes) > 1:
            raise ConfigError(f"train_batch(): the micro-batches hold {sorted(sizes)} samples; a pipeline's "
                              "micro-batches must be the same size (drop the last short batch)")
        joined = tuple(torch.cat([parts[i] for parts in inputs]).to(self.device) for i in range(len(inputs[0])))
        target = join_labels(labels, self.device)
        return joined, target

    # ----- training -----
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if self.optimizer is None:
            raise ConfigError("train_batch(): this pipeline engine was built without an optimizer (no optimizer=... and "
                              "no 'optimizer' section); use eval_batch()")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        if self._measurement is not None:
            self._measurement.batch_starts()
        started = time.perf_counter()
        inputs, target = self._micro_batches(self.micro_batches)
        losses: list[torch.Tensor] = []
        scale = self.loss_scaler.get_scale() if self.loss_scaler is not None else 1.0  # what this step's losses carry
        self._run(self._train_schedule, inputs, target, losses)
        self._mean_over_micro_batches()
        self.module.allreduce_tied_weight_gradients()
        self._average_over_data_parallel()
        if self._shadows is not None:  # (the same storage: the unscale and the clip below reach both)
            self._shadows.hand_gradients()
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(self.optimizer)
        self._clip_gradients()
        stepping = time.perf_counter()
        applied = True
        if self.loss_scaler is not None:
            applied = self.loss_scaler.step(self.optimizer)
            self.skipped_steps += not applied
        else:
            self.optimizer.step()
        step_s = time.perf_counter() - stepping
        self.optimizer.zero_grad(set_to_none=True)
        if self._shadows is not None:
            self._shadows.drop_gradients()
        if self.lr_scheduler is not None and applied:  # DeepSpeed does not advance it on a skipped step
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.batch.train_batch_size
        loss = self._aggregate([value / scale for value in losses], self.micro_batches)
        self.agg_train_loss = loss
        every = self.config.steps_per_print
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            elapsed = time.perf_counter() - started
            print(f"steps: {self.global_steps} loss: {loss.item():0.4f} iter time (s): {elapsed:0.3f} samples/sec: "
                  f"{self.batch.train_batch_size / elapsed:0.3f}", file=sys.stdout, flush=True)
        if self._measurement is not None:  # (after the window's last step, the ranks leave here)
            self._measurement.batch_done(self.global_steps, step_s)
        return loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        if reduce_output not in ("avg", None):
            raise NotImplementedError(f"eval_batch(reduce_output={reduce_output!r}): expected 'avg' or None")
        if self.module.v_shaped:  # torch 2.13's forward-only pass over these still runs their backward actions
            raise UnsupportedError(f"eval_batch(): pipeline.schedule {self.config.pipeline.schedule} has no "
                                   "forward-only pass in torch (its V's action lists keep their backward steps); "
                                   "evaluate under another schedule")
        count = num_micro_batches or self.micro_batches
        self.module.eval()
        kept = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            inputs, target = self._micro_batches(count)
        finally:
            self.data_iterator = kept
        if count not in self._eval_schedules:  # (every stage builds the same ones, in the same order)
            cls, _ = schedule_for(self.config.pipeline.schedule, count, self.num_stages)
            self._eval_schedules[count] = cls(self._stage, n_microbatches=count, loss_fn=None)
        schedule = self._eval_schedules[count]
        with torch.no_grad():
            outputs = schedule.eval(*(inputs or ())) if self.is_first_stage() else schedule.eval()
        result: Any = None
        if self.is_last_stage():
            chunks = split_micro_batches(outputs, count)
            labels = split_micro_batches(target, count)
            if compute_loss and self.module.loss_fn is not None:
                values = [self.module.loss_fn(out, lab).detach() for out, lab in zip(chunks, labels)]
            else:
                values = [out.detach() if isinstance(out, torch.Tensor) else out for out in chunks]
            result = values if reduce_output is None else self._data_parallel_mean(torch.stack(values).mean(0))
        if compute_loss and bcast_loss and reduce_output == "avg":
            result = self._from_last_stage(result)
        if return_logits:
            return result, (chunks[-1] if self.is_last_stage() else None)
        return result

    def _run(self, schedule: Any, inputs: tuple[torch.Tensor, ...] | None, target: Any,
             losses: list[torch.Tensor]) -> None:
        # (The last stage's outputs are not kept: a training step needs its losses only.)
        if self.is_first_stage() and self.is_last_stage():
            schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        elif self.is_first_stage():
            schedule.step(*inputs, return_outputs=False)
        elif self.is_last_stage():
            schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)

    def _mean_over_micro_batches(self) -> None:
        if self.micro_batches > 1:
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.div_(self.micro_batches)

    def _average_over_data_parallel(self) -> None:
        if self.dp_world_size <= 1:
            return
        for param in self.module.parameters():
            if param.grad is not None:
                grad = _local(param.grad)  # a split weight's gradient: this rank's shard, averaged alike
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.data_group)
                grad.div_(self.dp_world_size)

    def _clip_gradients(self) -> None:
        """gradient_clipping over the whole pipeline's norm: each tied weight counted once, and inside
        split stages each split weight's shards on every TP rank, a whole weight on TP rank 0 only
        (DeepSpeed's AutoTP norm, tensor_parallel.py tp_gradient_norm)."""
        clip = self.config.gradient_clipping
        if not clip:
            return
        split = self.split.split_parameters if self.split is not None else frozenset()
        counts_whole = self.layout is None or self.layout.tp_rank == 0
        squares = torch.zeros((), device=self.device, dtype=torch.float32)
        for name, param in self.module.named_parameters():
            if param.grad is not None and not getattr(param, "ds_pipe_replicated", False) \
                    and (name in split or counts_whole):
                squares += _local(param.grad).detach().float().pow(2).sum()
        dist.all_reduce(squares, group=self.pipe_group)
        if self.layout is not None:
            dist.all_reduce(squares, group=self.layout.tp_group)
        norm = squares.sqrt()
        scale = clip / (norm + 1e-6)
        if scale < 1:
            for param in self.module.parameters():
                if param.grad is not None:
                    _local(param.grad).mul_(scale)
        self._global_grad_norm = norm.item()

    def get_loss_scale(self) -> float | None:
        return self.loss_scaler.get_scale() if self.loss_scaler is not None else None

    def get_global_grad_norm(self) -> float | None:
        return getattr(self, "_global_grad_norm", None)

    def _data_parallel_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_world_size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.data_group)
            value /= self.dp_world_size
        return value

    def _from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """The last stage's scalar on every stage of this pipeline (float32, as DeepSpeed sends it)."""
        if self.num_stages == 1:
            return value
        out = value.detach().float().reshape(()) if self.is_last_stage() else torch.zeros((), device=self.device)
        dist.broadcast(out, src=self.pipe_ranks[self._last_stage_rank], group=self.pipe_group)
        return value if self.is_last_stage() else out

    def _aggregate(self, losses: list[torch.Tensor], count: int) -> torch.Tensor:
        """Mean of the micro-batches' losses, averaged over data-parallel ranks, on every stage."""
        if self.is_last_stage():
            mean = torch.stack([loss.detach().float() for loss in losses]).sum() / count  # (bf16: summed in fp32)
            mean = self._data_parallel_mean(mean)
        else:
            mean = None
        return self._from_last_stage(mean)

    # ----- DeepSpeed's refusals -----
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _scaled(loss_fn: Any, scaler: LossScaler) -> Any:
    def scaled_loss(output: Any, target: Any) -> torch.Tensor:
        # In fp32: torch's sharded scaler hands back the loss's own dtype, and an fp16 loss times
        # 2**16 (DeepSpeed's initial scale) is already inf there.
        return scaler.scale(loss_fn(output, target).float())

    return scaled_loss


def _output_is_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """Without loss_fn the last stage's output is the loss (DeepSpeed's rule)."""
    return output
