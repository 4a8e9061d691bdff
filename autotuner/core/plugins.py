"""Installed extensions: tuners, backends and dimensions that live outside this package.

A distribution declares entry points in the group `autotuner.plugins` (in its pyproject.toml:
`[project.entry-points."autotuner.plugins"] name = "module"` or `"module:function"`). The
launcher imports each once before it parses its command line; a module registers what it
carries at import (`register_tuner`, `register_backend`, `register_dimension`), and a function
named by the entry point is called with no arguments. This is how pytest and optuna-integration
find their plugins, and it means no edit to this package for a tuner, backend or dimension that
fits the existing hooks, a dimension with a config key of its own included: the config loader
loads the plugins first in any process (a rank too), so their sections are known wherever a
config is read (docs/architecture.md, "Extensions, and what each costs").
"""

from __future__ import annotations

from importlib.metadata import entry_points

from autotuner.core.errors import UsageError

GROUP = "autotuner.plugins"
_loaded: dict[str, str] = {}  # entry-point name -> its value, for the ones imported in this process
_scanned = False  # whether load_plugins ran in this process


def load_plugins() -> dict[str, str]:
    """Import every plugin of GROUP not imported yet; a broken one is refused by name (exit 2)."""
    global _scanned
    _scanned = True
    for point in entry_points(group=GROUP):
        if point.name in _loaded:
            continue
        try:
            loaded = point.load()
            if callable(loaded):
                loaded()
        except Exception as err:  # noqa: BLE001 - any failure of a third party's import is reported the same way
            raise UsageError(f"plugin {point.name!r} ({point.value}, entry point group {GROUP}) failed to load: "
                             f"{type(err).__name__}: {err}; fix or uninstall it") from err
        _loaded[point.name] = point.value
    return dict(_loaded)


def plugins_loaded() -> None:
    """load_plugins() once per process: what the config loader calls before it validates a config,
    so a plugin's dimension's section is known wherever a config is read (in every rank too, and
    in a script's own helpers before initialize), not only where the launcher loaded them."""
    if not _scanned:
        load_plugins()
