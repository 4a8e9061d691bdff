"""The communication knobs the engine can change between optimizer steps, and which of them a
run may tune: only those the current ZeRO stage really has, and none the user fixed. Pure."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from autotuner.config.models import ZeroConfig
from autotuner.config.autotuning import OnlineConfig
from autotuner.core.errors import ConfigError

DDP_DEFAULT_BUCKET_CAP_MB = 25  # torch's DistributedDataParallel default
BUCKET_CAP_MB_CHOICES = tuple(2**p for p in range(0, 9))  # 2^20 .. 2^28 bytes, in MiB

DDP_KNOBS = ("bucket_cap_mb", "gradient_as_bucket_view")
FSDP_KNOBS = ("forward_prefetch", "backward_prefetch", "reshard_after_backward")
KNOB_NAMES = DDP_KNOBS + FSDP_KNOBS
KNOB_UNITS = {
    "bucket_cap_mb": "MiB of gradients per DDP bucket",
    "gradient_as_bucket_view": "gradients are views into DDP's buckets",
    "forward_prefetch": "FSDP2 blocks all-gathered ahead in forward",
    "backward_prefetch": "FSDP2 blocks all-gathered ahead in backward (1 is FSDP2's implicit default)",
    "reshard_after_backward": "reshard parameters after each accumulation micro-step's backward",
}


@dataclass(frozen=True)
class Knob:
    """One tunable knob: its ordered choices and the value training starts from."""

    name: str
    choices: tuple[Any, ...]
    start: Any


@dataclass(frozen=True)
class KnobPlan:
    """What an online run tunes (`tuned`), what it holds (`fixed`, with the key that fixed it),
    and what it leaves alone (`not_offered`, with why)."""

    engine: Literal["ddp", "fsdp"]
    tuned: tuple[Knob, ...]
    fixed: tuple[tuple[str, Any, str], ...] = ()
    not_offered: tuple[tuple[str, str], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.tuned)

    def dimensions(self) -> dict[str, tuple[Any, ...]]:
        return {k.name: k.choices for k in self.tuned}

    def start(self) -> dict[str, Any]:
        return {k.name: k.start for k in self.tuned}

    def fixed_values(self) -> dict[str, Any]:
        return {name: value for name, value, _ in self.fixed}

    def full(self, point: dict[str, Any]) -> dict[str, Any]:
        """Fixed knobs plus a tuned point: everything the engine must apply."""
        return {**self.fixed_values(), **point}


def _read_knob_file(path: str) -> dict[str, Any]:
    where = f"autotuning.online.knobs: {path}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; give a best_knobs.json written by an online run, or a dict "
                          "of knob values") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: not readable JSON ({err})") from None
    knobs = data.get("knobs") if isinstance(data, dict) else None
    if not isinstance(knobs, dict):
        raise ConfigError(f"{where}: has no \"knobs\" object; expected a best_knobs.json written by an online run")
    return knobs


def _check_value(name: str, value: Any, key: str) -> Any:
    if name in ("gradient_as_bucket_view", "reshard_after_backward"):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: got {value!r}; expected true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}: got {value!r}; expected a number")
    if name == "bucket_cap_mb":
        if value <= 0:
            raise ConfigError(f"{key}: got {value!r}; expected MiB > 0")
        return int(value) if float(value).is_integer() else float(value)
    if not float(value).is_integer() or not (0 if name == "forward_prefetch" else 1) <= value <= 2:
        allowed = "0, 1 or 2" if name == "forward_prefetch" else "1 or 2"
        raise ConfigError(f"{key}: got {value!r}; expected {allowed} blocks ahead")
    return int(value)


def user_fixed(zero: ZeroConfig, online: OnlineConfig) -> dict[str, tuple[Any, str]]:
    """Knobs the user fixed: by `autotuning.online.knobs` (a dict or a best_knobs.json), or by
    the DeepSpeed keys that set them (reduce_bucket_size, contiguous_gradients, overlap_comm)."""
    fixed: dict[str, tuple[Any, str]] = {}
    given = zero.model_fields_set
    if "reduce_bucket_size" in given and isinstance(zero.reduce_bucket_size, int):
        fixed["bucket_cap_mb"] = (_check_value("bucket_cap_mb", zero.reduce_bucket_size * 4 / 2**20,
                                               "zero_optimization.reduce_bucket_size"),
                                  "zero_optimization.reduce_bucket_size")
    if "contiguous_gradients" in given and isinstance(zero.contiguous_gradients, bool):
        fixed["gradient_as_bucket_view"] = (zero.contiguous_gradients, "zero_optimization.contiguous_gradients")
    if "overlap_comm" in given and isinstance(zero.overlap_comm, bool):
        fixed["forward_prefetch"] = (int(zero.overlap_comm), "zero_optimization.overlap_comm")
    knobs = online.knobs if isinstance(online.knobs, dict) else _read_knob_file(online.knobs)
    for name, value in knobs.items():
        key = f"autotuning.online.knobs.{name}"
        if name not in KNOB_NAMES:
            raise ConfigError(f"autotuning.online.knobs: '{name}' is not a knob; knobs are {', '.join(KNOB_NAMES)}")
        value = _check_value(name, value, key)
        if name in fixed and fixed[name][0] != value:
            raise ConfigError(f"{key}: {value!r} disagrees with {fixed[name][1]} (which sets {fixed[name][0]!r}); "
                              "fix the knob in one place")
        fixed[name] = (value, key)
    return fixed


def _offered(stage: int, world_size: int, gradient_accumulation_steps: int,
             shard_units: int) -> tuple[dict[str, Knob], dict[str, str]]:
    if world_size < 2:
        why = "one rank: no gradient communication to tune"
        return {}, {name: why for name in (DDP_KNOBS if stage < 2 else FSDP_KNOBS)}
    if stage < 2:
        choices = tuple(sorted(set(BUCKET_CAP_MB_CHOICES) | {DDP_DEFAULT_BUCKET_CAP_MB}))
        return {"bucket_cap_mb": Knob("bucket_cap_mb", choices, DDP_DEFAULT_BUCKET_CAP_MB),
                "gradient_as_bucket_view": Knob("gradient_as_bucket_view", (False, True), False)}, {}
    offered: dict[str, Knob] = {}
    skipped: dict[str, str] = {}
    if shard_units >= 2:
        offered["forward_prefetch"] = Knob("forward_prefetch", tuple(range(0, min(2, shard_units - 1) + 1)), 0)
    else:
        skipped["forward_prefetch"] = "fewer than 2 sharded blocks: nothing to prefetch"
    if shard_units >= 3:
        offered["backward_prefetch"] = Knob("backward_prefetch", (1, 2), 1)
    else:
        skipped["backward_prefetch"] = "fewer than 3 sharded blocks: FSDP2's one-ahead default is all there is"
    if stage == 2 and gradient_accumulation_steps > 1:
        offered["reshard_after_backward"] = Knob("reshard_after_backward", (True, False), True)
    else:
        # ZeRO-3 keeps parameters sharded between micro-steps for memory: not ours to give up.
        skipped["reshard_after_backward"] = ("ZeRO 3 keeps parameters sharded" if stage == 3
                                             else "gradient_accumulation_steps is 1: no micro-steps between")
    return offered, skipped


def plan_knobs(*, stage: int, zero: ZeroConfig, online: OnlineConfig, world_size: int,
               gradient_accumulation_steps: int, shard_units: int) -> KnobPlan:
    """The knobs of this run: those the stage has, less those the user fixed."""
    engine: Literal["ddp", "fsdp"] = "ddp" if stage < 2 else "fsdp"
    fixed = user_fixed(zero, online)
    mine = DDP_KNOBS if engine == "ddp" else FSDP_KNOBS
    for name, (_, key) in fixed.items():
        if name not in mine and key.startswith("autotuning.online.knobs"):
            raise ConfigError(f"{key}: ZeRO stage {stage} has no {name} ({'FSDP2' if engine == 'ddp' else 'DDP'} "
                              f"knob); this stage's knobs are {', '.join(mine)}")
    offered, skipped = _offered(stage, world_size, gradient_accumulation_steps, shard_units)
    tuned = tuple(knob for name, knob in offered.items() if name not in fixed)
    held = tuple((name, value, key) for name, (value, key) in fixed.items() if name in mine)
    return KnobPlan(engine, tuned, held, tuple(skipped.items()))
