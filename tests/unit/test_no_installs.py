"""Tests never change the machine they run on (issue 50: `make test` as root ran apt-get, and its parallel workers
raced for dpkg's lock): the SLURM cluster without SLURM is unavailable, naming the command that installs it
(.ci/run installs it before `make test`), and no code under tests/ or benchmarks/ runs an installer."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT
from tests.helpers.slurm_cluster import ClusterUnavailable, SlurmCluster

# A program that installs or removes packages (or refreshes their lists), as argv[0] of a command.
INSTALLERS = frozenset({"apt-get", "apt", "aptitude", "dpkg", "yum", "dnf", "apk", "zypper", "snap", "brew"})
# A program that installs only when told `install` (pip, `python -m pip`, uv, conda).
INSTALLING_WITH_INSTALL = frozenset({"pip", "pip3", "uv", "conda", "mamba"})


def test_a_cluster_without_slurm_is_unavailable_with_the_install_command_and_runs_nothing(monkeypatch):
    """Root, iproute2 and apt-get here, SLURM's daemons not: start() says what to install, and runs no command
    (each would answer as apt-get did under the suite's parallel workers)."""
    ran = []

    def run(command, *args, **kwargs):
        ran.append(tuple(command))
        return subprocess.CompletedProcess(command, 100, "", "E: Could not get lock /var/lib/dpkg/lock-frontend")

    real_exists = os.path.exists
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name, *_: f"/usr/bin/{name}" if name in {"ip", "apt-get"} else None)
    monkeypatch.setattr(os.path, "exists", lambda path: False if "slurm" in str(path) or "munge" in str(path)
                        else real_exists(path))
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(ClusterUnavailable) as raised:
        SlurmCluster(nodes=2, cpus=2).start()
    assert ran == [], f"commands ran: {ran}"
    message = str(raised.value)
    assert "SLURM is not installed" in message, message
    assert "`apt-get install slurmctld slurmd slurm-client munge`, as .ci/run does" in message, message


# -- no code of the tests installs anything ---------------------------------------------------------------------

def _words(node: ast.AST) -> list[str | None]:
    """A command's words as the source spells them: string constants, None for anything else (sys.executable)."""
    elements = node.elts if isinstance(node, (ast.List, ast.Tuple)) else node.args if isinstance(node, ast.Call) else []
    return [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in elements]


def _installs(words: list[str | None]) -> bool:
    """Whether a command of these words installs: argv[0] an installer, or pip & co. told `install`."""
    program = os.path.basename(words[0]) if words and words[0] else None
    if program in INSTALLERS:
        return True
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else None  # sys.executable -m pip install
    return module == "ensurepip" or ((program in INSTALLING_WITH_INSTALL or module in INSTALLING_WITH_INSTALL)
                                     and "install" in words)


def _shell_words(node: ast.Call) -> list[str | None]:
    """The words of a shell command line (os.system, os.popen, shell=True) when its start is a literal."""
    callee = ast.unparse(node.func)
    shell = callee in ("os.system", "os.popen") or any(
        k.arg == "shell" and isinstance(k.value, ast.Constant) and k.value.value is True for k in node.keywords)
    if not shell or not node.args:
        return []
    line = node.args[0]
    if isinstance(line, ast.JoinedStr) and line.values and isinstance(line.values[0], ast.Constant):
        line = line.values[0]
    return line.value.split() if isinstance(line, ast.Constant) and isinstance(line.value, str) else []


def installing_commands(source: str) -> list[tuple[int, str]]:
    """(line, code) of each command in `source` that would install something: a list or tuple whose words start
    as an installer's argv, a call whose positional arguments do (`run("apt-get", ...)`), a shell line that does.
    A message that names an install command (a skip reason) is one string, never such a command."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)):
            words = _words(node)
        elif isinstance(node, ast.Call):
            if ast.unparse(node.func).split(".")[-1] == "which":  # shutil.which("apt-get") looks, installs nothing
                continue
            words = _shell_words(node) or _words(node)
        else:
            continue
        if _installs(words):
            found.append((node.lineno, ast.unparse(node)[:100]))
    return found


@pytest.mark.parametrize("code", [
    'subprocess.run(["apt-get", "install", "-y", "slurmd"])',
    'install = ("apt-get", "install", "-y", *PACKAGES)\n_run(*install)',
    '_run("apt-get", "update", "-qq", check=False)',
    'subprocess.run(["/usr/bin/dpkg", "-i", "x.deb"])',
    'subprocess.check_call([sys.executable, "-m", "pip", "install", "torchft"])',
    'subprocess.run([sys.executable, "-m", "ensurepip"])',
    'subprocess.run(["uv", "pip", "install", "--python", python, "x"])',
    'os.system("apt-get install -y munge")',
    'subprocess.run(f"pip install {name}", shell=True)',
])
def test_the_guard_finds_an_install(code):
    assert installing_commands(code), code


@pytest.mark.parametrize("code", [
    'pytest.skip("SLURM is not installed: `apt-get install slurmctld slurmd slurm-client munge`, as .ci/run does")',
    'pytest.skip(f"{module} is not installed: pip install -e \'.[trainers]\'")',
    'raise ClusterUnavailable(f"no apt-get: {reason}")',
    'shutil.which("apt-get")',
    'subprocess.run([sys.executable, "-m", "pip", "--version"])',
    'steps = [s for s in printed if "pip install" in s]',
])
def test_the_guard_leaves_messages_and_looks_alone(code):
    assert installing_commands(code) == [], code


def test_no_code_of_the_tests_or_benchmarks_installs_anything():
    """tests/ (helpers, conftest, jobs) and benchmarks/ (tests run some of its scripts, and it imports tests'
    helpers): a package a test needs is one .ci/run installs, and the test skips without it
    (tests/helpers/system_packages.py)."""
    found = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}: {code}"
                      for line, code in installing_commands(path.read_text())]
    assert found == [], "code that installs packages (the tests must skip instead; .ci/run installs):\n" + \
        "\n".join(found)
