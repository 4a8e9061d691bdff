"""The tuner's values laid over a script's own config (our engine, in a tuner's launch).

A script that builds its DeepSpeed config in code (DeepSpeed-Chat: `initialize(config=ds_config)`,
the stage from its own `--zero_stage` flag) would otherwise train with its values, not the
experiment's. Exactly the tuned keys are replaced; the train batch size, which the script may have
computed from its own micro-batch, is then derived again from the tuned micro-batch and gas.
The pick's training gets them the same way: a tune writes them to a file, and the optimal command
names it (`launcher --tuned_values FILE`).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping

from autotuner.core.boundary import TunedValues, request_from_env
from autotuner.core.errors import ConfigError

# The TunedValues file of `launcher --tuned_values FILE`, which the launcher names on its ranks'
# environment (as a tuner's launch names its request file); a path, never the values themselves.
TUNED_VALUES_ENV = "AUTOTUNER_TUNED_VALUES_FILE"
TUNED_VALUES_FLAG = "--tuned_values"
TUNED_VALUES_FILE = "tuned_values.json"  # a tune's, in its results_dir beside cmd_optimal.txt
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


def read_tuned_values(path: str | os.PathLike) -> dict[str, Any]:
    """The tuned values in a TunedValues file, by config key. A file that is missing, unreadable or
    not such a record is a ConfigError (exit 2) naming it: training on without them would train
    the script's own config, not the pick."""
    named = f"{TUNED_VALUES_FLAG} {path}"
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{named}: no such file (a tune writes its {TUNED_VALUES_FILE} in autotuning.results_dir "
                          "and names it in cmd_optimal.txt)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{named}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
    try:
        return dict(TunedValues.from_json(json.loads(text)).values)
    except ValueError as err:  # bad JSON, or RecordError: the wrong shape or version
        raise ConfigError(f"{named}: not a tuned values record ({err})") from None


def tuned_values_from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The tuned values a rank must train with, by DeepSpeed config key: a tuner's launch's (its
    request), else the pick's (the TunedValues file the launcher named in TUNED_VALUES_ENV, for
    the training of a script that builds its config in code); empty otherwise."""
    environ = os.environ if environ is None else environ
    request = request_from_env(environ)
    if request is not None:
        return request.tuned_values()
    path = environ.get(TUNED_VALUES_ENV)
    return read_tuned_values(path) if path else {}
