"""`deepspeed.utils.module_utils`: reach and replace a submodule by its dotted name."""

from __future__ import annotations

from typing import Any


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for module_name "a.b.c"."""
    found = model
    for part in module_name.split("."):
        found = getattr(found, part)
    return found


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set `model.a.b.c = module` for module_name "a.b.c"."""
    parent, _, last = module_name.rpartition(".")
    (recursive_getattr(model, parent) if parent else model).__setattr__(last, module)
