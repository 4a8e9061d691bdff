"""Read-only configs inside frozen records.

A frozen dataclass stops its fields from being reassigned, not a dict it holds from being
written into. `freeze` makes a JSON-like value read-only at every depth: dicts and lists become
`FrozenDict` and `FrozenList`, which are still a `dict` and a `list` to every reader (isinstance,
json, pydantic, ==) but raise on any write. A copy is where changes go: `copy.deepcopy` and
`thaw` give plain, writable dicts and lists.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn


class FrozenError(TypeError):
    """A write into a frozen record's config: copy it first (copy.deepcopy or thaw)."""


def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
    raise FrozenError(f"{type(self).__name__} is read-only (a frozen record's config): copy it to change it")


class FrozenDict(dict):
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return {key: copy.deepcopy(value, memo) for key, value in self.items()}

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


class FrozenList(list):
    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __copy__(self) -> list:
        return list(self)

    def __deepcopy__(self, memo: dict) -> list:
        return [copy.deepcopy(value, memo) for value in self]

    def __reduce__(self):
        return (FrozenList, (list(self),))


def freeze(value: Any) -> Any:
    """`value` read-only at every depth (dicts and lists; anything else as it is)."""
    if isinstance(value, (FrozenDict, FrozenList)):
        return value
    if isinstance(value, dict):
        return FrozenDict({key: freeze(item) for key, item in value.items()})  # (dict's own __init__ fills it)
    if isinstance(value, list):
        return FrozenList(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """A writable deep copy of a (frozen) value."""
    return copy.deepcopy(value)
