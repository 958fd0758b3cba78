"""The package tree keeps its layers: every import points down the layers and is one its part may
make, no two modules import each other in a circle, and no package outgrows a reader's head (pure:
reads the sources with ast, imports nothing)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "phalanx"

# The parts of phalanx from the bottom layer up; a part imports only from layers below its own.
# errors and log know nobody; diagnose (the record of collectives) only them, so every layer above
# can record into it; allocator too (the workers' C allocator: the launchers preload it, init() and
# the sharded fronts tell what a process has), and shm (segments and futex barriers between the ranks
# of a host); world and nn know only those. The DDP engine is
# three layers: bucket/ (the bucket, its per-rank cut and the step guard: what the exchange and the
# engine share), then
# exchange/ (how a bucket becomes its average), then sharding/ (optimizers on the owned chunks), then
# engine/ (the front and the reducer, which use all three). The launcher, data and checkpoints build
# on the world (checkpoints on the engine too), the trainers' integrations on the engine, the StepLog
# (observe/) on the world and the record; the public
# face on everything the library holds; the bundled tools on the face; the command on the tools.
LAYERS = [
    {"errors", "log", "hooks"},
    {"diagnose", "allocator", "shm"},
    {"world", "nn"},
    {"bucket"},
    {"exchange"},
    {"sharding"},
    {"engine"},
    {"data", "checkpoint", "launch", "integrations", "observe"},
    {"testing"},
    {"__init__", "metrics"},
    {"tools", "warm", "eager"},
    {"cli"},
    {"__main__"},
]

# What each part may import from phalanx (besides itself): finer than the layers (data, for one,
# has no business with the engine below it). Every entry points down the layers (checked below).
ALLOWED = {
    "errors": set(),
    "log": set(),
    "hooks": set(),
    "diagnose": {"errors", "log"},
    "allocator": {"errors", "log"},
    "shm": {"errors", "log"},
    "world": {"errors", "log", "diagnose", "allocator", "shm"},  # shm: the ranks of a host agree on a commit
    "nn": {"errors"},
    "bucket": {"errors", "world", "diagnose"},  # diagnose: the step clock the step guard's waits add to
    "exchange": {"errors", "log", "diagnose", "shm", "bucket"},
    "sharding": {"errors", "log", "world", "bucket", "exchange"},  # world, log: live recovery's shard copies
    "engine": {"errors", "log", "world", "nn", "diagnose", "allocator", "bucket", "exchange", "sharding"},
    "data": {"errors", "log", "world", "diagnose"},
    "checkpoint": {"errors", "log", "world", "engine", "sharding", "diagnose"},
    "launch": {"errors", "log", "world", "diagnose", "allocator"},
    "integrations": {"errors", "log", "engine"},
    "observe": {"errors", "log", "world", "diagnose"},
    "testing": {"launch"},
    "__init__": {"errors", "log", "hooks", "diagnose", "shm", "world", "nn", "engine", "data", "checkpoint", "launch",
                 "integrations", "observe"},
    "tools": {"errors", "log", "world", "shm", "engine", "exchange", "data", "checkpoint", "launch", "hooks", "nn",
              "testing", "diagnose", "allocator", "__init__"},
    "warm": {"errors", "allocator", "launch", "diagnose"},  # `phalanx warm`: forks the command it is handed (cli.py)
    "metrics": {"data"},  # phalanx.metrics is phalanx.data.metrics, under its old name
    # `phalanx --version` reads phalanx.__version__; commands are found by name, except `run`, whose launcher
    # is prepared before torch is imported (launch/forkserver/prepare.py)
    "cli": {"errors", "__init__", "launch"},
    "__main__": {"cli"},
    "eager": {"__init__"},  # the fork server's preload: what the first public name loads (launch/spawn.py)
}

MAX_MODULES = 12  # per package, its __init__ included: past that, a package splits along a real seam


def _name(path: Path) -> str:
    """The dotted module name of a source file: phalanx/engine/ddp.py -> phalanx.engine.ddp."""
    parts = ["phalanx", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _part(module: str) -> str:
    """The top-level part a module belongs to: phalanx.engine.ddp -> engine, phalanx -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _targets(importer: str, dotted: str, names: list[str]) -> set[str]:
    """The phalanx modules that `from dotted import names`, in `importer`, loads: each name that is a
    submodule, else `dotted` itself; and the packages above those, whose __init__ runs first, unless
    they hold `importer` (then they are loading already, and nothing is read from them)."""
    explicit = {f"{dotted}.{name}" if f"{dotted}.{name}" in MODULES else dotted for name in names or [""]}
    found = {module for module in explicit if module in MODULES}
    holding = {".".join(importer.split(".")[:n]) for n in range(1, importer.count(".") + 2)}
    for module in set(found):
        parts = module.split(".")
        found |= {".".join(parts[:n]) for n in range(2, len(parts))} - holding
    return found


