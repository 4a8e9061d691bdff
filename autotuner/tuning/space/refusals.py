"""The built-in dimensions' own refusals, which their declarations carry (dimensions.py) and the
checks before a tune (app/settle.py) and for DeepSpeed's engine (app/engines.py) call for every
registered dimension, naming none. Each raises ConfigError (exit 2) in one line, or returns.

A tune refusal takes (dimension, config, source); a DeepSpeed-engine refusal takes (dimension,
config, source, why: the reason the script trains on DeepSpeed's engine, arg_mappings).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from autotuner.config.tuned_values import lookup
from autotuner.core.engine_kind import Engine
from autotuner.core.errors import ConfigError

# The dimension a refusal is declared on (dimensions.py's Dimension, which imports this module:
# typed loosely here so the two do not import each other).
Dimension = Any
TuneRefusal = Callable[[Dimension, Any, str], None]
DeepSpeedRefusal = Callable[[Dimension, Any, str, str, Mapping[str, str]], None]


def compile_before_the_window(dim: Dimension, config: Any, source: str) -> None:
    """Compiling happens in the first step, which must fall before the timed window."""
    start = config.autotuning.start_profile_step
    if lookup(config.to_dict(), dim.path)[1] == "auto" and start < 2:
        raise ConfigError(f"{source}: autotuning.start_profile_step: got {start}; with {'.'.join(dim.path)} "
                          "\"auto\" it must be at least 2, so compiling (in the first step) falls before the timed "
                          "window, where it is measured as a one-off")


def deepspeed_values(dim: Dimension) -> tuple[Any, ...]:
    """The values the dimension takes on DeepSpeed's engine, in its own order."""
    return tuple(dict.fromkeys(v for per_stage in dim.values.get(Engine.DEEPSPEED, {}).values() for v in per_stage))


def script_applied(dim: Dimension, value: Any, used: bool, source: str, why: str, mapped: Mapping[str, str]) -> None:
    """A key the script applies on DeepSpeed's engine: mapped to the script's flag, with values the
    flag can express; else, where `used`, refused in one line (the dimension's own text and flag)."""
    key, allowed = ".".join(dim.path), deepspeed_values(dim)
    if key not in mapped:
        if used:
            verb = "tuned" if value == "auto" or isinstance(value, list) else "applied"
            raise ConfigError(f"{source}: {key}: {json.dumps(value)} is {verb} by our engine only, but {why}; "
                              f"on DeepSpeed's engine {dim.script_applies or 'the script applies it'}: map it to the "
                              f"script's flag in autotuning.arg_mappings (e.g. \"{key}\": \"{dim.script_flag}\"), or "
                              f"set it to {json.dumps(allowed[0])} or leave it out")
        return
    values = value if isinstance(value, list) else [] if value == "auto" else [value]
    wrong = [v for v in values if v not in allowed]
    if wrong:
        raise ConfigError(f"{source}: {key}: {json.dumps(wrong[0])} cannot be passed through {mapped[key]} on "
                          f"DeepSpeed's engine ({why}); allowed: {', '.join(json.dumps(v) for v in allowed)}")


def policy_on_deepspeed(dim: Dimension, config: Any, source: str, why: str, mapped: Mapping[str, str]) -> None:
    """DeepSpeed never reads a checkpointing policy: one other than "none" is the script's flag's, or refused."""
    present, value = lookup(config.to_dict(), dim.path)
    value = value if present else dim.neutral_value()
    script_applied(dim, value, value != dim.neutral_value(), source, why, mapped)


def compile_on_deepspeed(dim: Dimension, config: Any, source: str, why: str, mapped: Mapping[str, str]) -> None:
    """DeepSpeed 0.16+ refuses our compile keys in its compile section: compile.enabled goes through
    the script's flag (mapped), the others are refused."""
    key = ".".join(dim.path)
    section = lookup(config.to_dict(), dim.path[:-1])[1] or {}
    ours = sorted(set(section) & {"enabled", "backend", "kwargs"})
    if key in mapped:
        ours = [name for name in ours if name != dim.path[-1]]
        script_applied(dim, section.get(dim.path[-1], False), True, source, why, mapped)
    if ours:
        raise ConfigError(f"{source}: compile.{ours[0]}: our engine's key, but {why}; DeepSpeed's engine "
                          "refuses it in its compile section (from 0.16 it compiles through engine.compile()); call "
                          "engine.compile() in the script, map compile.enabled to its flag in autotuning.arg_mappings "
                          "(Hugging Face's --torch_compile), or drop the key")
