"""Where an engine's DeepSpeed config comes from (args.deepspeed_config, initialize(config=...),
or Hugging Face's `--deepspeed PATH`), the tuned values laid over the measured engine's, and the
refusals of what no Trainer or tuner is there to fill in."""

from __future__ import annotations

import os
from typing import Any, Mapping

from autotuner.config.engine_math import refuse_other_math
from autotuner.config.loader import ConfigSource, config_label, load_config, read_config_file
from autotuner.config.models import DeepSpeedConfig
from autotuner.config.trainer_auto import refuse_auto_batch, refuse_trainer_autos
from autotuner.config.tuned_values import lay_tuned_values, tuned_values_from_env
from autotuner.core.errors import ConfigError
from autotuner.core.rank_setup import config_warnings_shown
from autotuner.runtime.distributed import warn_once

IN_CODE = "initialize(config=...)"  # how a config built in code is named in messages


def config_from(args: Any, config: ConfigSource | None, client_optimizer: bool = False, training_engines_before: int = 0,
                ) -> tuple[DeepSpeedConfig, tuple[str, ...], bool]:
    """(the config, the tuned keys laid over the script's own values, whether this engine is the one
    a tuner measures: the first in the process that trains, see `_measured_here`). As DeepSpeed:
    args.deepspeed_config (or the older deepscale_config; a path or a dict) or
    initialize(config=...), not both. Ours besides: Hugging Face's style `--deepspeed PATH`, read
    only where neither is given (DeepSpeed's --deepspeed is a switch, never a config)."""
    given = [getattr(args, name, None) for name in ("deepspeed_config", "deepscale_config")] if args is not None else []
    given = [value for value in given if value is not None]
    if config is not None and given:
        raise ConfigError(f"config given twice: initialize(config=...) and --deepspeed_config {_named(given[0])}; "
                          "pass one")
    if len(given) > 1 and given[0] != given[1]:
        raise ConfigError(f"--deepspeed_config {_named(given[0])} and --deepscale_config {_named(given[1])} "
                          "disagree; pass one")
    switch = getattr(args, "deepspeed", None) if args is not None else None
    if config is None and not given and isinstance(switch, str):
        given = [switch]
    if config is None and not given:
        raise ConfigError("no config: pass --deepspeed_config PATH (or --deepspeed PATH) or initialize(config=...)")
    source = config if config is not None else given[0]
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    raw = source if isinstance(source, (Mapping, DeepSpeedConfig)) else read_config_file(source)
    trains = client_optimizer or _has_optimizer_section(raw)
    measured = _measured_here(trains, training_engines_before)
    label = IN_CODE if isinstance(source, Mapping) else None if isinstance(source, DeepSpeedConfig) else \
        config_label(source)
    laid, label, tuned_over = _with_tuned_values(raw, label, measured)
    with config_warnings_shown(isinstance(source, Mapping)):
        loaded = load_config(laid, name=label)
    # No Trainer runs before our engine to fill its "auto" values in, nor the tuner its batch sizes.
    named = str(source) if isinstance(source, (str, os.PathLike)) else "config"
    refuse_auto_batch(loaded, named)
    refuse_trainer_autos(loaded, named)
    refuse_other_math(loaded, str(source) if isinstance(source, (str, os.PathLike)) else "config")
    return loaded, tuned_over, measured


def _has_optimizer_section(raw: Any) -> bool:
    if isinstance(raw, DeepSpeedConfig):
        return raw.optimizer is not None
    return isinstance(raw, Mapping) and raw.get("optimizer") is not None


def _measured_here(trains: bool, training_engines_before: int) -> bool:
    """The engine a tuner measures, and the only one its tuned values are laid over: the first in
    this process built to train (with an optimizer). DeepSpeed-Chat's step 3 builds four (actor,
    reference, critic, reward); the forward-only ones and the later trained ones keep their own
    configs, as each DeepSpeed engine keeps the config it was given."""
    return trains and training_engines_before == 0


def _with_tuned_values(source: Any, label: str | None, measured: bool,
                       ) -> tuple[ConfigSource, str | None, tuple[str, ...]]:
    """(the config source, its name, the keys that differed): in a tuner's launch, and in the
    training its pick runs, the tuned values laid over the measured engine's config
    (config/tuned_values.py), each that differed said once in the log."""
    tuned = tuned_values_from_env()
    if not tuned or not measured or isinstance(source, DeepSpeedConfig):
        return source, label, ()
    named = label or IN_CODE
    laid, changes = lay_tuned_values(source, tuned)
    if changes:
        warn_once(f"{named}: the script's config differs from the tuned values, which our engine trains with: "
                  f"{'; '.join(changes)}")
    return laid, named, tuple(change.split(":", 1)[0] for change in changes)


def _named(value: Any) -> str:
    return "(a dict)" if isinstance(value, dict) else str(value)
