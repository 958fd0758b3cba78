"""phalanx.allocator: which C allocator the workers start with (PHALANX_ALLOCATOR, the shipped mimalloc, the
system's tcmalloc, a search path that hides it), what a process has, the torchrun/srun advice and the warning
a sharded level gives on glibc's malloc. One process: whether a library loads (a child process's start) is
taken as its existence here; tests/ranks/test_allocator.py and tests/e2e/test_allocator_command.py start them."""

import logging
import os
import shutil
from importlib import metadata

import pytest

from phalanx import allocator
from phalanx.errors import WorldConfigError

SHIPPED = allocator.shipped_mimalloc()


@pytest.fixture(autouse=True)
def _loadable_if_present(monkeypatch):
    monkeypatch.setattr(allocator, "preloadable", lambda path: os.path.isfile(path))

needs_wheel = pytest.mark.skipif(SHIPPED is None, reason="the cmeel-mimalloc wheel has no build for this platform")


@pytest.fixture
def said(monkeypatch):
    """What the phalanx logger says during a test, and a fresh warn-once memory."""
    monkeypatch.setattr(allocator, "_warned", set())
    records = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    allocator.logger.addHandler(handler)
    level = allocator.logger.level
    allocator.logger.setLevel(logging.DEBUG)
    yield records
    allocator.logger.removeHandler(handler)
    allocator.logger.setLevel(level)


