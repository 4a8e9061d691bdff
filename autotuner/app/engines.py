"""Whose engine a script trains on: ours (`import autotuner`) or DeepSpeed's own (`import deepspeed`,
or Hugging Face's Trainer or accelerate's DeepSpeed plugin given a DeepSpeed config).

The launcher's `--engine` settles it outright. Otherwise the script's imports (and those of its own
modules beside it) settle it when they name one engine only; a script that needs DeepSpeed where
it is not installed is then refused in one line, before any launch. A script that imports both
(one behind an environment variable, or `try: import deepspeed` falling back to ours) chooses at
run time, so nothing is refused on a guess: the profile launch's ranks report the engine they
built (ModelInfo.engine), and what is wrong for that engine is refused then, before any other
launch (app/settle.py `settle_built_engine`). Every refusal that depends on the engine says which
engine and why (EngineChoice.why).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path

from autotuner.core.engine_kind import Engine
from autotuner.core.errors import ConfigError, UsageError
from autotuner.core.script_imports import ImportSite, import_sites
from autotuner.launch.accelerate_launch import trains_through_accelerate
from autotuner.tuning.space.dimensions import REGISTRY

ENGINE_CHOICES = ("auto", *(engine.value for engine in Engine))  # --engine's words
INSTALL_HINT = ("pip install 'autotuner[deepspeed]' (on a CPU-only machine: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "
                "pip install --no-build-isolation deepspeed)")


# Hugging Face's Trainer: it builds DeepSpeed's engine itself and checks the config's numbers
# against its own flags (transformers' HfTrainerDeepSpeedConfig), so both must say the same.
TRAINER_CLASSES = frozenset({"transformers:Trainer", "transformers:Seq2SeqTrainer", "transformers:TrainingArguments",
                             "transformers:Seq2SeqTrainingArguments"})


def trains_with_trainer(script: str) -> bool:
    """The script imports the Trainer and not autotuner (which would put it on our engine)."""
    sites = import_sites(script)
    return (any(site.name in TRAINER_CLASSES for site in sites)
            and not any(site.top_level == "autotuner" for site in sites))


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


# Classes that hand a script's model to DeepSpeed's engine when given a DeepSpeed config: Hugging
# Face's Trainer (`--deepspeed ds.json`, as in DeepSpeed's autotuning tutorial) and accelerate's
# DeepSpeed plugin. A script that imports autotuner trains on ours whatever else it imports.
DEEPSPEED_THROUGH = TRAINER_CLASSES | {"accelerate:DeepSpeedPlugin", "accelerate.utils:DeepSpeedPlugin"}


@dataclass(frozen=True)
class EngineChoice:
    """Whose engine the script trains on, how that was decided, and why, in words for messages."""

    engine: Engine  # while not settled, the one the profile launch expects
    settled: bool  # False: the script imports both engines, and the profile launch's ranks settle it
    decided_by: str  # "--engine", "imports" or "ranks"
    reason: str  # the fact: "train.py imports deepspeed (line 3)", "--engine deepspeed was given"

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine(self.engine))  # the word a caller gives: the type

    @property
    def why(self) -> str:
        """A clause saying which engine and why, with the flag that changes it where a guess was made:
        "train.py imports deepspeed (line 3), so it is taken to train on DeepSpeed's engine (pass
        --engine autotuner if it trains on ours)"."""
        if self.decided_by != "imports" or not self.settled:
            return self.reason
        other = self.engine.other
        other_name = "ours" if other is Engine.OURS else "DeepSpeed's"
        return (f"{self.reason}, so it is taken to train on {self.engine.label} (pass --engine {other} "
                f"if it trains on {other_name})")

    def built(self, engine: str) -> EngineChoice:
        """Settled by the engine the profile launch's ranks built."""
        engine = Engine(engine)  # (an unknown name: ValueError)
        if not self.settled:
            reason = f"{self.reason}, and the profile launch's ranks built {engine.label}"
        elif engine == self.engine:
            return self
        else:
            reason = f"the profile launch's ranks built {engine.label}, though {self.reason}"
        return replace(self, engine=engine, settled=True, decided_by="ranks", reason=reason)


def _site_text(site: ImportSite, script: str) -> str:
    """"line 3", or "helper.py, line 3" for an import in one of the script's own modules."""
    own = site.path == Path(script).resolve()
    return f"line {site.line}" if own else f"{site.path.name}, line {site.line}"


