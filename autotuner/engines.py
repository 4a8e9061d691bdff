"""Whose engine a script trains on: ours (`import autotuner`) or DeepSpeed's own (`import deepspeed`).

The tuner decides before anything starts, from the script's imports (and those of its own modules
beside it) or the launcher's `--engine deepspeed`; the profile launch then confirms it from inside
the ranks (ModelInfo.engine). A script that needs DeepSpeed where it is not installed is refused
in one line, before any launch.
"""

from __future__ import annotations

import importlib.util

from autotuner.errors import UsageError

ENGINE_CHOICES = ("auto", "deepspeed", "autotuner")
INSTALL_HINT = ("pip install 'autotuner[deepspeed]' (on a CPU-only machine: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "
                "pip install --no-build-isolation deepspeed)")


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def imports_deepspeed(script: str) -> bool:
    from autotuner.tuning.warm import script_imports

    return any(name.split(":")[0].split(".")[0] == "deepspeed" for name in script_imports(script))


def script_engine(script: str, requested: str = "auto") -> str:
    """"deepspeed" when the script trains on DeepSpeed's engine, else "autotuner"."""
    if requested not in ENGINE_CHOICES:
        raise UsageError(f"--engine: got {requested!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    if requested == "autotuner":  # a script that imports both engines behind its own flag
        return "autotuner"
    engine = "deepspeed" if requested == "deepspeed" or imports_deepspeed(script) else "autotuner"
    if engine == "deepspeed" and not deepspeed_installed():
        why = "--engine deepspeed was given" if requested == "deepspeed" else f"{script} imports deepspeed"
        raise UsageError(f"{why}, but DeepSpeed is not installed in this Python; {INSTALL_HINT}, or change the "
                         "script's `import deepspeed` to `import autotuner as deepspeed` to train on our engine")
    return engine
