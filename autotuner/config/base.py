"""What every config section shares: frozen pydantic models that refuse unknown keys, read-only
at every depth (a dict or list a section holds is frozen too: core/frozen.py), and the value
types the sections use ("auto", counts that refuse booleans)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from autotuner.core.frozen import freeze

Auto = Literal["auto"]


def _no_bool(value: Any) -> Any:
    # JSON true is not a count; pydantic's lax mode would read it as 1.
    if isinstance(value, bool):
        raise ValueError("a boolean is not a count; expected a positive integer")
    return value


def _no_string(value: Any) -> Any:
    # DeepSpeed does its batch arithmetic on the value as given, so "32" fails there with a TypeError.
    if isinstance(value, str):
        raise ValueError('a string is not a count; expected a positive integer, unquoted, or "auto"')
    return _no_bool(value)


PositiveInt = Annotated[int, BeforeValidator(_no_bool), Field(gt=0)]
BatchCount = Annotated[int, BeforeValidator(_no_string), Field(gt=0)]  # "auto" is its own Literal beside it
NonNegativeInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=0)]


class Section(BaseModel):
    # Unknown keys are caught earlier by keys.check_keys, with suggestions; "forbid" is the backstop.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _read_only_inside(self) -> "Section":
        # frozen=True stops a field being reassigned, not a dict or list it holds being written into.
        for name in type(self).model_fields:
            value = self.__dict__.get(name)
            if isinstance(value, (dict, list)):
                self.__dict__[name] = freeze(value)
        return self
