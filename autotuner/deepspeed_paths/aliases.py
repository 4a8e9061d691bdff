"""DeepSpeed's import paths at their `autotuner.*` names: `autotuner.moe.layer` is the module
`autotuner.deepspeed_paths.moe.layer`, one module object under both names in sys.modules.

A script that runs `import autotuner as deepspeed` writes `deepspeed.moe.layer` as
`autotuner.moe.layer`; the modules live in this package. The finder below, installed at the front
of sys.meta_path by `import autotuner`, answers each aliased name (and every name under one) with
the real module, so its classes are the same classes and `from autotuner.zero import Init`,
`import autotuner.comm as dist` and `importlib.util.find_spec` work as before. A name under an
alias that has no real module (`autotuner.moe.nonexistent`) raises ModuleNotFoundError as usual.
It imports nothing at install: each real module is imported when its alias is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Sequence

REAL_PACKAGE = "autotuner.deepspeed_paths"
# The one table: the DeepSpeed paths, relative to `autotuner` (as `deepspeed.X` is relative to `deepspeed`).
# `autotuner.X` (and `autotuner.X.Y`) is `autotuner.deepspeed_paths.X` (and `...X.Y`).
ALIASED = ("accelerator", "checkpointing", "comm", "compression", "inference", "module_inject", "moe", "monitor",
           "ops", "pipe", "profiling", "utils", "zero",
           "runtime.config", "runtime.data_pipeline", "runtime.domino", "runtime.pipe", "runtime.utils",
           "runtime.zero")
ALIASES = {f"autotuner.{path}": f"{REAL_PACKAGE}.{path}" for path in ALIASED}
# The aliases that are attributes of `autotuner` itself (`deepspeed.moe` after `import deepspeed`).
TOP_LEVEL = tuple(path for path in ALIASED if "." not in path)


def real_name(fullname: str) -> str | None:
    """The real module's name for an alias or a name under one; None for every other name."""
    if not fullname.startswith("autotuner."):
        return None  # the fast path: every other import in the process passes here
    head = fullname
    while "." in head:
        real = ALIASES.get(head)
        if real is not None:
            return real + fullname[len(head):]
        head = head.rpartition(".")[0]
    return None


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an alias's real module and loads it as the alias: the same object, not a copy."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        real = real_name(fullname)
        if real is None:
            return None
        real_spec = importlib.util.find_spec(real)
        if real_spec is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=real_spec.origin,
                                              is_package=real_spec.submodule_search_locations is not None)
        spec.loader_state = real
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its real name; it keeps its own spec (its name, for pickle and reload).
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder first on sys.meta_path, once. First, so that a folder left at an old path
    (its __pycache__ after an upgrade in place) cannot shadow an alias as a namespace package."""
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