def _no_wheel(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(allocator.metadata, "distribution", missing)


@needs_wheel
def test_auto_takes_the_systems_tcmalloc_else_the_shipped_mimalloc():
    assert SHIPPED.name == "mimalloc" and SHIPPED.path.endswith("libmimalloc.so.3"), SHIPPED
    system = allocator.system_tcmalloc()
    assert allocator.choose({}) == (system or SHIPPED)
    assert allocator.choose({"PHALANX_ALLOCATOR": "auto", "PHALANX_ALLOCATOR_SEARCH": ""}) == SHIPPED
    assert allocator.choose({"PHALANX_ALLOCATOR": "MiMalloc"}) == SHIPPED
    assert allocator.worker_preload({"LD_PRELOAD": "/opt/x/libhook.so", "PHALANX_ALLOCATOR_SEARCH": ""}) == \
        f"{SHIPPED.path} /opt/x/libhook.so"


def test_system_keeps_glibc_and_a_preloaded_allocator_is_left_alone():
    assert allocator.choose({"PHALANX_ALLOCATOR": "system"}) is None
    assert allocator.worker_preload({"PHALANX_ALLOCATOR": "system"}) is None
    for preload in ("/usr/lib/libjemalloc.so.2", "/x/libtcmalloc_minimal.so.4", "/y/libmimalloc.so"):
        assert allocator.worker_preload({"LD_PRELOAD": preload}) is None
    environ = {"PHALANX_ALLOCATOR": "system"}
    assert allocator.preload_for_workers(environ) is None
    assert environ == {"PHALANX_ALLOCATOR": "system", allocator.CHOSEN_BY_LAUNCHER: "system"}


def test_an_unknown_choice_is_a_typed_error():
    with pytest.raises(WorldConfigError, match="auto, mimalloc, tcmalloc, system"):
        allocator.choose({"PHALANX_ALLOCATOR": "hoard"})
    with pytest.raises(WorldConfigError, match="cannot be preloaded"):
        allocator.choose({"PHALANX_ALLOCATOR": "/nowhere/libmalloc.so"})


@needs_wheel
def test_the_search_path_finds_and_hides_the_systems_tcmalloc(tmp_path):
    """PHALANX_ALLOCATOR_SEARCH replaces the folders searched: a folder with a tcmalloc in it (the shipped library
    under tcmalloc's name stands in for it), and an empty path, which hides every system library."""
    shutil.copy(SHIPPED.path, tmp_path / "libtcmalloc_minimal.so.4")
    found = allocator.choose({"PHALANX_ALLOCATOR": "tcmalloc", "PHALANX_ALLOCATOR_SEARCH": f"/nowhere:{tmp_path}"})
    assert found == allocator.Allocator("tcmalloc", str(tmp_path / "libtcmalloc_minimal.so.4"), "the system")
    with pytest.raises(WorldConfigError, match="an empty search path"):
        allocator.choose({"PHALANX_ALLOCATOR": "tcmalloc", "PHALANX_ALLOCATOR_SEARCH": ""})
    assert allocator.choose({"PHALANX_ALLOCATOR_SEARCH": str(tmp_path)}) == found  # where found, it goes first
    assert allocator.choose({"PHALANX_ALLOCATOR_SEARCH": ""}) == SHIPPED  # a fresh machine: the wheel's


def test_without_the_wheel_tcmalloc_then_glibc(monkeypatch, tmp_path, said):
    """Where the wheel is missing (macOS, an unsupported architecture, a partial install) phalanx still
    imports and chooses: the system's tcmalloc if found, else the system's malloc, said at debug level."""
    _no_wheel(monkeypatch)
    assert allocator.shipped_mimalloc() is None
    assert allocator.choose({"PHALANX_ALLOCATOR_SEARCH": str(tmp_path)}) is None
    assert any("no cmeel-mimalloc installed" in r.getMessage() for r in said), [r.getMessage() for r in said]
    with pytest.raises(WorldConfigError, match="pip install cmeel-mimalloc"):
        allocator.choose({"PHALANX_ALLOCATOR": "mimalloc"})
    if SHIPPED is not None:
        shutil.copy(SHIPPED.path, tmp_path / "libtcmalloc.so.4")
        assert allocator.choose({"PHALANX_ALLOCATOR_SEARCH": str(tmp_path)}).name == "tcmalloc"


def test_off_linux_nothing_is_preloaded_or_warned(monkeypatch, said):
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.shipped_mimalloc() is None and allocator.current() == ""
    assert allocator.choose({"PHALANX_ALLOCATOR_SEARCH": ""}) is None
    assert allocator.warn_if_glibc("parameters", 0, {}) is None
    assert allocator.advice({}) == "allocator: the platform malloc (nothing to preload)"


def test_library_names():
    assert allocator.library_name("/lib/x86_64-linux-gnu/libc.so.6") == "glibc"
    assert allocator.library_name("/usr/lib/libtcmalloc_minimal.so.4") == "tcmalloc"
    assert allocator.library_name("/site-packages/cmeel.prefix/lib/libmimalloc.so.3") == "mimalloc"
    assert allocator.library_name("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2") == "jemalloc"


@needs_wheel
def test_the_advice_under_torchrun_or_srun(monkeypatch, said):
    """Rank 0 of a world of 2 or more that phalanx did not start says, in one line, which allocator it has and
    the exact LD_PRELOAD; under phalanx run / spawn (which set CHOSEN_BY_LAUNCHER), on rank 1 or alone: nothing."""
    monkeypatch.setattr(allocator, "current", lambda: "glibc")
    torchrun = {"PHALANX_ALLOCATOR_SEARCH": ""}
    line = allocator.say_at_init(0, 2, torchrun)
    assert line == (f"allocator: glibc's malloc, which keeps what sharded steps free; start the ranks with "
                    f"LD_PRELOAD={SHIPPED.path} (mimalloc, from the cmeel-mimalloc wheel; "
                    "`python -m phalanx.allocator` prints it)")
    assert [r.getMessage() for r in said if r.levelno == logging.INFO] == [line]
    assert allocator.say_at_init(1, 2, torchrun) is None
    assert allocator.say_at_init(0, 1, torchrun) is None
    assert allocator.say_at_init(0, 2, {allocator.CHOSEN_BY_LAUNCHER: "system"}) is None
    assert allocator.say_at_init(0, 2, {"PHALANX_ALLOCATOR": "system"}) == \
        "allocator: glibc's malloc (PHALANX_ALLOCATOR=system)"
    monkeypatch.setattr(allocator, "current", lambda: "mimalloc")
    assert allocator.say_at_init(0, 2, torchrun) == "allocator: mimalloc (LD_PRELOAD)"


def test_the_warning_of_a_sharded_level_on_glibc(monkeypatch, said):
    """Rank 0 warns once per process, with the measured figures and the fix; not on rank 1, not for the levels
    that measured as well on glibc, not with PHALANX_ALLOCATOR=system (chosen on purpose), not on another
    allocator."""
    monkeypatch.setattr(allocator, "current", lambda: "glibc")
    for level in ("none", "optimizer", "gradients"):
        assert allocator.warn_if_glibc(level, 0, {}) is None
    assert allocator.warn_if_glibc("parameters", 1, {}) is None
    assert allocator.warn_if_glibc("parameters", 0, {"PHALANX_ALLOCATOR": "system"}) is None
    text = allocator.warn_if_glibc("parameters", 0, {})
    on_glibc, shipped = allocator.MEASURED_PEAK_VS_NONE["parameters"]
    assert f"peak memory {on_glibc:.2f} x shard='none' on glibc, {shipped:.2f} x with mimalloc" in text, text
    assert "python -m phalanx.allocator" in text and "phalanx run" in text, text
    assert allocator.warn_if_glibc("parameters", 0, {}) is None  # once
    assert [r.getMessage() for r in said if r.levelno == logging.WARNING] == [text]
    monkeypatch.setattr(allocator, "_warned", set())
    monkeypatch.setattr(allocator, "current", lambda: "mimalloc")
    assert allocator.warn_if_glibc("parameters", 0, {}) is None
