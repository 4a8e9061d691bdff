"""A toy dimension declared in this module alone, with a config key of its own (`toy_knob.level`):
what a third party's dimension costs. Registered as a plugin (entry point `toy_dimension:register`)
it is known to the loader, settle, the search and every rank; the engine does nothing with it."""

from __future__ import annotations

from typing import Literal, Union

from autotuner.config.base import Section
from autotuner.config.sections import ConfigSection, TunedKey
from autotuner.tuning.space.dimensions import Dimension, register_dimension

Level = Literal["low", "high"]


class ToyKnob(Section):
    """`toy_knob`: a level the tuner searches with "auto" (or a list of levels)."""

    level: Union[Level, Literal["auto"], list[Level]] = "low"


SECTION = ConfigSection("toy_knob", ToyKnob, (TunedKey(("toy_knob", "level"), '"low" or "high"', lists=True),))
DIMENSION = Dimension("toy_knob", ("toy_knob", "level"), "tk", {"autotuner": {s: ("low", "high") for s in range(4)}},
                      lambda settings, value: settings, encode=lambda level: float(level == "high"),
                      role="finish", section=SECTION)


def register() -> None:
    register_dimension(DIMENSION)
