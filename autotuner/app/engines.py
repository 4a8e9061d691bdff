"""Whose engine a script trains on: ours (`import autotuner`) or DeepSpeed's own (`import deepspeed`,
or Hugging Face's Trainer or accelerate's DeepSpeed plugin given a DeepSpeed config).

The tuner decides before anything starts, from the script's imports (and those of its own modules
beside it) or the launcher's `--engine deepspeed`; the profile launch then confirms it from inside
the ranks (ModelInfo.engine). A script that needs DeepSpeed where it is not installed is refused
in one line, before any launch.
"""

from __future__ import annotations

import importlib.util
import json

from autotuner.errors import ConfigError, UsageError

ENGINE_CHOICES = ("auto", "deepspeed", "autotuner")
INSTALL_HINT = ("pip install 'autotuner[deepspeed]' (on a CPU-only machine: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "
                "pip install --no-build-isolation deepspeed)")


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


# Classes that hand a script's model to DeepSpeed's engine when given a DeepSpeed config: Hugging
# Face's Trainer (`--deepspeed ds.json`, as in DeepSpeed's autotuning tutorial) and accelerate's
# DeepSpeed plugin. A script that imports autotuner trains on ours whatever else it imports.
DEEPSPEED_THROUGH = frozenset({
    "transformers:Trainer", "transformers:Seq2SeqTrainer", "transformers:TrainingArguments",
    "transformers:Seq2SeqTrainingArguments", "accelerate:DeepSpeedPlugin", "accelerate.utils:DeepSpeedPlugin",
})


def _top_level(name: str) -> str:
    return name.split(":")[0].split(".")[0]


def imports_deepspeed(script: str) -> bool:
    from autotuner.execution.forkserver import script_imports

    return any(_top_level(name) == "deepspeed" for name in script_imports(script))


def deepspeed_through_library(script: str) -> str | None:
    """The first import by which the script reaches DeepSpeed's engine through a library (e.g.
    "transformers:Trainer"), unless it imports autotuner; else None."""
    from autotuner.execution.forkserver import script_imports

    names = script_imports(script)
    if any(_top_level(name) == "autotuner" for name in names):
        return None
    return next((name for name in names if name in DEEPSPEED_THROUGH), None)


def trains_on_ours(script: str) -> bool:
    """The script imports autotuner and nothing that would put it on DeepSpeed's engine."""
    from autotuner.execution.forkserver import script_imports

    names = script_imports(script)
    return any(_top_level(name) == "autotuner" for name in names) and not imports_deepspeed(script)


