"""DeepSpeed's import paths live in autotuner/deepspeed_paths/ and keep their `autotuner.*` names
through one alias table (autotuner/deepspeed_paths/aliases.py): the alias and the real path are
the same module object, and a name the table does not cover is not importable."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import autotuner
from autotuner.deepspeed_paths import aliases

PACKAGE = Path(autotuner.__file__).resolve().parent
REAL_MODULES = sorted(info.name for info in pkgutil.walk_packages(
    importlib.import_module(aliases.REAL_PACKAGE).__path__, prefix=f"{aliases.REAL_PACKAGE}."))
# Every real module at an aliased path, with its DeepSpeed-path name.
ALIASED_MODULES = {f"autotuner.{real[len(aliases.REAL_PACKAGE) + 1:]}": real for real in REAL_MODULES
                   if aliases.real_name(f"autotuner.{real[len(aliases.REAL_PACKAGE) + 1:]}") == real}


@pytest.mark.parametrize("alias", sorted(aliases.ALIASES))
def test_every_alias_in_the_table_is_its_real_module(alias):
    real = importlib.import_module(aliases.ALIASES[alias])
    assert importlib.import_module(alias) is real
    assert real.__spec__.name == real.__name__ == aliases.ALIASES[alias]  # the alias keeps the real spec


@pytest.mark.parametrize("alias", sorted(ALIASED_MODULES))
def test_every_module_under_an_alias_is_the_same_object(alias):
    assert importlib.import_module(alias) is importlib.import_module(ALIASED_MODULES[alias])


def test_every_module_here_but_the_table_and_the_refusals_is_aliased():
    # A DeepSpeed path added to the folder but not to the table would be unreachable at its old name.
    unaliased = set(REAL_MODULES) - set(ALIASED_MODULES.values())
    assert unaliased == {f"{aliases.REAL_PACKAGE}.aliases", f"{aliases.REAL_PACKAGE}.runtime",
                         f"{aliases.REAL_PACKAGE}.unsupported"}


def test_the_engines_rooms_do_not_take_a_deepspeed_path():
    # autotuner.runtime.zero is DeepSpeed's deepspeed.runtime.zero (the table): a room of that name would shadow it.
    rooms = {p.name for p in (PACKAGE / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert rooms and not rooms & {path.partition(".")[2] for path in aliases.ALIASED if path.startswith("runtime.")}


def test_names_from_an_alias_are_the_real_classes():
    from autotuner.deepspeed_paths.runtime.zero import partition_parameters
    from autotuner.zero import Init

    import autotuner.comm as dist

    assert Init is partition_parameters.Init
    assert dist is importlib.import_module("autotuner.deepspeed_paths.comm")
    assert autotuner.runtime.zero.partition_parameters.ZeroParamStatus is partition_parameters.ZeroParamStatus
    assert autotuner.moe.layer.MoE is importlib.import_module("autotuner.deepspeed_paths.moe.layer").MoE


def test_find_spec_works_on_an_alias():
    assert importlib.util.find_spec("autotuner.moe.layer") is not None
    spec = aliases.AliasFinder().find_spec("autotuner.pipe")  # as the import system sees it before the import
    assert spec.name == "autotuner.pipe" and spec.submodule_search_locations is not None
    assert spec.origin == importlib.util.find_spec("autotuner.deepspeed_paths.pipe").origin
    module = importlib.util.module_from_spec(spec)  # the import system's steps, without sys.modules
    spec.loader.exec_module(module)
    assert module is importlib.import_module("autotuner.deepspeed_paths.pipe")
    assert module.__spec__.name == "autotuner.deepspeed_paths.pipe"


@pytest.mark.parametrize("name", ["autotuner.moe.nonexistent", "autotuner.runtime.zero.nonexistent",
                                  "autotuner.nonexistent", "autotuner.deepspeed_paths.moe.nonexistent"])
def test_a_name_the_table_does_not_cover_is_not_importable(name):
    with pytest.raises(ModuleNotFoundError, match=name.replace(".", r"\.")):
        importlib.import_module(name)


def test_only_the_aliased_names_are_mapped():
    assert aliases.real_name("autotuner.moe.layer") == "autotuner.deepspeed_paths.moe.layer"
    assert aliases.real_name("autotuner.runtime.zero") == "autotuner.deepspeed_paths.runtime.zero"
    for name in ("torch", "autotuner", "autotuner.runtime", "autotuner.runtime.engine", "autotuner.deepspeed_paths.moe",
                 "autotuner.moen", "autotuner.config"):
        assert aliases.real_name(name) is None, name


def test_the_package_imports_the_real_paths_not_the_aliases():
    # The aliases are for scripts; the package's own imports name the real modules, which is what
    # lint-imports checks (an import of an alias would hide an edge from it).
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}" for name in names
                      if aliases.real_name(name) is not None]
    assert not found, "imports of alias paths (import the real autotuner.deepspeed_paths module):\n" + "\n".join(found)


def test_the_package_root_has_at_most_12_entries():
    """Issue 47's goal: at most 12 entries at the package root. The DeepSpeed paths moving into
    deepspeed_paths/ took it from 29 to 16, the shared modules moving into core/ to 10."""
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.startswith("."))
    assert len(entries) <= 12, entries
