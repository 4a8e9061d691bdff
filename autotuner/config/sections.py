"""The config side of a tuned dimension: the keys whose "auto" (or list) only a tune settles, and
the sections a plugin's dimension brings.

The dimension registry itself (tuning/space/dimensions.py) sits above the config and the ranks,
which cannot import it; what they must know of a dimension is declared here, at the config
layer, and a dimension refers to it (`Dimension.section`). The loader accepts and validates a
registered section (config/loader.py); the launcher's checks before a training launch and every
rank refuse an unsettled tuned key from `tuned_keys()`; a plugin registers both through
`register_dimension`, in the CLI and in each rank alike (core/plugins.py `load_plugins`).
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import BaseModel

from autotuner.config.keys import KNOWN_UNUSED_KEYS, REMOVED_KEYS
from autotuner.config.models import DeepSpeedConfig, ZeroConfig
from autotuner.config.tuned_values import lookup
from autotuner.core.errors import ConfigError


@dataclass(frozen=True)
class TunedKey:
    """A key a dimension tunes with "auto" (or a list, where `lists`): the tuner writes a value
    into each experiment's config, so outside a tune it is refused, saying what to train with."""

    path: tuple[str, ...]
    train_with: str  # the values a training launch takes, as the refusal lists them: 'true or false'
    lists: bool = False  # a list of values is tuned too (else the model refuses one)

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    def unsettled(self, config: Mapping[str, Any]) -> tuple[bool, Any]:
        """(whether `config`, a config dict, leaves this key to a tune, the value it gives)."""
        present, value = lookup(config, self.path)
        return present and (value == "auto" or (self.lists and isinstance(value, list))), value

    def refusal(self, value: Any, in_rank: bool) -> str:
        """The one line (without its source) refusing `value`: before a training launch, or in a
        rank (where the tuner would have written a value into the experiment's config)."""
        what = '"auto" or a list' if self.lists else "it"
        if in_rank:
            return f"{self.dotted}: got {json.dumps(value)}; {what} is settled by --autotuning tune|run; give {self.train_with}"
        return (f"{self.dotted}: got {json.dumps(value)}; {what} is only for --autotuning tune|run; give "
                f"{self.train_with} to train")


@dataclass(frozen=True)
class ConfigSection:
    """A top-level section a component brings: the loader accepts `key` and validates its value
    with `model` (unknown keys inside it refused as everywhere); `tuned` are its tuned keys."""

    key: str
    model: type[BaseModel]
    tuned: tuple[TunedKey, ...] = ()


# The built-in dimensions' tuned keys (their sections are DeepSpeedConfig's own), in the order
# their refusals are checked.
BUILT_IN_TUNED: tuple[TunedKey, ...] = (
    TunedKey(("compile", "enabled"), "true or false"),
    TunedKey(("zero_optimization", "offload_optimizer", "device"), '"none" or "cpu"'),
    TunedKey(("zero_optimization", "offload_param", "device"), '"none" or "cpu"'),
    TunedKey(("activation_checkpointing", "policy"), '"none", "full" or "selective"', lists=True),
    TunedKey(("tensor_parallel", "autotp_size"), "an integer (0 or 1: no tensor parallelism)", lists=True),
)
SECTIONS: dict[str, ConfigSection] = {}  # a plugin's, by key


def register_section(section: ConfigSection) -> ConfigSection:
    """Make `section.key` a key the config accepts. A key the config has already (its own, one
    it sets aside, one DeepSpeed removed, another section's) is refused, so none is replaced unseen."""
    key = section.key
    own = key in DeepSpeedConfig.model_fields or key in KNOWN_UNUSED_KEYS[""] or key in REMOVED_KEYS
    if own or (key in SECTIONS and SECTIONS[key] is not section):
        raise ValueError(f"config section {key!r} is taken already")
    if any(tuned.path[0] != key for tuned in section.tuned):
        raise ValueError(f"config section {key!r}: its tuned keys must lie inside it")
    SECTIONS[key] = section
    return section


def tuned_keys() -> tuple[TunedKey, ...]:
    return BUILT_IN_TUNED + tuple(tuned for section in SECTIONS.values() for tuned in section.tuned)


def unsettled_keys(config: DeepSpeedConfig) -> list[tuple[TunedKey, Any]]:
    """The tuned keys `config` leaves to a tune, each with its value, in `tuned_keys()`' order."""
    written = config.to_dict()
    found = [(tuned, *tuned.unsettled(written)) for tuned in tuned_keys()]
    return [(tuned, value) for tuned, unsettled, value in found if unsettled]


def zero_list_knobs() -> tuple[str, ...]:
    """The ZeRO knobs that take a list (full mode searches it), read from ZeroConfig's own types;
    the stage, which a training launch refuses on its own, aside."""
    def takes_list(annotation: Any) -> bool:
        return typing.get_origin(annotation) is list or any(takes_list(arg) for arg in typing.get_args(annotation))

    return tuple(name for name, field in ZeroConfig.model_fields.items()
                 if name != "stage" and takes_list(field.annotation))


def refuse_unsettled(config: DeepSpeedConfig, source: str | None, in_rank: bool) -> None:
    """Refuse in one line the first tuned key `config` leaves to a tune (ConfigError, exit 2): a
    dimension's "auto" or list, or a list at any ZeRO knob."""
    prefix = f"{source}: " if source else ""
    for tuned, value in unsettled_keys(config):
        raise ConfigError(prefix + tuned.refusal(value, in_rank))
    for knob in zero_list_knobs():
        value = getattr(config.zero_optimization, knob)
        if isinstance(value, list):
            settled = "settled by" if in_rank else "only for"
            raise ConfigError(f"{prefix}zero_optimization.{knob}: got {json.dumps(value)}; a list is {settled} "
                              "--autotuning tune|run (full mode searches it); give one value to train")