def _imports(module: str) -> set[str]:
    """The phalanx modules `module` imports, wherever the import stands (a function's body too), relative
    imports resolved, `importlib.import_module("phalanx....")` with a literal name included."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            dotted = ".".join(base + (node.module.split(".") if node.module else []))
            if dotted.split(".")[0] == "phalanx":
                found |= _targets(module, dotted, [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "phalanx":
                    found |= _targets(module, alias.name, [])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == "phalanx"):
            found |= _targets(module, node.args[0].value, [])
    return found - {module}


@functools.cache
def graph() -> dict[str, set[str]]:
    """{module: the phalanx modules it imports}; parsed when a test asks (~1 s), not as every pytest worker
    collects this file."""
    return {module: _imports(module) for module in MODULES}


def _layer(part: str) -> int:
    return next(level for level, parts in enumerate(LAYERS) if part in parts)


def test_every_part_has_a_layer_and_a_list_of_what_it_may_import():
    parts = {_part(module) for module in MODULES}
    assert parts <= set(ALLOWED), f"parts without an entry in ALLOWED: {sorted(parts - set(ALLOWED))}"
    assert set(ALLOWED) == set().union(*LAYERS), "ALLOWED and LAYERS name different parts"


def test_what_each_part_may_import_lies_below_it():
    upward = [f"{part} -> {below}" for part, allowed in ALLOWED.items() for below in allowed
              if _layer(below) >= _layer(part)]
    assert not upward, "ALLOWED lets a part import from its own layer or one above:\n" + "\n".join(upward)


def test_every_module_imports_only_what_its_part_may():
    wrong = []
    for module, imported in graph().items():
        part = _part(module)
        for other in sorted(imported):
            if _part(other) != part and _part(other) not in ALLOWED[part]:
                wrong.append(f"{MODULES[module].relative_to(PACKAGE)} imports {other}")
    assert not wrong, "imports across layers:\n" + "\n".join(wrong)


def test_no_module_imports_itself_through_others():
    """No import circle anywhere in phalanx, at the level of modules (inside a package too)."""
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            cycle = trail[trail.index(module):] + [module]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(graph()[module]):
            visit(imported, trail + [module])
        done.add(module)

    for module in MODULES:
        visit(module, [])


def test_the_shared_memory_transport_knows_nothing_of_ddp():
    for module, imported in graph().items():
        if _part(module) == "shm":
            assert not {"engine", "exchange", "sharding", "bucket", "hooks"} & {_part(m) for m in imported}, module


def test_the_ddp_front_names_no_exchange_but_the_chooser():
    """A new transport edits exchange/choose.py, not the front."""
    front = {m for m in graph()["phalanx.engine.ddp"] if _part(m) == "exchange"} - {"phalanx.exchange"}
    assert front == {"phalanx.exchange.choose"}, front


def test_each_package_says_what_it_is_for_and_what_it_may_import():
    for package in sorted(path.parent for path in PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        said = doc.split("May import:")[-1].strip().rstrip(".") if "May import:" in doc else None
        assert said is not None, f"{package.name}/__init__.py: a docstring ending in 'May import: ...'"
        parts = {"__init__" if name == "phalanx" else name for name in map(str.strip, said.split(","))}
        assert parts == ALLOWED[package.name], (package.name, sorted(parts ^ ALLOWED[package.name]))


def test_no_package_holds_more_than_twelve_modules():
    for package in [path for path in PACKAGE.rglob("*") if path.is_dir() and (path / "__init__.py").exists()]:
        modules = sorted(path.name for path in package.glob("*.py"))
        assert len(modules) <= MAX_MODULES, f"{package.relative_to(PACKAGE.parent)} holds {len(modules)} modules: " \
                                            f"split it along a real seam ({modules})"
