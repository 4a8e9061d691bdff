"""The tuner's values laid over a script's own config (our engine, in a tuner's launch).

A script that builds its DeepSpeed config in code (DeepSpeed-Chat: `initialize(config=ds_config)`,
the stage from its own `--zero_stage` flag) would otherwise train with its values, not the
experiment's. Exactly the tuned keys are replaced; the train batch size, which the script may have
computed from its own micro-batch, is then derived again from the tuned micro-batch and gas.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Mapping

from autotuner.core.boundary import RecordError, request_from_env

# The pick's tuned values (JSON, by config key), for the training of a script that builds its config in code.
TUNED_VALUES_ENV = "AUTOTUNER_TUNED_VALUES"
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def lookup(config: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    """(present, value) at `path` in a config dict."""
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


def write(config: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set `path` in `config` in place, copying each section on the way (the base is shared)."""
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
        path = tuple(key.split("."))
        present, was = lookup(config, path)
        if not present or was != value:
            changes.append(f"{key}: {repr(was) if present else 'unset'} -> {value!r}")
            write(config, path, value)
    if changes and all(key in tuned for key in BATCH_KEYS):
        config.pop("train_batch_size", None)  # derived from the tuned micro-batch x gas x world size
    return config, changes


def tuned_values_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The tuned values a rank must train with, by DeepSpeed config key: a tuner's launch's (its
    request), else the pick's (TUNED_VALUES_ENV, set for the training of a script that builds its
    config in code); empty otherwise."""
    environ = os.environ if environ is None else environ
    request = request_from_env(environ)
    if request is not None:
        return request.tuned_values()
    text = environ.get(TUNED_VALUES_ENV)
    if not text:
        return {}
    try:
        values = json.loads(text)
    except ValueError as err:
        raise RecordError(f"{TUNED_VALUES_ENV}: not a JSON object of config keys and values ({err})") from err
    if not isinstance(values, dict):
        raise RecordError(f"{TUNED_VALUES_ENV}: not a JSON object of config keys and values")
    return values
