"""What a training script imports, read from its source (nothing is run): at any depth (a library
imported inside main() is imported by every launch all the same), and through the script's own
modules beside it, which are read in its place.

Two readers of the same walk: the warm path preloads the installed modules (`script_imports`),
and the engine decision (app/engines.py) reads where each engine is imported (`import_sites`),
installed or not: a `try: import deepspeed` falls back where DeepSpeed is missing.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ImportSite:
    """Where a module (or a name from one) is first imported."""

    name: str  # "module" or "module:name", as `from module import name` imports it
    path: Path  # the file that imports it: the script, or one of its own modules beside it
    line: int  # 1-based

    @property
    def top_level(self) -> str:
        return top_level(self.name)


def top_level(name: str) -> str:
    """The package a "module.sub:name" import belongs to ("module")."""
    return name.split(":")[0].split(".")[0]


def import_sites(script: str) -> list[ImportSite]:
    """Every module the script and its own modules import, each at its first site (files in the
    order they are reached, lines in order within a file); installed or not."""
    return _walk(script)[0]


def own_modules(script: str) -> list[Path]:
    """The script's own modules beside it that it imports, at any depth, in the order reached."""
    return _walk(script)[1][1:]


# Each script is parsed once per process while its files are unchanged: a tune asks several times.
_walked: dict[Path, tuple[tuple[tuple[Path, tuple[int, int] | None], ...], tuple[list[ImportSite], list[Path]]]] = {}


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def _walk(script: str) -> tuple[list[ImportSite], list[Path]]:
    """The import sites, and the files read: the script, then its own modules."""
    root = Path(script).resolve()
    cached = _walked.get(root)
    if cached is None or any(_stamp(path) != stamp for path, stamp in cached[0]):
        sites, read = _parse_walk(root)
        cached = (tuple((path, _stamp(path)) for path in [root, *read]), (sites, read))
        _walked[root] = cached
    sites, read = cached[1]
    return list(sites), list(read)


def _parse_walk(script: Path) -> tuple[list[ImportSite], list[Path]]:
    script_dir = script.parent
    found: dict[str, ImportSite] = {}
    pending, seen = [script], []
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen.append(path)
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue
        nodes = sorted((node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))),
                       key=lambda node: (node.lineno, node.col_offset))
        for node in nodes:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.module and not node.level:
                names = [node.module, *(f"{node.module}:{alias.name}" for alias in node.names if alias.name != "*")]
            for name in names:
                local = script_dir / (top_level(name) + ".py")
                if local.is_file():
                    pending.append(local)
                elif name not in found:
                    found[name] = ImportSite(name, path, node.lineno)
    return list(found.values()), seen


def script_imports(script: str) -> list[str]:
    """The installed modules the script imports, as "module" or "module:name": what the warm path
    preloads. The script's own modules beside it are read, never preloaded (they may do work at
    import)."""
    script_dir = Path(script).resolve().parent
    return [site.name for site in import_sites(script) if _installed(site.top_level, script_dir)]


def _installed(top_level: str, script_dir: Path) -> bool:
    if top_level == "__future__":
        return False
    try:
        spec = importlib.util.find_spec(top_level)  # a top-level name only: finding it imports nothing
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        # None for a namespace package too: a folder found on the tuner's path (a `data/` beside
        # the working directory) is no sign of what the script, with the paths it adds itself,
        # imports under that name. Preloaded, it shadowed the script's own data.py in every rank.
        return False
    return script_dir not in Path(spec.origin).resolve().parents
