"""Run code the moment a third-party module has really loaded in this process (not when it is only
looked for: transformers and accelerate ask `importlib.util.find_spec("deepspeed")` to see that it
is installed, and import it later). Used for DeepSpeed's own package (runtime/deepspeed_side.py)
and for accelerate's state (launch/accelerate_launch.py). No torch import."""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Callable

_callbacks: dict[str, list[Callable[[], None]]] = {}


def when_loaded(name: str, callback: Callable[[], None], loaded: Callable[[], bool] | None = None) -> None:
    """Call `callback()` once module `name` has been imported (now, if `loaded()` says it has:
    by default, it is in sys.modules)."""
    if (loaded or (lambda: name in sys.modules))():
        callback()
        return
    _callbacks.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _ImportHook) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook(name))


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds one module through the other finders and runs its callbacks once it has loaded."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
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
    def __init__(self, loader, hook: _ImportHook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self._hook)
        self._loader.exec_module(module)
        waiting = _callbacks.get(self._hook.name, [])
        while waiting:
            waiting.pop(0)()

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)
