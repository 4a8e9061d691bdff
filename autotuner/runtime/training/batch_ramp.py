"""The global batch grown through training as goodput says (Pollux, OSDI'21, on a DeepSpeed config).

With `autotuning.adapt_batch` the training run keeps reading the gradient noise scale (the same
probe as a goodput tune's launches, core/noise_scale.py's smoothed estimator), and every
`adapt_interval` optimizer steps asks which global batch reaches the loss soonest: goodput =
throughput x (B_noise + B0) / (B_noise + B), B0 the batch the learning rate was chosen for. The
throughput of a batch comes from what the tune measured at the pick's micro-batch (`StepCost`:
the time of a micro-step's forward and backward, and the rest of an optimizer step), so a step of
g micro-steps takes g x micro_step_s + step_s (the optimizer step, timed by the engine, is what a
larger count amortises; the rest of a step counts per micro-step, so the gain is never
overstated). Until the run has read B_noise itself, the tune's stands in. Gradient accumulation
grows on any engine; the micro-batch too where the script trains on the engine's own loader (a
`ResizableBatchSampler`, and the script drew from it), and only to sizes the tune launched at the
pick's configuration and that ran within its memory budget (the plan's costs). The global batch
never shrinks, and changes at most once an interval.

Every rank computes the same B_noise (the probe's figures are all-reduced), but rank 0 decides
and broadcasts its decision, as the online tuner does, so every rank changes at the same step.
The learning rate is scaled by `lr_scaling` against the batch it was set for: a factor the
engine keeps over the schedule's own value (`scaled_schedule`). Each change is a row of the CSV.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from autotuner.core.noise_scale import SmoothedNoiseScale, scaled_learning_rate, statistical_efficiency

CSV_FIELDS = ("step", "b_noise", "global_batch", "micro_batch_size", "gradient_accumulation_steps", "lr",
              "predicted_goodput")
LAST_FILE = "batch_ramp_last.json"  # beside the CSV: the run's latest B_noise
WORTHWHILE = 1.03  # a change must promise this much more goodput (the run-to-run noise of a step time)


@dataclass(frozen=True)
class StepCost:
    """One micro-batch size's step time as the tune measured it."""

    micro_batch_size: int
    micro_step_s: float  # forward and backward of one micro-batch
    step_s: float  # the rest of an optimizer step: the reduction, the optimizer

    def throughput(self, gas: int, data_parallel_size: int) -> float:
        return self.micro_batch_size * gas * data_parallel_size / (gas * self.micro_step_s + self.step_s)


@dataclass(frozen=True)
class RampPlan:
    """What the tuner hands the training run (`<results_dir>/batch_ramp.json`)."""

    reference_batch: int
    lr_scaling: str
    interval: int
    costs: tuple[StepCost, ...]
    max_global_batch: int | None = None
    csv_path: str = ""
    initial_b_noise: float | None = None  # the tune's (the profile's, or the critical batch it was given)

    def to_json(self) -> dict[str, Any]:
        return {"reference_batch": self.reference_batch, "lr_scaling": self.lr_scaling, "interval": self.interval,
                "costs": [vars(cost) for cost in self.costs], "max_global_batch": self.max_global_batch,
                "csv_path": self.csv_path, "initial_b_noise": self.initial_b_noise}

    @classmethod
    def read(cls, path: str | Path) -> "RampPlan":
        data = json.loads(Path(path).read_text())
        return cls(int(data["reference_batch"]), str(data["lr_scaling"]), int(data["interval"]),
                   tuple(StepCost(int(c["micro_batch_size"]), float(c["micro_step_s"]), float(c["step_s"]))
                         for c in data["costs"]),
                   data.get("max_global_batch"), str(data.get("csv_path") or ""), data.get("initial_b_noise"))

    def cost(self, micro_batch_size: int) -> StepCost | None:
        return next((c for c in self.costs if c.micro_batch_size == micro_batch_size), None)


