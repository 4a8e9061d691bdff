"""Checks of the script's config before a training launch (`launcher` without --autotuning, and
--autotuning online), so a typo costs no launch. The tuner's own checks are settle.py's."""

from __future__ import annotations

import json
import sys

from autotuner.core.engine_kind import Engine
from autotuner.core.errors import ConfigError, UsageError


def check_training_config(script_args: tuple[str, ...], world_size: int, online: bool = False,
                  script: str | None = None, engine: str = "auto") -> None:
    """Validate the script's config before starting anything, so a typo costs no launch. Hugging
    Face's "auto" values are refused here only for a script known to train on our engine; on
    DeepSpeed's (the Trainer's) they are the script's to fill in. A script that imports both
    engines is not refused on a guess."""
    from autotuner.config import load_config
    from autotuner.config.batch import check_fixed_triad
    from autotuner.config.loader import config_label
    from autotuner.launch.script_args import config_path

    given = config_path(script_args)
    if given is None:
        if online:
            raise UsageError("--autotuning online needs the script's config: add --deepspeed ds.json after the script")
        return
    config = load_config(given)
    path = config_label(given)  # what messages call it: its path, or that it came base64-encoded
    if script is not None:
        from autotuner.config.trainer_auto import refuse_trainer_autos
        from autotuner.app.engines import check_our_engine_sections, engine_choice, trains_on_ours
        from autotuner.core.script_imports import import_sites

        choice = engine_choice(script, engine)
        if choice.engine == "deepspeed" and choice.decided_by == "imports" and not any(
                site.top_level == "deepspeed" for site in import_sites(script)):
            # Through a library (accelerate, the Trainer): which engine trains is not in the script's imports.
            print(f"launcher: note: engine: {choice.why}", file=sys.stderr)
        if choice.engine == Engine.OURS and trains_on_ours(script):
            refuse_trainer_autos(config, path, choice.why)
        check_our_engine_sections(config, choice, path)  # only for a script settled on DeepSpeed's engine
        if choice.settled and choice.engine == Engine.OURS:  # what our engine would train otherwise
            from autotuner.config.engine_math import refuse_other_math

            refuse_other_math(config, path)
    stage = config.zero_optimization.stage
    if not isinstance(stage, int):
        raise ConfigError(f"{path}: zero_optimization.stage: got {json.dumps(stage)}; a list or \"all\" is only for "
                          "--autotuning tune|run; give 0, 1, 2 or 3 to train")
    from autotuner.config.sections import refuse_unsettled

    refuse_unsettled(config, path, in_rank=False)  # each dimension's tuned key (a plugin's too)
    tp = config.tensor_parallel.size
    if tp > 1 and world_size % tp:
        raise ConfigError(f"{path}: tensor_parallel.autotp_size {tp}: must divide the number of ranks ({world_size})")
    check_fixed_triad(config, world_size, path, stages_from_script=script is not None and builds_a_pipeline(script))
    if config.optimizer is not None or config.scheduler is not None:  # built on a dummy parameter: torch
        from autotuner.runtime.training.optim import check_optimizer_and_scheduler

        check_optimizer_and_scheduler(config, path)
    _check_online(config, path, online)
    if online or config.autotuning.online.enabled:
        return
    if config.autotuning.enabled and config.autotuning.metric_path is None:  # with one, the tuner launched it
        print(f"launcher: note: {path} has autotuning.enabled but --autotuning was not given; training with the "
              "config as written (add --autotuning tune|run to tune it)", file=sys.stderr)


def _check_online(config, path: str, online: bool) -> None:
    """Online tuning's needs, before launch: optuna installed, fixed knobs that exist."""
    from autotuner.runtime.online.knobs import user_fixed

    try:
        user_fixed(config.zero_optimization, config.autotuning.online)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if online or config.autotuning.online.enabled:
        from autotuner.core.bayes import require_optuna

        how = "--autotuning online" if online else f"{path}: autotuning.online.enabled"
        require_optuna(how)


def builds_a_pipeline(script: str) -> bool:
    """Whether the script (or a module of its own beside it) imports a PipelineModule, ours or
    DeepSpeed's: its stages, and so its data-parallel size, may be the script's to set."""
    from autotuner.core.script_imports import import_sites

    return any(site.name.split(":")[0].endswith(".pipe") or site.name.endswith(":PipelineModule")
               for site in import_sites(script))
