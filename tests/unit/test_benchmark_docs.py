"""docs/benchmarks.md and benchmarks/ agree: every script, file and flag the page names exists, every table of
figures is followed by the command that reproduces it and the scenario that produces it, and every scenario of the
suite (benchmarks/scenarios.py) is named on the page.

Pure: reads the page and the sources as text, and loads the scenario registry alone from its file (no torch).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
BENCHMARKS = ROOT / "benchmarks"
MAX_LINES = 600
MAX_TOP_LEVEL_FILES = 6

# A path in the checkout the page names: a script, a test, an example, a saved result.
PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|tests|examples|phalanx)/[\w./*{},-]*\w)")
# What makes a line a command that reproduces a figure.
COMMAND = re.compile(r"benchmarks/[\w/]+\.(?:py|sh)|phalanx bench|phalanx run|python -m|pytest")
# A scenario the page names: "scenario `area.what`", "scenarios `a.b`, `c.d`" (wrapped lines joined).
SCENARIOS_NAMED = re.compile(r"[Ss]cenarios? ((?:`[a-z_]+\.[a-z0-9_]+`(?:,\s*|\s+and\s+)?)+)")
REGISTRY = ROOT / "benchmarks" / "scenarios.py"
# Where `phalanx bench` and its modes define their flags.
BENCH_SOURCES = [ROOT / "phalanx" / "cli.py", *sorted((ROOT / "phalanx" / "tools").glob("*.py"))]


def page() -> str:
    return PAGE.read_text()


def commands(text: str) -> list[str]:
    """Every command the page shows: the lines of its fenced blocks and its inline code spans (which may wrap)."""
    found, inline = [], []
    in_block = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            found.append(line.split("  #")[0])
        else:
            inline.append(line)
    found += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", "\n".join(inline))]
    return found


def flags(command: str, after: str) -> list[str]:
    """The `--flags` of `command` that come after `after` (values and placeholders left out)."""
    tail = command.split(after, 1)[1]
    return [token.split("=")[0].rstrip(".,;)]") for token in tail.split() if token.startswith("--")]


def defined(flag: str, sources: list[Path]) -> bool:
    """Whether an argparse flag (or the --no- form of a BooleanOptionalAction one) is defined in `sources`."""
    texts = [source.read_text() for source in sources]
    if any(f'"{flag}"' in text for text in texts):
        return True
    positive = "--" + flag.removeprefix("--no-")
    return flag.startswith("--no-") and any(f'"{positive}"' in text and "BooleanOptionalAction" in text
                                             for text in texts)


def test_the_page_is_a_reference_of_at_most_600_lines():
    lines = len(page().splitlines())
    assert lines <= MAX_LINES, f"docs/benchmarks.md has {lines} lines, more than {MAX_LINES}: move reasoning into " \
                               "the page of the feature it explains, history into git"


def test_every_path_the_page_names_exists():
    missing = []
    named = [path for path in set(PATH.findall(page())) if Path(path).suffix or path.count("/") >= 2]
    assert len(named) >= 20, "the paths docs/benchmarks.md names were not found"
    for path in sorted(named):  # phalanx/torch is a ratio, not a path: paths have a suffix or two levels
        pattern = re.sub(r"\{[^}]*\}", "*", path)
        if not (list(ROOT.glob(pattern)) if "*" in pattern else (ROOT / path).exists()):
            missing.append(path)
    assert not missing, f"docs/benchmarks.md names paths that do not exist: {missing}"


def test_every_phalanx_bench_flag_exists():
    unknown = sorted({(flag, command) for command in commands(page()) if "phalanx bench" in command
                      for flag in flags(command, "phalanx bench") if not defined(flag, BENCH_SOURCES)})
    assert not unknown, f"`phalanx bench` flags on docs/benchmarks.md that phalanx/tools and cli.py lack: {unknown}"


def test_every_script_and_module_flag_exists():
    unknown = []
    for command in commands(page()):
        for script in re.findall(r"(benchmarks/[\w/]+\.py)", command):
            if (ROOT / script).exists():
                unknown += [(flag, script) for flag in flags(command, script) if not defined(flag, [ROOT / script])]
        for module in re.findall(r"python -m (phalanx\.tools\.\w+)", command):
            source = ROOT / (module.replace(".", "/") + ".py")
            assert source.exists(), f"docs/benchmarks.md runs {module}, which does not exist"
            unknown += [(flag, module) for flag in flags(command, module) if not defined(flag, [source])]
    assert not unknown, f"flags on docs/benchmarks.md that their script or module does not define: {unknown}"


def tables_and_what_follows(text: str) -> list[tuple[int, str, str]]:
    """(line, heading, the text after the table up to the next table or heading) for each table of figures:
    every table from the `## Machines` section on (the ones above describe the tool, not a measurement)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Machines"))
    found, heading, i = [], "", start
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = lines[i]
        if lines[i].startswith("|"):
            first = i
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            after = []
            while i < len(lines) and not lines[i].startswith(("|", "#")):
                after.append(lines[i])
                i += 1
            found.append((first + 1, heading, "\n".join(after)))
            continue
        i += 1
    return found


def test_every_table_of_figures_is_followed_by_its_command():
    tables = tables_and_what_follows(page())
    assert len(tables) >= 10, "the page's tables of figures were not found"
    bare = [f"line {line} ({heading})" for line, heading, after in tables if not COMMAND.search(after)]
    assert not bare, f"tables on docs/benchmarks.md not followed by the command that produces them: {bare}"


def test_benchmarks_are_grouped_by_area_and_each_script_is_listed():
    top = sorted(path.name for path in BENCHMARKS.iterdir() if path.is_file())
    assert len(top) <= MAX_TOP_LEVEL_FILES, f"benchmarks/ holds {len(top)} files side by side: {top}; " \
                                            "put each in the folder of its area"
    readme = (BENCHMARKS / "README.md").read_text()
    scripts = sorted(str(path.relative_to(BENCHMARKS)) for pattern in ("*/*.py", "*/*.sh")
                     for path in BENCHMARKS.glob(pattern))
    unlisted = [script for script in scripts if Path(script).name not in readme]
    assert not unlisted, f"benchmarks/README.md does not list {unlisted}"


def registry():
    """benchmarks/scenarios.py on its own (it imports nothing of phalanx, so no torch)."""
    spec = importlib.util.spec_from_file_location("_bench_scenarios_for_docs", REGISTRY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def scenarios_named(text: str) -> set[str]:
    groups = SCENARIOS_NAMED.findall(" ".join(text.split()))
    return {name for group in groups for name in re.findall(r"`([^`]+)`", group)}


def test_every_scenario_the_page_names_exists_and_every_scenario_is_named():
    known = set(registry().BY_NAME)
    named = scenarios_named(page())
    assert len(named) >= 20, f"the scenarios docs/benchmarks.md names were not found: {sorted(named)}"
    assert not named - known, f"docs/benchmarks.md names scenarios benchmarks/scenarios.py lacks: " \
                              f"{sorted(named - known)}; the known ones: {sorted(known)}"
    assert not known - named, f"scenarios no figure on docs/benchmarks.md names: {sorted(known - named)}"


def test_every_table_of_figures_names_its_scenario():
    bare = [f"line {line} ({heading})" for line, heading, after in tables_and_what_follows(page())
            if not scenarios_named(after)]
    assert not bare, f"tables on docs/benchmarks.md not followed by the scenario that produces them: {bare}"
