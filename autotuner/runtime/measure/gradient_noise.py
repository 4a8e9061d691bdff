"""The gradient noise scale's raw figures, read in a tuner's launch at ZeRO 0 and 1 (DDP), or on
one rank with gradient accumulation (its micro-steps).

McCandlish et al. (2018), appendix A.1: the squared norm of a gradient averaged over B samples
has expectation |G|^2 + tr(Sigma)/B. Each rank's gradient before the all-reduce averages
B_small = micro-batch x gas samples; the all-reduced one averages B_big = B_small x ranks. So a
DDP communication hook reads each bucket's squared norm before the all-reduce and after it; at
the accumulation boundary the ranks' local figures are averaged (one scalar all-reduce), and the
step's pair (mean |g_small|^2, |g_big|^2) is kept. On one rank, `MicroStepNoiseProbe` gives the
same pairs from the micro-steps of an accumulation window. The estimator (core/noise_scale.py) is
the tuner's over a profile's steps, and a training run's smoothed over its steps. Nothing here changes the reduction: the hook runs the same one
(DeepSpeed's prescale/predivide hook when the config sets it, else DDP's mean all-reduce).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from autotuner.runtime.training.grad_reduction import GradientReduction, ddp_reduction_hook

FIRST_STEP = 2  # step 1's gradients come from the initial weights: kept out, as the warm-up is


class GradientNoiseProbe:
    """Per optimizer step from FIRST_STEP: (mean over ranks of |g_local|^2, |g_reduced|^2)."""

    def __init__(self, reduction: "GradientReduction | None", samples_per_rank: int, world_size: int):
        self.reduction = reduction
        self.samples_per_rank = samples_per_rank  # B_small: micro-batch x gas
        self.world_size = world_size
        self.steps: list = []
        self._local = torch.zeros((), dtype=torch.float64)
        self._reduced = torch.zeros((), dtype=torch.float64)
        self._buckets = 0

    @property
    def batches(self) -> tuple[int, int]:
        """(B_small, B_big): the samples behind one rank's gradient, and behind the reduced one."""
        return self.samples_per_rank, self.samples_per_rank * self.world_size

    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        local = _squared_norm(bucket.buffer())  # before the reduction touches it
        if self.reduction is not None:
            future = ddp_reduction_hook(self.reduction, bucket)
        else:
            future = default_hooks.allreduce_hook(None, bucket)

        def reduced(done):
            tensor = done.value()
            self._local = self._local.to(local.device) + local
            self._reduced = self._reduced.to(tensor.device) + _squared_norm(tensor)
            self._buckets += 1
            return tensor

        return future.then(reduced)

    def step_done(self, step: int, whole: bool) -> None:
        """At the accumulation boundary, after backward (every bucket reduced), on every rank.
        `whole`: DDP reduced every bucket itself this step (no manual averaging after it)."""
        if self._buckets and whole and step >= FIRST_STEP:
            figures = torch.stack([self._local, self._reduced]).to(torch.float64)
            dist.all_reduce(figures)
            local_sum, reduced_sum = figures.tolist()
            self.steps.append((local_sum / self.world_size, reduced_sum / self.world_size))
        self._local = torch.zeros((), dtype=torch.float64)
        self._reduced = torch.zeros((), dtype=torch.float64)
        self._buckets = 0


class MicroStepNoiseProbe:
    """One rank with gradient accumulation: a hook on each parameter reads its gradient of each
    micro-step as it arrives, before it is added to .grad. Over an accumulation window of `gas`
    micro-steps, the mean of their squared norms averages B_small = micro-batch samples; at the
    boundary, |accumulated / gas|^2 averages B_big = micro-batch x gas. A loss divided by gas (or
    not, `scale_wrt_gas=False`) scales both figures alike, and B_noise is a ratio, so it cancels."""

    def __init__(self, parameters: "list[torch.nn.Parameter]", micro_batch_size: int, gas: int):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.batches = (micro_batch_size, micro_batch_size * gas)
        self.gas = gas
        self.steps: list = []
        self._micro = torch.zeros((), dtype=torch.float64)
        for parameter in self.parameters:
            parameter.register_hook(self._read)

    def _read(self, gradient: torch.Tensor) -> None:
        self._micro = self._micro.to(gradient.device) + _squared_norm(gradient)  # returns None: gradient kept

    def step_done(self, step: int, whole: bool) -> None:
        """At the accumulation boundary, after the last backward, before the optimizer step."""
        if step >= FIRST_STEP:
            accumulated = sum((_squared_norm(p.grad) for p in self.parameters if p.grad is not None),
                              torch.zeros((), dtype=torch.float64))
            self.steps.append((float(self._micro) / self.gas, float(accumulated) / self.gas ** 2))
        self._micro = torch.zeros((), dtype=torch.float64)


