"""Optimizers and learning-rate schedules named by the config, with DeepSpeed's semantics."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import sys
from typing import Any, Callable, Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler

from autotuner.config.models import SCHEDULER_DEFAULTS, DeepSpeedConfig, OptimizerConfig, SchedulerConfig
from autotuner.config.trainer_auto import with_stand_ins
from autotuner.core.errors import ConfigError
from autotuner.runtime.distributed import warn_once

# DeepSpeed-only optimizer params: they choose its fused kernels, which we do not use.
_DEEPSPEED_ONLY_OPTIMIZER_PARAMS = {"torch_adam", "adam_w_mode"}


def optimizer_class(config: OptimizerConfig) -> type[torch.optim.Optimizer]:
    """DeepSpeed's "Adam" decouples weight decay (adam_w_mode defaults to true), i.e. AdamW."""
    if config.type == "SGD":
        return torch.optim.SGD
    if config.type == "AdamW" or config.params.get("adam_w_mode", True):
        return torch.optim.AdamW
    return torch.optim.Adam


def optimizer_kwargs(config: OptimizerConfig) -> dict[str, Any]:
    """The config's params, checked against the torch optimizer's signature."""
    cls = optimizer_class(config)
    allowed = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    kwargs = {}
    for key, value in config.params.items():
        if key in _DEEPSPEED_ONLY_OPTIMIZER_PARAMS:
            continue
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(sorted(allowed))}"
            raise ConfigError(f"optimizer.params.{key}: not a parameter of torch.optim.{cls.__name__}; {hint}")
        kwargs[key] = tuple(value) if key == "betas" else value
    if config.type in ("Adam", "AdamW") and not config.params.get("torch_adam", False):
        # DeepSpeed builds its FusedAdam (CPU Adam when offloading), whose weight_decay defaults to
        # 0; torch's AdamW's to 0.01. torch_adam: true is torch's own class, with torch's default.
        kwargs.setdefault("weight_decay", 0.0)
    return kwargs