@dataclass(frozen=True)
class Choice:
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch: int
    predicted_goodput: float
    current_goodput: float
    b_noise: float | None = None  # what the choice was made at


def goodput(cost: StepCost, gas: int, dp: int, b_noise: float, reference_batch: int) -> float:
    batch = cost.micro_batch_size * gas * dp
    return cost.throughput(gas, dp) * statistical_efficiency(batch, reference_batch, b_noise)


def best_batch(plan: RampPlan, b_noise: float, micro_batch_size: int, gas: int, dp: int,
               grow_micro: bool = False) -> Choice | None:
    """The (micro-batch, accumulation count) with the most goodput at `b_noise` whose global batch
    is at least today's (None: the tune measured no cost at today's micro-batch). The micro-batch
    stays unless `grow_micro`, and then only grows, to the sizes the plan has costs for. For each
    size, past the optimum goodput only falls, so the search stops at the first decline beyond the
    batch B_noise would ask for."""
    cost = plan.cost(micro_batch_size)
    if cost is None:
        return None
    batch = micro_batch_size * gas * dp
    current = goodput(cost, gas, dp, b_noise, plan.reference_batch)
    best = Choice(micro_batch_size, gas, batch, current, current)
    sizes = [c for c in plan.costs if c.micro_batch_size > micro_batch_size] if grow_micro else []
    for size in [cost, *sizes]:
        candidate = gas if size is cost else max(1, -(-batch // (size.micro_batch_size * dp)))
        while True:
            global_batch = size.micro_batch_size * candidate * dp
            if plan.max_global_batch is not None and global_batch > plan.max_global_batch:
                break
            value = goodput(size, candidate, dp, b_noise, plan.reference_batch)
            if value > best.predicted_goodput:
                best = Choice(size.micro_batch_size, candidate, global_batch, value, current)
            elif global_batch > 4 * max(b_noise, best.global_batch):
                break
            candidate += 1
    return best


class BatchRamp:
    """The engine's ramp: fed each optimizer step's noise pairs, it changes the engine's gas and
    learning-rate factor at the interval's boundaries; its state goes into checkpoints."""

    def __init__(self, plan: RampPlan, rank: int):
        self.plan = plan
        self.rank = rank
        self.estimator = SmoothedNoiseScale(window=plan.interval)
        self.lr_factor = 1.0  # over the schedule's own learning rate
        self.last_change = 0  # the step of the last change (0: none)

    def observe(self, pairs: list[tuple[float, float]], batches: tuple[int, int]) -> None:
        for g_small, g_big in pairs:
            self.estimator = self.estimator.with_step(g_small, g_big, *batches)

    def decide(self, step: int, micro_batch_size: int, gas: int, dp: int, grow_micro: bool = False) -> Choice | None:
        """At an interval's boundary: rank 0's choice (another micro-batch or count, the global batch
        no smaller), broadcast; None to stay."""
        if step % self.plan.interval or step - self.last_change < self.plan.interval:
            return None
        b_noise = self.estimator.b_noise or self.plan.initial_b_noise  # the tune's until the run reads its own
        proposal = torch.tensor([float(micro_batch_size), float(gas), 0.0, 0.0, 0.0], dtype=torch.float64)
        if self.rank == 0 and b_noise is not None:
            choice = best_batch(self.plan, b_noise, micro_batch_size, gas, dp, grow_micro)
            if choice is not None and (choice.micro_batch_size, choice.gradient_accumulation_steps) != \
                    (micro_batch_size, gas) and choice.predicted_goodput > WORTHWHILE * choice.current_goodput:
                proposal = torch.tensor([float(choice.micro_batch_size), float(choice.gradient_accumulation_steps),
                                         choice.predicted_goodput, choice.current_goodput, b_noise], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(proposal, 0)
        new_micro, new_gas = int(proposal[0]), int(proposal[1])
        if (new_micro, new_gas) == (micro_batch_size, gas):
            return None
        return Choice(new_micro, new_gas, new_micro * new_gas * dp, float(proposal[2]), float(proposal[3]),
                      float(proposal[4]))

    def write_row(self, step: int, global_batch: int, micro: int, gas: int, lr: float, predicted: float | None,
                  b_noise: float | None) -> None:
        """A row of the CSV (rank 0 only): what the ranks applied at `step`, at `b_noise`."""
        if self.rank != 0 or not self.plan.csv_path:
            return
        path = Path(self.plan.csv_path)
        new = not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", newline="") as handle:
            writer = csv.writer(handle)
            if new:
                writer.writerow(CSV_FIELDS)
            writer.writerow([step, "" if b_noise is None else f"{b_noise:.6g}", global_batch, micro, gas, f"{lr:.6g}",
                             "" if predicted is None or not math.isfinite(predicted) else f"{predicted:.6g}"])

    def write_last(self, step: int, global_batch: int) -> None:
        """The run's own B_noise so far (rank 0, beside the CSV, each interval): the late figure the
        tuner keeps in its history once training ends."""
        if self.rank != 0 or not self.plan.csv_path:
            return
        from autotuner.core.atomic import write_json_atomic

        write_json_atomic(Path(self.plan.csv_path).with_name(LAST_FILE),
                          {"step": step, "b_noise": self.estimator.b_noise, "global_batch": global_batch,
                           "steps_read": self.estimator.steps})

    def state(self) -> dict[str, Any]:
        return {"estimator": self.estimator.state(), "lr_factor": self.lr_factor, "last_change": self.last_change}

    def load(self, state: dict[str, Any]) -> None:
        self.estimator = SmoothedNoiseScale.from_state(state["estimator"])
        self.lr_factor = float(state["lr_factor"])
        self.last_change = int(state["last_change"])


@contextlib.contextmanager
def scaled_schedule(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """The schedule steps on its own rates (the factor taken off), then the factor goes back on:
    a closed-form schedule (warm-up, decay) overwrites the rate, a chained one multiplies it, and
    either way the ramp's factor is applied once."""
    if factor == 1.0:
        yield
        return
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] / factor
    try:
        yield
    finally:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor


def rescale(optimizer: torch.optim.Optimizer, old_factor: float, new_factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * new_factor / old_factor



def ramp_after_step(engine: Any) -> None:
    """After the engine's optimizer step: the step's noise pairs to the estimator, then (at an
    interval's boundary) rank 0's choice applied on every rank: the engine's gas, its learning-rate
    factor, the noise probe's batch sizes, and a row of the CSV."""
    ramp: BatchRamp = engine._ramp
    noise = engine._noise
    if getattr(engine, "_boundary_override", None) is not None:
        from autotuner.runtime.distributed import warn_once

        warn_once("autotuning.adapt_batch: the script sets the accumulation boundary itself "
                  "(set_gradient_accumulation_boundary), so a count the ramp set would not hold; the batch stays")
        return
    if noise is not None and noise.steps:
        ramp.observe(list(noise.steps), tuple(noise.batches))
        noise.steps.clear()
    step, batch = engine.global_steps, engine.batch
    if step == 1 and ramp.last_change == 0:
        ramp.write_row(0, batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps,
                       engine.get_lr()[0], None, ramp.plan.initial_b_noise)
    if step % ramp.plan.interval == 0:
        ramp.write_last(step, batch.train_batch_size)
    loader = engine_loader(engine)
    choice = ramp.decide(step, batch.micro_batch_size, batch.gradient_accumulation_steps, batch.data_parallel_size,
                         grow_micro=loader is not None and loader.drawn > 0)
    if choice is None:
        return
    new_factor = ramp.lr_factor * scaled_learning_rate(1.0, choice.global_batch, batch.train_batch_size,
                                                        ramp.plan.lr_scaling)
    resize(engine, choice.micro_batch_size, choice.global_batch)
    rescale(engine.optimizer, ramp.lr_factor, new_factor)
    ramp.lr_factor, ramp.last_change = new_factor, step
    follow_batch(noise, engine.batch)
    ramp.write_row(step, choice.global_batch, choice.micro_batch_size, choice.gradient_accumulation_steps,
                   engine.get_lr()[0], choice.predicted_goodput, choice.b_noise)


def resize(engine: Any, micro_batch_size: int, train_batch_size: int) -> None:
    """Between optimizer steps: the engine's micro-batch (DeepSpeed's set_train_micro_batch_size,
    and the engine's own loader with it), then its global batch (set_train_batch_size: the count)."""
    if micro_batch_size != engine.batch.micro_batch_size:
        engine.set_train_micro_batch_size(micro_batch_size)
        loader = engine_loader(engine)
        if loader is None:
            raise RuntimeError("batch ramp: the micro-batch changes only with the engine's own loader")
        loader.batch_size = micro_batch_size
    engine.set_train_batch_size(train_batch_size)


def engine_loader(engine: Any) -> "ResizableBatchSampler | None":
    """The batch sampler of the loader the engine built, where it can change its size."""
    sampler = getattr(getattr(engine, "training_dataloader", None), "batch_sampler", None)
    return sampler if isinstance(sampler, ResizableBatchSampler) else None


class ResizableBatchSampler(torch.utils.data.Sampler):
    """The engine's loader under a batch ramp: batches of `batch_size` indices from `sampler` (each
    rank's DistributedSampler), the size read as each batch starts, so a change between optimizer
    steps holds from the next micro-step (the loader's workers, if any, may have a few batches of the
    old size queued: the engine builds its loader without them). `drawn` counts the batches handed
    out: none means the script trains on a loader of its own, whose batches the engine cannot grow."""

    def __init__(self, sampler: torch.utils.data.Sampler, batch_size: int):
        self.sampler = sampler
        self.batch_size = batch_size
        self.drawn = 0

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) >= self.batch_size:
                self.drawn += 1
                yield batch
                batch = []  # the tail of an epoch shorter than a batch is dropped, as drop_last does

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size


def follow_batch(noise: Any, batch: Any) -> None:
    """The noise probe counts the samples behind its figures from the batch it reads."""
    if noise is None:
        return
    if hasattr(noise, "samples_per_rank"):  # around the all-reduce: B_small = micro-batch x gas
        noise.samples_per_rank = batch.micro_batch_size * batch.gradient_accumulation_steps
    else:  # over one rank's micro-steps
        noise.batches = (batch.micro_batch_size, batch.micro_batch_size * batch.gradient_accumulation_steps)
        noise.gas = batch.gradient_accumulation_steps


def ramp_wanted(config: Any) -> bool:
    """The training run of a goodput tune's pick with autotuning.adapt_batch (its plan written by the tuner)."""
    tuning = config.autotuning
    return bool(tuning.adapt_batch and tuning.adapt_plan)


def batch_ramp(config: Any, rank: int, noise_read: bool, stage: int) -> BatchRamp | None:
    """The ramp for this run, or None; where the gradient noise cannot be read here, one warning
    says the batch stays as it is."""
    if not ramp_wanted(config):
        return None
    if not noise_read:
        from autotuner.runtime.distributed import warn_once

        why = ("ZeRO 2-3 (FSDP2 reduce-scatters the gradients)" if stage >= 2 else
               "fp16 (its loss scale changes the norms)" if config.precision == "fp16" else
               "one rank without gradient accumulation (no smaller batch to compare with)")
        warn_once(f"autotuning.adapt_batch: the gradient noise is not read with {why}; the global batch stays "
                  "as the optimal config sets it")
        return None
    return BatchRamp(RampPlan.read(config.autotuning.adapt_plan), rank)
