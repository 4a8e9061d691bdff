"""Settling "auto" values from a script's own arguments, as Hugging Face's Trainer does."""

from __future__ import annotations

from typing import Any

from autotuner.config.loader import ConfigSource, load_config


def fill_auto(source: ConfigSource, values: dict[str, Any]) -> dict[str, Any]:
    """Return the config as a dict where each top-level key in `values` that is "auto" (or
    absent) takes the given value. Values of None are skipped; explicit settings are kept."""
    config = load_config(source).to_dict()
    for key, value in values.items():
        if value is not None and config.get(key, "auto") == "auto":
            config[key] = value
    return config