def build_optimizer(config: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    cls = optimizer_class(config)
    try:
        return cls(params, **optimizer_kwargs(config))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optimizer.params: torch.optim.{cls.__name__} refused them: {err}") from err


def _warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of warm-up done at schedule position `step` (DeepSpeed's log or linear ramp;
    `warmup_num_steps` at least 2, as DeepSpeed clamps it)."""
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


def _scheduler_params(config: SchedulerConfig) -> dict[str, Any]:
    defaults = SCHEDULER_DEFAULTS[config.type]
    for key in config.params:
        if key not in defaults and key != "last_batch_iteration":
            raise ConfigError(
                f"scheduler.params.{key}: not a parameter of {config.type}; allowed: {', '.join(sorted(defaults))}"
            )
    params = {**defaults, **{k: v for k, v in config.params.items() if k != "last_batch_iteration"}}
    if "total_num_steps" in params and not params["total_num_steps"]:
        raise ConfigError(f"scheduler.params.total_num_steps: required by {config.type}; give a positive integer")
    if params["warmup_type"] not in ("log", "linear"):
        raise ConfigError(f"scheduler.params.warmup_type: got {params['warmup_type']!r}; expected \"log\" or \"linear\"")
    steps = params["warmup_num_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ConfigError(f"scheduler.params.warmup_num_steps: got {steps!r}; expected a positive integer (as "
                          "DeepSpeed's schedules require)")
    position = config.params.get("last_batch_iteration", -1)
    if isinstance(position, bool) or not isinstance(position, int) or position < -1:
        raise ConfigError(f"scheduler.params.last_batch_iteration: got {position!r}; expected -1 (a fresh schedule) "
                          "or the position to resume at")
    return params


def lr_function(config: SchedulerConfig) -> Callable[[int, float], float]:
    """lr(step, base_lr) for the configured schedule; `step` counts scheduler steps from 0."""
    p = _scheduler_params(config)
    warmup = max(2, int(p["warmup_num_steps"]))  # DeepSpeed's clamp
    if config.type in ("WarmupLR", "WarmupDecayLR"):
        low = float(p["warmup_min_lr"])
        total = int(p.get("total_num_steps") or 0)

        def absolute(step: int, base_lr: float) -> float:
            high = base_lr if p["warmup_max_lr"] is None else float(p["warmup_max_lr"])
            if step < 0:  # not started: DeepSpeed's min_lrs
                return low
            if config.type == "WarmupDecayLR" and step >= warmup:
                return low + (high - low) * max(0.0, (total - step) / max(1.0, float(total - warmup)))
            return low + (high - low) * _warmup_gamma(step, warmup, p["warmup_type"])

        return absolute

    total = int(p["total_num_steps"])
    min_ratio, cos_min = float(p["warmup_min_ratio"]), float(p["cos_min_ratio"])

    def cosine(step: int, base_lr: float) -> float:
        if step < 0:  # not started: DeepSpeed's ratio 0
            return 0.0
        if step < warmup:
            ratio = min_ratio + (1.0 - min_ratio) * _warmup_gamma(step, warmup, p["warmup_type"])
        else:
            # DeepSpeed counts the first post-warm-up step as 1; past the total we hold the minimum.
            progress = min(1.0, (step - warmup + 1) / max(1, total - warmup))
            ratio = cos_min + (1.0 - cos_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return base_lr * ratio

    return cosine


class DeepSpeedStyleLR(LRScheduler):
    """An LRScheduler that sets each group's lr to lr_fn(position, base_lr), positioned as DeepSpeed's
    schedules are: built at `last_batch_iteration` (-1: not started, the rates set to position -1's;
    else the optimizer's rates left as they are), each step() one position on. So the first
    optimizer step trains at position -1 and step k at k - 2, as on DeepSpeed's engine, which
    steps its schedule after each optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_fn: Callable[[int, float], float],
                 last_batch_iteration: int = -1):
        self.lr_fn = lr_fn
        self._start = last_batch_iteration
        super().__init__(optimizer, -1)  # torch's constructor calls step() once: step() takes it as the start

    def get_lr(self) -> list[float]:
        return [self.lr_fn(self.last_epoch, base) for base in self.base_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """DeepSpeed's schedules' step: the next position, or the one given (torch's `epoch`
        argument, without its deprecation path)."""
        if self._start is not None:  # torch's constructor steps once: that is the start, not a step
            self.last_epoch, start, self._start = self._start, self._start, None
            if start != -1:
                self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
                return
        else:
            self.last_epoch = self.last_epoch + 1 if last_batch_iteration is None else int(last_batch_iteration)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_fn")}


def build_scheduler(config: SchedulerConfig, optimizer: torch.optim.Optimizer) -> LRScheduler:
    return DeepSpeedStyleLR(optimizer, lr_function(config), int(config.params.get("last_batch_iteration", -1)))


def step_scheduler(scheduler: Any, lr_kwargs: dict[str, Any] | None, train_batch_size: int) -> None:
    """DeepSpeed's scheduler step: `step(**lr_kwargs)`; a scheduler whose step refuses those keywords
    (TypeError) is stepped with the train batch size as its position instead. That fallback is
    DeepSpeed's own (kept for Megatron's schedulers): scripts trained on it get the same schedule here.
    It is said once, since it pins a position-based schedule to that step."""
    try:
        scheduler.step(**(lr_kwargs or {}))
    except TypeError:
        if lr_kwargs:
            warn_once(f"{type(scheduler).__name__}.step() does not take lr_kwargs {sorted(lr_kwargs)}; as DeepSpeed's "
                      f"engine does, it is stepped to the train batch size ({train_batch_size}) instead")
        scheduler.step(train_batch_size)


@contextlib.contextmanager
def _add_param_group_unwrapped():
    """torch.optim wraps Optimizer.add_param_group in dynamo's disable, whose first call imports
    torch._dynamo: 1.2 s of a launcher's start on 2 CPU cores, before any rank starts. A check
    compiles nothing, so while it runs the wrapper is told (through the cache it keeps on the
    function) that the function itself is its disabled form; afterwards the wrapper is as it was."""
    wrapped = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if wrapped is None or "torch._dynamo" in sys.modules or hasattr(wrapped, "__dynamo_disable"):
        yield
        return
    setattr(wrapped, "__dynamo_disable", wrapped)
    try:
        yield
    finally:
        delattr(wrapped, "__dynamo_disable")


def check_optimizer_and_scheduler(config: DeepSpeedConfig, source: str) -> None:
    """Build the configured optimizer and schedule on one dummy parameter, as every rank would,
    so a misspelt or impossible param is refused before anything is launched. Params left "auto"
    are checked with stand-ins: the Trainer fills them in; our engine refuses them itself."""
    with _add_param_group_unwrapped():
        _check_optimizer_and_scheduler(config, source)


def _check_optimizer_and_scheduler(config: DeepSpeedConfig, source: str) -> None:
    try:
        if config.optimizer is not None:
            checked = config.optimizer.model_copy(update={"params": with_stand_ins(config.optimizer.params)})
            optimizer = build_optimizer(checked, [torch.zeros(1, requires_grad=True)])
        else:
            optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        if config.scheduler is not None:
            build_scheduler(config.scheduler.model_copy(update={"params": with_stand_ins(
                config.scheduler.params)}), optimizer)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    except (TypeError, ValueError) as err:
        section = "scheduler" if config.optimizer is None else "optimizer/scheduler"
        raise ConfigError(f"{source}: {section}.params: refused: {err}") from None


def remap_groups(params: Iterable, id_to_name: dict[int, str], new_by_name: dict[str, torch.nn.Parameter]) -> list[dict]:
    """Param groups pointing at the wrapped model's parameters (FSDP2 replaces them with DTensors)."""
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    remapped = []
    for group in groups:
        new_params = []
        for param in group["params"]:
            name = id_to_name.get(id(param))
            if name is None:
                raise ConfigError("model_parameters/optimizer hold a tensor that is not a parameter of the model")
            new_params.append(new_by_name[name])
        remapped.append({**group, "params": new_params})
    return remapped