def script_engine(script: str, requested: str = "auto") -> str:
    """"deepspeed" when the script trains on DeepSpeed's engine, else "autotuner"."""
    if requested not in ENGINE_CHOICES:
        raise UsageError(f"--engine: got {requested!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if requested == "autotuner":  # a script that imports both engines behind its own flag
        return "autotuner"
    through = None
    if requested == "deepspeed":
        why = "--engine deepspeed was given"
    elif imports_deepspeed(script):
        why = f"{script} imports deepspeed"
    else:
        through = deepspeed_through_library(script)
        if through is None:
            return "autotuner"
        why = f"{script} imports {through.replace(':', '.')}, which trains on DeepSpeed's engine with --deepspeed"
    if not deepspeed_installed():
        instead = ("" if through else ", or change the script's `import deepspeed` to `import autotuner as "
                   "deepspeed` to train on our engine")
        raise UsageError(f"{why}, but DeepSpeed is not installed in this Python; {INSTALL_HINT}{instead}")
    return "deepspeed"


def deepspeed_cpu_runs_fp16() -> bool:
    """DeepSpeed's CPU accelerator's own rule: fp16 only where oneDNN has fp16 kernels for this CPU
    (AVX512-FP16 or AMX-FP16); elsewhere its engine raises "Type fp16 is not supported" at init."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # an older torch without the probe: DeepSpeed says no there too
        return False


def check_deepspeed_precision(fp16_enabled: object, engine: str, script_args: tuple[str, ...], source: str) -> None:
    """Refuse before any launch what DeepSpeed's engine would refuse in every rank: fp16 on a CPU
    without fp16 kernels. On CUDA DeepSpeed decides per GPU, and our engine runs fp16 anywhere."""
    import torch

    if engine != "deepspeed" or fp16_enabled is not True or torch.cuda.is_available() or deepspeed_cpu_runs_fp16():
        return
    flag = " and drop the script's --fp16" if "--fp16" in script_args else ""
    raise ConfigError(f"{source}: fp16.enabled: true, but DeepSpeed's engine refuses fp16 on this CPU (oneDNN has "
                      "no fp16 kernels for it: it needs AVX512-FP16 or AMX-FP16); set \"fp16\": {\"enabled\": false}"
                      f"{flag} to train in fp32, or \"bf16\": {{\"enabled\": true}} in its place")


# Our keys a script on DeepSpeed's engine may carry when autotuning.arg_mappings maps them to a
# flag of its own: Hugging Face's Trainer checkpoints whole blocks with --gradient_checkpointing
# and compiles with --torch_compile (accelerate then calls engine.compile()).
SCRIPT_APPLIED = {"activation_checkpointing.policy": ("none", "full"), "compile.enabled": (False, True)}
MAPPING_HINT = {"activation_checkpointing.policy": "--gradient_checkpointing", "compile.enabled": "--torch_compile"}


def check_our_engine_sections(config, engine: str, source: str, arg_mappings: dict[str, str] | None = None) -> None:
    """Keys only our engine acts on, for a script on DeepSpeed's engine: an activation
    checkpointing policy (DeepSpeed never reads it, so it would be silently ignored) and our
    compile keys (DeepSpeed 0.16+ refuses them in its compile section). Refused in one line,
    unless arg_mappings hands the policy or compile.enabled to a flag of the script's own."""
    if engine != "deepspeed":
        return
    mapped = arg_mappings or {}
    policy = config.activation_checkpointing.policy
    _check_script_applied(source, "activation_checkpointing.policy", policy, mapped, policy != "none",
                          "the script checkpoints activations itself (deepspeed.checkpointing, or Hugging Face's "
                          "--gradient_checkpointing)")
    ours = sorted(config.compile.model_fields_set & {"enabled", "backend", "kwargs"})
    if "compile.enabled" in mapped:
        ours = [key for key in ours if key != "enabled"]
        _check_script_applied(source, "compile.enabled", config.compile.enabled, mapped, True, "")
    if ours:
        raise ConfigError(f"{source}: compile.{ours[0]}: our engine's key; DeepSpeed's engine refuses it in its compile "
                          "section (from 0.16 it compiles through engine.compile()); call engine.compile() in the "
                          "script, map compile.enabled to its flag in autotuning.arg_mappings (Hugging Face's "
                          "--torch_compile), or drop the key")


def _check_script_applied(source: str, key: str, value, mapped: dict[str, str], used: bool, how: str) -> None:
    """A script-applied key on DeepSpeed's engine: mapped to the script's flag, with values the
    flag can express; else refused in one line."""
    allowed = SCRIPT_APPLIED[key]
    if key not in mapped:
        if used:
            verb = "tuned" if value == "auto" or isinstance(value, list) else "applied"
            raise ConfigError(f"{source}: {key}: {json.dumps(value)} is {verb} by our engine only; on DeepSpeed's "
                              f"engine {how or 'the script applies it'}: map it to the script's flag in "
                              f"autotuning.arg_mappings (e.g. \"{key}\": \"{MAPPING_HINT[key]}\"), or set it to "
                              f"{json.dumps(allowed[0])} or leave it out")
        return
    values = value if isinstance(value, list) else [] if value == "auto" else [value]
    wrong = [v for v in values if v not in allowed]
    if wrong:
        raise ConfigError(f"{source}: {key}: {json.dumps(wrong[0])} cannot be passed through {mapped[key]} on "
                          f"DeepSpeed's engine; allowed: {', '.join(json.dumps(v) for v in allowed)}")
