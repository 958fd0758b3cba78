"""The package tree keeps its layers: no module imports from a package above its own, and none
imports in a cycle (pure: reads the sources with ast, imports nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"

# What each part of phalanx may import from phalanx (besides itself). Lower layers come first:
# errors and log know nobody; diagnose (the record of collectives) only them, so every layer above
# can record into it; shm and world know only those; the engine builds on shm and world; the
# launcher, data and checkpoints on the world; the bundled tools and the public face on everything.
ALLOWED = {
    "errors": set(),
    "log": set(),
    "hooks": set(),
    "diagnose": {"errors", "log"},
    "shm": {"errors", "log"},
    "world": {"errors", "log", "diagnose"},
    "nn": {"errors"},
    "bucket": {"errors", "world"},
    "exchange": {"errors", "log", "diagnose", "shm", "bucket"},
    "sharding": {"errors", "bucket", "exchange"},
    "engine": {"errors", "log", "shm", "world", "nn", "diagnose", "bucket", "exchange", "sharding"},
    "data": {"errors", "log", "world", "diagnose"},
    "checkpoint": {"errors", "log", "world", "engine", "sharding", "diagnose"},
    "launch": {"errors", "log", "world", "diagnose"},
    "testing": {"launch"},
    "tools": {"errors", "log", "world", "shm", "engine", "exchange", "data", "checkpoint", "launch", "hooks", "nn",
              "testing", "diagnose"},
    "cli": {"errors", "__init__"},  # `phalanx --version` reads phalanx.__version__
    "__main__": {"cli"},
}


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: Path) -> set[str]:
    """The top-level phalanx parts `path` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    package = list(path.relative_to(PACKAGE).parent.parts)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                dotted = base + (node.module.split(".") if node.module else [])
                if not dotted:  # `from . import x`: x is a part, or a name of the package's __init__
                    found.update(alias.name if alias.name in ALLOWED else "__init__" for alias in node.names)
                else:
                    found.add(dotted[0])
            elif node.module and node.module.split(".")[0] == "phalanx":
                parts = node.module.split(".")
                found.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "phalanx" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_module_imports_only_from_its_own_layer_or_below():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = _part(path)
        if part == "__init__":
            continue  # the public face re-exports everything
        assert part in ALLOWED, f"{path.relative_to(PACKAGE)} belongs to no layer: add `{part}` to ALLOWED"
        for imported in _imports(path) - {part}:
            if imported not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(PACKAGE)} imports phalanx.{imported}")
    assert not wrong, "imports across layers:\n" + "\n".join(wrong)


def test_the_shared_memory_transport_knows_nothing_of_ddp():
    for path in (PACKAGE / "shm").rglob("*.py"):
        assert not {"engine", "hooks"} & _imports(path), path


def test_the_allowed_layers_have_no_cycle():
    seen: dict[str, int] = {}

    def visit(part: str, trail: tuple) -> None:
        assert part not in trail, f"import cycle: {' -> '.join(trail + (part,))}"
        for below in ALLOWED.get(part, ()):
            visit(below, trail + (part,))
        seen[part] = 1

    for part in ALLOWED:
        visit(part, ())