class DeepSpeedNoiseProbe:
    """DeepSpeed's own engine at ZeRO 0 (fp32 or bf16), two ranks or more, data parallel only: its
    accumulation boundary reduces the gradients in `buffered_allreduce_fallback`, in place, so the
    same figures as `GradientNoiseProbe`'s are read around that call, from the very tensors it
    reduces (the bf16 optimizer's fp32 accumulators where it keeps them; tested at fp32 only).
    `unusable` says why not where DeepSpeed reduces elsewhere (ZeRO 1-3's optimizers, tensor or
    pipeline parallelism) or a loss scale moves the norms (fp16)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.world_size = int(engine.dp_world_size)
        self.samples_per_rank = int(engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps())
        self.steps: list = []
        original = engine.buffered_allreduce_fallback

        def read_around(*args, **kwargs):
            local = self._squared_norm()
            result = original(*args, **kwargs)
            self._step_read(local, self._squared_norm())
            return result

        engine.buffered_allreduce_fallback = read_around  # this engine only; DeepSpeed's class is untouched

    @staticmethod
    def unusable(engine) -> str | None:
        """Why the noise cannot be read on this DeepSpeedEngine, or None."""
        if getattr(engine, "zenflow", False):
            return "ZenFlow on DeepSpeed's engine (it keeps its own step boundaries)"
        if getattr(engine, "has_moe_layers", False):
            return "MoE layers on DeepSpeed's engine (their experts reduce over their own groups)"
        if int(engine.zero_optimization_stage()) != 0:
            return f"ZeRO {int(engine.zero_optimization_stage())} on DeepSpeed's engine (its optimizer reduces the gradients)"
        if engine.fp16_enabled():
            return "fp16 (its loss scale changes the norms)"
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world < 2 or int(engine.dp_world_size) != world:
            return ("one rank (no smaller batch to compare with)" if world < 2 else
                    "model parallelism on DeepSpeed's engine (a rank's gradient is a shard)")
        return None

    @property
    def batches(self) -> tuple[int, int]:
        return self.samples_per_rank, self.samples_per_rank * self.world_size

    def _squared_norm(self) -> torch.Tensor:
        engine = self.engine
        getter = getattr(engine.optimizer, "get_grads_for_reduction", None)  # DeepSpeed's bf16 optimizer
        grads = getter()[0] if getter is not None else engine._get_gradients_for_reduction()[0]
        total = torch.zeros((), dtype=torch.float64)
        for gradient in grads:
            if gradient is not None:
                total = total.to(gradient.device) + _squared_norm(gradient)
        return total

    def _step_read(self, local: torch.Tensor, reduced: torch.Tensor) -> None:
        if self.engine.global_steps + 1 < FIRST_STEP:
            return
        figures = torch.stack([local, reduced.to(local.device)]).to(torch.float64)
        dist.all_reduce(figures)  # every rank reduced here, at the same boundary
        local_sum, reduced_sum = figures.tolist()
        self.steps.append((local_sum / self.world_size, reduced_sum / self.world_size))


def _squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """A reduction, with no copy of the bucket: a float64 copy of each 25 MiB bucket raised a CPU
    rank's resident peak by about 200 MiB, which the launch then reported as its own."""
    return torch.linalg.vector_norm(tensor.detach()).double().pow(2)


def gradient_noise_hook(probe: GradientNoiseProbe, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the probe's reading around the run's own reduction."""
    return probe.hook(bucket)
