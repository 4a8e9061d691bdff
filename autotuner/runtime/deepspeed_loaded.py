"""Run code the moment DeepSpeed's own package has loaded in this process (now, if it has).

Two things need it: a tuner's launch of a script on DeepSpeed's engine wraps the engine's methods
to measure them (deepspeed_measure.py), and a script on our engine whose model transformers
builds under DeepSpeed's zero.Init (deepspeed_side.py) needs DeepSpeed's comm on our process
group. One finder serves both. It stays installed until deepspeed is really executed:
transformers and accelerate first ask `importlib.util.find_spec("deepspeed")` only to see that it
is installed, and import it later.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Callable

_callbacks: list[Callable[[], None]] = []


def when_deepspeed_loads(callback: Callable[[], None]) -> None:
    """Call `callback()` once `deepspeed` (DeepSpeed's own package) has been imported."""
    if "deepspeed" in sys.modules and "deepspeed.runtime.engine" in sys.modules:
        callback()
        return
    _callbacks.append(callback)
    if not any(isinstance(finder, _DeepSpeedImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedImportHook())


class _DeepSpeedImportHook(importlib.abc.MetaPathFinder):
    """Finds `deepspeed` through the other finders and runs the callbacks once it has loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _CallingLoader(spec.loader, self)
                return spec
        return None


class _CallingLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: _DeepSpeedImportHook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self._hook)
        self._loader.exec_module(module)
        while _callbacks:
            _callbacks.pop(0)()

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)