def engine_choice(script: str, requested: str = "auto") -> EngineChoice:
    """Whose engine the script trains on, from --engine or else the script's imports; unsettled
    when it imports both engines."""
    if requested not in ENGINE_CHOICES:
        raise UsageError(f"--engine: got {requested!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if requested != "auto":
        return EngineChoice(Engine(requested), True, "--engine", f"--engine {requested} was given")
    sites = import_sites(script)
    deepspeed = next((site for site in sites if site.top_level == "deepspeed"), None)
    ours = next((site for site in sites if site.top_level == "autotuner"), None)
    if deepspeed is not None and ours is not None:
        return EngineChoice(Engine.OURS, False, "imports",
                            f"{script} imports both deepspeed ({_site_text(deepspeed, script)}) and autotuner "
                            f"({_site_text(ours, script)})")
    if deepspeed is not None:
        return EngineChoice(Engine.DEEPSPEED, True, "imports",
                            f"{script} imports deepspeed ({_site_text(deepspeed, script)})")
    through = None if ours is not None else next((site for site in sites if site.name in DEEPSPEED_THROUGH), None)
    if through is None and trains_through_accelerate(script):
        site = next(site for site in sites if site.top_level == "accelerate")
        return EngineChoice(Engine.DEEPSPEED, True, "imports",
                            f"{script} imports {site.name.replace(':', '.')} ({_site_text(site, script)}) and takes "
                            "no --deepspeed flag of its own: accelerate's DeepSpeed plugin trains it on DeepSpeed's "
                            "engine, given --deepspeed's config through accelerate's environment as `accelerate "
                            "launch` gives it")
    if through is not None:
        return EngineChoice(Engine.DEEPSPEED, True, "imports",
                            f"{script} imports {through.name.replace(':', '.')} ({_site_text(through, script)}), "
                            "which trains on DeepSpeed's engine with --deepspeed")
    reason = (f"{script} imports autotuner ({_site_text(ours, script)}) and not deepspeed" if ours is not None
              else f"{script} imports neither deepspeed nor autotuner")
    return EngineChoice(Engine.OURS, True, "imports", reason)


def script_engine(script: str, requested: str = "auto") -> EngineChoice:
    """`engine_choice`, refused in one line where it needs DeepSpeed and DeepSpeed is not
    installed. A script that imports both engines is not refused: its fallback may be ours."""
    choice = engine_choice(script, requested)
    if choice.settled and choice.engine == Engine.DEEPSPEED and not deepspeed_installed():
        instead = (", or change the script's `import deepspeed` to `import autotuner as deepspeed` to train on our "
                   "engine" if imports_deepspeed_itself(choice, script) else "")
        raise UsageError(f"{choice.why}, but DeepSpeed is not installed in this Python; {INSTALL_HINT}{instead}")
    return choice


def imports_deepspeed_itself(choice: EngineChoice, script: str) -> bool:
    """The choice was made by the script's own `import deepspeed`, which `import autotuner as
    deepspeed` would move to our engine (not the Trainer's or accelerate's path, nor --engine)."""
    return choice.decided_by == "imports" and any(site.top_level == "deepspeed" for site in import_sites(script))


def trains_on_ours(script: str) -> bool:
    """The script imports autotuner and nothing that would put it on DeepSpeed's engine."""
    choice = engine_choice(script)
    return choice.settled and choice.engine == Engine.OURS and any(
        site.top_level == "autotuner" for site in import_sites(script))


def deepspeed_cpu_runs_fp16() -> bool:
    """DeepSpeed's CPU accelerator's own rule: fp16 only where oneDNN has fp16 kernels for this CPU
    (AVX512-FP16 or AMX-FP16); elsewhere its engine raises "Type fp16 is not supported" at init."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # an older torch without the probe: DeepSpeed says no there too
        return False


def check_deepspeed_precision(fp16_enabled: object, choice: EngineChoice, script_args: tuple[str, ...],
                              source: str) -> None:
    """Refuse what DeepSpeed's engine would refuse in every rank: fp16 on a CPU without fp16
    kernels. On CUDA DeepSpeed decides per GPU, and our engine runs fp16 anywhere."""
    import torch

    # "auto" beside the Trainer's --fp16 is true once the Trainer fills it in.
    fp16 = fp16_enabled is True or (fp16_enabled == "auto" and "--fp16" in script_args)
    if (not choice.settled or choice.engine != Engine.DEEPSPEED or not fp16 or torch.cuda.is_available()
            or deepspeed_cpu_runs_fp16()):
        return
    flag = " and drop the script's --fp16" if "--fp16" in script_args else ""
    given = "true" if fp16_enabled is True else '"auto" with the script\'s --fp16'
    raise ConfigError(f"{source}: fp16.enabled: {given}, but DeepSpeed's engine refuses fp16 on this CPU (oneDNN has "
                      f"no fp16 kernels for it: it needs AVX512-FP16 or AMX-FP16), and {choice.why}; set \"fp16\": "
                      f"{{\"enabled\": false}}{flag} to train in fp32, or \"bf16\": {{\"enabled\": true}} in its place")


def check_our_engine_sections(config, choice: EngineChoice, source: str,
                              arg_mappings: dict[str, str] | None = None) -> None:
    """Keys only our engine acts on, for a script settled on DeepSpeed's engine: each dimension's
    own refusals (an activation checkpointing policy DeepSpeed never reads, our compile keys that
    DeepSpeed 0.16+ refuses), unless arg_mappings hands the key to a flag of the script's own.
    Refused in one line."""
    if not choice.settled or choice.engine != Engine.DEEPSPEED:
        return
    for dim in REGISTRY.values():
        for refusal in dim.deepspeed_refusals:
            refusal(dim, config, source, choice.why, arg_mappings or {})
