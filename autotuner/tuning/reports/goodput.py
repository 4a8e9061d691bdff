"""metric "goodput": the learning rate of the optimal config, and the summary's lines. Pure.

A pick that changes the global batch changes the learning rate that suits it. With
autotuning.lr_scaling "linear" or "sqrt", the optimal config's optimizer lr (and the scheduler's
warm-up and cycle bounds, DeepSpeed's WarmupLR/WarmupDecayLR/OneCycle keys) and a script's
--learning_rate/--lr flag are scaled from reference_batch_size to the pick's global batch.
"""

from __future__ import annotations

import copy
from typing import Any

from autotuner.config.models import SCHEDULER_DEFAULTS
from autotuner.launch.script_args import find_flag, set_flag
from autotuner.core.noise_scale import NoiseScale, scaled_learning_rate
from autotuner.tuning.space.records import Objective, TrialResult, TrialState

SCHEDULER_LR_KEYS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr")
LR_FLAGS = ("--learning_rate", "--learning-rate", "--lr")  # Hugging Face's parser takes the dashed spelling too
TRAINER_LR_FLAG = "--learning_rate"


def _scaled(value: Any, global_batch: int, reference: int, rule: str) -> Any:
    """Rounded as the script's flag is written (6 significant digits), so the config's rate and the
    flag's are the same number (Hugging Face's Trainer refuses a config value that differs from its flag)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(f"{scaled_learning_rate(float(value), global_batch, reference, rule):.6g}")


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def scale_learning_rate(config: dict[str, Any], script_args: tuple[str, ...], global_batch: int, reference: int,
                        rule: str, trainer: bool = False) -> tuple[dict[str, Any], tuple[str, ...], str]:
    """(the config, the script's arguments, the summary's line) with the learning rate scaled.
    With Hugging Face's `trainer`, which refuses a config rate other than its --learning_rate, a
    numeric config rate is given as that flag too, and a scheduler bound left to DeepSpeed's
    default stays unwritten (the Trainer would check a written one against the flag)."""
    if rule == "none":
        return config, script_args, (f"Learning rate: left as it is (autotuning.lr_scaling \"none\"), though the "
                                     f"pick's global batch is {global_batch} against reference_batch_size {reference}")
    config = copy.deepcopy(config)
    changed = []
    params = (config.get("optimizer") or {}).get("params") or {}
    if "lr" in params and params["lr"] != _scaled(params["lr"], global_batch, reference, rule):
        changed.append(f"optimizer lr {params['lr']:g} -> {_scaled(params['lr'], global_batch, reference, rule):.4g}")
        params["lr"] = _scaled(params["lr"], global_batch, reference, rule)
    section = config.get("scheduler") or {}
    scheduler = section.get("params") or {}
    # A bound left to its default is an absolute rate too (WarmupDecayLR's warmup_max_lr 0.001, whatever the
    # optimizer's lr): written out, scaled, or the schedule would train at the reference's rate.
    defaults = SCHEDULER_DEFAULTS.get(section.get("type"), {})
    left = {key: defaults[key] for key in SCHEDULER_LR_KEYS if defaults.get(key) and key not in scheduler}
    if left and trainer:
        changed.append(f"scheduler {', '.join(left)} left to DeepSpeed's default, not scaled (Hugging Face's Trainer "
                       "checks a given one against --learning_rate: set it to \"auto\" to follow the flag)")
    elif left:
        scheduler = section["params"] = {**scheduler, **left}
    for key in SCHEDULER_LR_KEYS:
        if key in scheduler and isinstance(scheduler[key], (int, float)) and not isinstance(scheduler[key], bool):
            scheduler[key] = _scaled(scheduler[key], global_batch, reference, rule)
            changed.append(f"scheduler {key}")
    args = tuple(script_args)
    flags = [flag for flag in LR_FLAGS if find_flag(args, flag)]
    for flag in flags:
        number = _number(find_flag(args, flag)[1])
        if number is not None:
            new = f"{scaled_learning_rate(number, global_batch, reference, rule):.6g}"
            args = set_flag(args, flag, new)
            changed.append(f"{flag} {number:g} -> {new}")
    lr = params.get("lr")
    if trainer and not flags and isinstance(lr, (int, float)) and not isinstance(lr, bool):
        args = set_flag(args, TRAINER_LR_FLAG, f"{lr:.6g}")  # the Trainer's default (5e-5) would not match
        changed.append(f"{TRAINER_LR_FLAG} {lr:.6g} added, the config's rate")
    factor = scaled_learning_rate(1.0, global_batch, reference, rule)
    what = "; ".join(changed) if changed else "no numeric learning rate found to scale (an \"auto\" lr is the " \
                                                "trainer's: scale its flag yourself)"
    line = (f"Learning rate: x{factor:.3g} ({rule}, global batch {global_batch} against reference_batch_size "
            f"{reference}): {what}")
    return config, args, line


def goodput_lines(results: list[TrialResult], objective: Objective, noise: NoiseScale | None,
                  data_parallel_size: int, critical_batch: int | None = None,
                  pick: TrialResult | None = None) -> list[str]:
    """B_noise (or the critical batch the config gave in its place), the throughput pick and the
    goodput pick with their global batches, and each one's time to the same loss relative to the
    other (samples needed grow as 1 + B/B_crit). The goodput pick is `pick`, the final pick (its
    value the re-measured median) where there is one. Each figure is the one the pick was made on:
    throughput over the planned run (autotuning.planned_steps) where one is planned, so time to
    the loss, (1 + B/B_crit) / throughput, is in inverse proportion to the goodput score."""
    if objective.metric == "throughput" and objective.reference_batch:
        return ["Goodput: the gradient noise scale was not measured, so the pick is by throughput (the learning "
                "rate still follows its global batch, autotuning.lr_scaling)"]
    if objective.metric != "goodput" or objective.noise_scale is None:
        return []
    ok = [r for r in results if r.state is TrialState.OK and r.measurement is not None and r.value]
    if not ok:
        return []

    def batch(r: TrialResult) -> int:
        return r.experiment.train_batch_size(data_parallel_size)

    def throughput(r: TrialResult) -> float:  # over the planned run, as scored; without the goodput factor
        return r.value / objective.efficiency(batch(r))

    by_goodput = pick if pick is not None and pick.value else objective.best(ok)
    by_throughput = objective.best(ok, throughput)  # (goodput is maximised: the same ranking)
    ratio = by_throughput.value / by_goodput.value
    measured = (f"B_noise {noise.b_noise:.1f} +/- {noise.spread:.1f} samples ({noise.steps} profile steps)"
                if noise is not None else "B_noise not measured")
    used = (f"Goodput: critical batch {critical_batch} (autotuning.critical_batch_size; the profile's {measured})"
            if critical_batch is not None else f"Goodput: gradient noise scale {measured}")
    return [f"{used}. Throughput pick {by_throughput.name} (global batch "
            f"{batch(by_throughput)}, {throughput(by_throughput):.4g} samples/s); goodput pick "
            f"{by_goodput.name} (global batch {batch(by_goodput)}, {throughput(by_goodput):.4g} "
            f"samples/s). Estimated time to the same loss: the goodput pick's is {ratio:.2f}x the throughput pick's."]
