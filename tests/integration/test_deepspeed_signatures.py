"""Signatures, not only names: every public member of our engine, every `deepspeed.comm` call we
carry and every function or class on the counted import list (docs/deepspeed_examples_imports.md)
takes DeepSpeed 0.19.8's parameters: the same names, kinds (keyword-only and so on) and defaults.
Each difference must be a row of the table in docs/deepspeed_signatures.md, with its reason, and
each row must still be a difference. Skipped where DeepSpeed is not installed."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import types
import warnings
from pathlib import Path

import pytest
import torch.nn as nn

DOCS = Path(__file__).resolve().parents[2] / "docs"
IMPORT_TABLE = DOCS / "deepspeed_examples_imports.md"
SIGNATURE_TABLE = DOCS / "deepspeed_signatures.md"
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| `(?P<parameter>[^`]+)` \| (?P<difference>[^|]+) \| (?P<why>[^|]+) \|$")


@pytest.fixture(scope="module")
def deepspeed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = pytest.importorskip("deepspeed")
    if module.__version__ != "0.19.8":
        pytest.skip(f"the table is for DeepSpeed 0.19.8; {module.__version__} is installed")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return module


def called_signature(obj) -> inspect.Signature:
    """What a caller passes: a class's __init__ without self; through DeepSpeed's decorators that do
    not keep __wrapped__ (instrument_w_nvtx, timed_op), the function they wrap."""
    if inspect.isclass(obj):
        obj = obj.__init__
    signature = inspect.signature(obj)
    kinds = [p.kind for p in signature.parameters.values()]
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD] and getattr(obj, "__closure__", None):
        inner = [cell.cell_contents for cell in obj.__closure__ if inspect.isfunction(cell.cell_contents)]
        if len(inner) == 1:
            return called_signature(inner[0])
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    return signature.replace(parameters=parameters)


def differences(name: str, theirs, ours) -> set[tuple[str, str, str]]:
    """(name, parameter, what differs) for each parameter whose presence, kind or default differs."""
    try:
        their_sig, our_sig = called_signature(theirs), called_signature(ours)
    except (TypeError, ValueError):
        return set()  # a builtin without a signature: nothing to compare
    their_params, our_params = their_sig.parameters, our_sig.parameters
    found = set()
    for parameter in dict.fromkeys([*their_params, *our_params]):
        mine, theirs_p = our_params.get(parameter), their_params.get(parameter)
        if mine is None:
            found.add((name, parameter, "missing"))
        elif theirs_p is None:
            found.add((name, parameter, "extra"))
        elif mine.kind != theirs_p.kind:
            found.add((name, parameter, "kind"))
        elif repr(mine.default) != repr(theirs_p.default):
            found.add((name, parameter, "default"))
    their_order = [p for p in their_params if p in our_params]
    our_order = [p for p in our_params if p in their_params]
    if their_order != our_order:
        found.add((name, "*", "order"))
    return found


def counted_names() -> list[tuple[str, str]]:
    """(module path, name) for every name imported or used as an attribute in the counted table."""
    pairs = []
    for line in IMPORT_TABLE.read_text().splitlines():
        match = re.match(r"\| `(deepspeed[\w.]*)` \| [^|]* \| \d+ \| [^|]* \| ([^|]*) \| ([^|]*) \|", line)
        if match:
            pairs += [(match.group(1), name) for column in match.groups()[1:] for name in re.findall(r"`(\w+)`", column)]
    return sorted(set(pairs))


def listed() -> dict[tuple[str, str], str]:
    rows = {}
    for line in SIGNATURE_TABLE.read_text().splitlines():
        match = ROW.match(line.strip())
        if match:
            rows[(match["name"], match["parameter"])] = match["why"].strip()
    return rows


def our_module(path: str) -> str:
    return "autotuner.zero" if path == "deepspeed.zero" else "autotuner" + path[len("deepspeed"):]


def their_module(path: str) -> str:
    return "deepspeed.runtime.zero" if path == "deepspeed.zero" else path


def engine_differences() -> set[tuple[str, str, str]]:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from autotuner.runtime.engine import Engine

    module_members = set(dir(nn.Module))
    their_source = inspect.getsource(DeepSpeedEngine)
    found = set()
    # DeepSpeed's attribute pass-through to the wrapped model is part of its engine's surface.
    passed_through = ["__getattr__"]
    for member in sorted([*passed_through, *(name for name in dir(Engine)
                                             if not name.startswith("_") and name not in module_members)]):
        ours = inspect.getattr_static(Engine, member)
        if not hasattr(DeepSpeedEngine, member):
            # DeepSpeed sets many of its engine's attributes in __init__: those exist, as attributes.
            is_attribute = re.search(rf"self\.{member}\s*[:=]|__dict__\[['\"]{member}['\"]\]\s*=", their_source) is not None
            if not (is_attribute and not callable(ours)):
                found.add((f"Engine.{member}", "-", "not DeepSpeed's"))
            continue
        theirs = inspect.getattr_static(DeepSpeedEngine, member)
        if isinstance(ours, property) or isinstance(theirs, property):
            if isinstance(ours, property) != isinstance(theirs, property):
                found.add((f"Engine.{member}", "-", "property in one only"))
            continue
        found |= differences(f"Engine.{member}", getattr(DeepSpeedEngine, member), getattr(Engine, member))
    return found


def import_list_differences() -> set[tuple[str, str, str]]:
    import autotuner.runtime.comm as our_comm

    found = set()
    names = counted_names() + [("deepspeed.comm", name) for name in our_comm.__all__]
    for path, name in sorted(set(names)):
        qualified = f"{path}:{name}"
        try:
            theirs = getattr(importlib.import_module(their_module(path)), name)
        except (ImportError, AttributeError):
            theirs = None
        try:
            ours = getattr(importlib.import_module(our_module(path)), name)
        except (ImportError, AttributeError):
            ours = None
        if theirs is None or ours is None:
            if theirs is not None and isinstance(theirs, types.ModuleType):
                continue
            if theirs is not None or ours is not None:
                found.add((qualified, "-", "not in DeepSpeed 0.19.8" if theirs is None else "not carried"))
            continue
        if isinstance(theirs, types.ModuleType) or not callable(theirs):
            continue
        if hasattr(ours, "refused_feature"):  # refused on use, whatever the arguments: one row says so
            found.add((qualified, "*", "refused on use"))
            continue
        if inspect.isclass(theirs) != inspect.isclass(ours):
            found.add((qualified, "-", "a class in one only"))
        found |= differences(qualified, theirs, ours)
    return found


def test_every_signature_difference_is_listed_with_its_reason(deepspeed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = engine_differences() | import_list_differences()
    rows = listed()
    wildcard = {parameter for (name, parameter) in rows if name == "deepspeed.comm:*"}
    unlisted = sorted(f"{name} {parameter} ({what})" for name, parameter, what in found
                      if (name, parameter) not in rows
                      and not (name.startswith("deepspeed.comm:") and parameter in wildcard))
    assert not unlisted, "signature differences from DeepSpeed 0.19.8 not in docs/deepspeed_signatures.md:\n" + \
        "\n".join(unlisted)
    stale = sorted(f"{name} {parameter}" for name, parameter in rows
                   if name != "deepspeed.comm:*" and not any(f[:2] == (name, parameter) for f in found))
    assert not stale, "rows of docs/deepspeed_signatures.md that are no longer differences:\n" + "\n".join(stale)
    assert all(why for why in rows.values())


def test_the_engine_passes_attributes_to_the_model_as_deepspeeds_does(deepspeed):
    # Both engines override nn.Module's lookup with a pass-through to the wrapped model (what it
    # passes, and its precedence, is tested on a real run in test_deepspeed_chat.py).
    from deepspeed.runtime.engine import DeepSpeedEngine

    from autotuner.runtime.engine import Engine

    assert DeepSpeedEngine.__getattr__ is not nn.Module.__getattr__
    assert Engine.__getattr__ is not nn.Module.__getattr__
    assert not differences("Engine.__getattr__", DeepSpeedEngine.__getattr__, Engine.__getattr__)


def test_the_comparison_sees_a_difference():
    # A check that cannot fail is no check: an extra and a missing parameter are both found.
    def theirs(a, b=1, *, c=None):
        return a

    def ours(a, b=2, d=None):
        return a

    assert differences("f", theirs, ours) == {("f", "b", "default"), ("f", "c", "missing"), ("f", "d", "extra")}
