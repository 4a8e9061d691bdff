"""The tuner's values laid over a script's own config (our engine, in a tuner's launch).

A script that builds its DeepSpeed config in code (DeepSpeed-Chat: `initialize(config=ds_config)`,
the stage from its own `--zero_stage` flag) would otherwise train with its values, not the
experiment's. Exactly the tuned keys are replaced; the train batch size, which the script may have
computed from its own micro-batch, is then derived again from the tuned micro-batch and gas.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_UNSET = object()


def _lookup(config: Mapping[str, Any], path: list[str]) -> Any:
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return _UNSET
        node = node[key]
    return node


def _write(config: dict[str, Any], path: list[str], value: Any) -> None:
    node = config
    for key in path[:-1]:
        section = node.get(key)
        node[key] = dict(section) if isinstance(section, Mapping) else {}
        node = node[key]
    node[path[-1]] = value


def lay_tuned_values(raw: Mapping[str, Any], tuned: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the config with each tuned key set to its tuned value, a line per key that differed:
    `key: script's value -> tuned value`)."""
    config = copy.deepcopy(dict(raw))
    changes = []
    for key, value in tuned.items():
        path = key.split(".")
        was = _lookup(config, path)
        if was is _UNSET or was != value:
            changes.append(f"{key}: {'unset' if was is _UNSET else repr(was)} -> {value!r}")
            _write(config, path, value)
    if changes and all(key in tuned for key in BATCH_KEYS):
        config.pop("train_batch_size", None)  # derived from the tuned micro-batch x gas x world size
    return config, changes
