"""Hugging Face's Trainer under a tune: what it would refuse in every launch but one (a batch key
that varies with no flag mapped, a scheduler step count it derives itself), refused before any."""

from __future__ import annotations

from autotuner.config import DeepSpeedConfig
from autotuner.core.errors import ConfigError
from autotuner.launch.script_args import find_flag
from autotuner.tuning.space.search_space import SearchSpace


def script_max_steps(script_args: tuple[str, ...]) -> int | None:
    """The script's own run length, `--max_steps N` (Hugging Face's Trainer, torchtitan's
    --training.steps is not read): the planned steps when autotuning.planned_steps is unset. HF's
    -1 (train by epochs) and anything not a positive integer give none."""
    found = find_flag(tuple(script_args), "--max_steps")
    value = found[1] if found else None
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


# Hugging Face's Trainer's flag for each batch key: it checks the config's value against it.
TRAINER_BATCH_FLAGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
                       "gradient_accumulation_steps": "--gradient_accumulation_steps"}


def _experiment_micro_batch_sizes(space: SearchSpace) -> list[int]:
    """Every micro-batch size an experiment may get (each with a valid accumulation count)."""
    return space.valid_micro_batch_sizes(space.max_micro_batch_size)


def check_trainer_mappings(space: SearchSpace, arg_mappings: dict[str, str], source: str) -> None:
    """For a Trainer script, a batch key that varies between experiments needs its flag mapped:
    the Trainer refuses a config whose value differs from its flag's, so every launch but the one
    matching the flag's value would fail (and the pick come from those that did not)."""
    micros = _experiment_micro_batch_sizes(space)
    values = {"train_micro_batch_size_per_gpu": micros,
              "gradient_accumulation_steps": sorted({space.gas(m) for m in micros})}
    for key, flag in TRAINER_BATCH_FLAGS.items():
        if key not in arg_mappings and len(values[key]) > 1:
            raise ConfigError(f"{source}: autotuning.arg_mappings: {key} varies between experiments "
                              f"({values[key][0]}..{values[key][-1]}) but is mapped to no flag, and Hugging Face's "
                              f"Trainer refuses a config value other than its {flag}; add \"{key}\": \"{flag}\"")


def _ratio_warmup(script_args: tuple[str, ...]) -> bool:
    """Whether the Trainer's warmup is a share of the run (--warmup_ratio, or --warmup_steps under 1)."""
    for flag, is_ratio in (("--warmup_ratio", lambda v: v > 0), ("--warmup_steps", lambda v: 0 < v < 1)):
        found = find_flag(script_args, flag)
        try:
            if found and found[1] is not None and is_ratio(float(found[1])):
                return True
        except ValueError:
            pass
    return False


def check_trainer_step_counts(config: DeepSpeedConfig, space: SearchSpace, script_args: tuple[str, ...],
                              source: str) -> None:
    """Trained by epochs (no --max_steps), the Trainer derives the run's step count from each
    experiment's batch and refuses a scheduler step count in the config that differs from it
    (transformers' trainer_config_finalize): with batches that vary, every launch but one would fail."""
    if script_max_steps(script_args) is not None or len(_experiment_micro_batch_sizes(space)) < 2:
        return
    params = config.scheduler.params if config.scheduler is not None else {}
    derived = ["total_num_steps"] + (["warmup_num_steps"] if _ratio_warmup(script_args) else [])
    for key in derived:
        value = params.get(key)
        if value is not None and value != "auto":
            raise ConfigError(f"{source}: scheduler.params.{key}: got {value}; Hugging Face's Trainer trains by "
                              "epochs here (no --max_steps), derives this count from each experiment's batch and "
                              "refuses any other value, so every launch but one would fail; set it to \"auto\" or "
                              "pass the script --max_steps")
