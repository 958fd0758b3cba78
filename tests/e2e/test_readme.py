"""README.md works as written: its commands run, its code runs, its links lead somewhere.

Every ```python block of the README is run by a test below that checks what the README says it does, in a
temporary folder, under `phalanx run --nproc-per-node 2` (world size 2, CPU only) or plain
`python` (a world of one). A block is named by its first line (`# train.py`); a block that cannot
run alone is marked `<!-- readme-test: skip (why) -->` on the line before it. A whole script that moved
from the README into a page of docs/ (`# torch_ddp_shm.py`, in docs/shm.md) is run here the same way.

The README is checked here as a whole: the tests that only read it (its opening, its blocks, its
commands' flags, its links) run in this process, next to those that run what it says.
"""

from __future__ import annotations

import inspect
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, checkout_on_pythonpath, run_command
from tests.helpers.forked_python import run_python
from tests.helpers.system_packages import MAKE

README = ROOT / "README.md"
CONSOLE_SCRIPT = Path(sys.executable).with_name("phalanx")
PHALANX = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "phalanx"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SKIP_MARK = re.compile(r"<!--\s*readme-test:\s*skip\s*\((.+)\)\s*-->")

# The python blocks run by the tests of this file, by name, and the page that shows each: a new block of the
# README needs a test (or a skip mark).
RUN_BY_TESTS = {"train.py": README, "torch_ddp_shm.py": ROOT / "docs/shm.md"}

# rank 1 raises right after its second checkpoint, on the first attempt only: a worker dying mid-run.
FAIL_ONCE_SITECUSTOMIZE = '''
import os

if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    import phalanx.checkpoint

    _save, _saved = phalanx.checkpoint.Checkpointer.save, []

    def _save_then_fail(self, state):
        _saved.append(_save(self, state))
        if len(_saved) == 2:
            raise RuntimeError("readme test: rank 1 dies after its second checkpoint")
        return _saved[-1]

    phalanx.checkpoint.Checkpointer.save = _save_then_fail
'''


# -- reading the README ------------------------------------------------------------------------------

def code_blocks(lang: str | None = None, page: Path = README) -> list[dict]:
    """Fenced blocks of README.md (or another page): {lang, code, skip (the reason or None), line}."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        skip = SKIP_MARK.search(before)
        blocks.append({"lang": fence.group(1), "code": "\n".join(body) + "\n", "line": start + 1,
                       "skip": skip.group(1) if skip else None})
        i += 1
    return [b for b in blocks if lang is None or b["lang"] == lang]


def python_block(name: str) -> str:
    page = RUN_BY_TESTS[name]
    found = [b["code"] for b in code_blocks("python", page) if b["code"].startswith(f"# {name}\n")]
    assert len(found) == 1, \
        f"{page.relative_to(ROOT)} should hold one python block starting with '# {name}', found {len(found)}"
    return found[0]


def shell_commands() -> list[list[str]]:
    """Each command line of the README's bash blocks, split as a shell would (comments dropped)."""
    commands = []
    for block in code_blocks("bash"):
        for line in block["code"].replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


# -- running commands --------------------------------------------------------------------------------

run = run_command  # the README tests read as the commands they run


def run_alone(script: str, cwd: Path) -> str:
    """`python script` in `cwd` (forked: tests/helpers/forked_python.py); its output, once it ended with 0."""
    done = run_python([script], cwd=cwd, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                                             "PYTHONPATH": checkout_on_pythonpath()}, timeout=120)
    assert done.returncode == 0, f"python {script} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def epoch_losses(output: str) -> dict[int, list[str]]:
    """{epoch: [loss printed, one entry per time it was printed]} from the training script's output."""
    losses: dict[int, list[str]] = {}
    for epoch, loss in re.findall(r"^(?:\[rank 0\] )?epoch (\d+): loss (\S+)$", output, flags=re.MULTILINE):
        losses.setdefault(int(epoch), []).append(loss)
    return losses


def shm_possible() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


# -- the opening: make demo, make test ---------------------------------------------------------------

class TestOpening:
    def test_readme_opens_with_make_demo_and_make_test(self):
        lines = [line for line in README.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# "), "README.md starts with its title"
        assert lines[1:5] == ["```bash", "make demo", "make test", "```"], (
            f"README.md must open with exactly `make demo` and `make test`; it opens with {lines[1:5]}")

    def test_make_installs_pinned_torch_first_then_runs_the_job_or_the_tests(self):
        """No world: `make -n` (a dry run) of make demo and make test."""
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(r"^TORCH_SPEC \?= torch==", makefile, flags=re.MULTILINE), "TORCH_SPEC must be overridable"
        MAKE.require()
        for target, last in (("demo", "phalanx demo"), ("test", "-m tests.suite")):
            # -n prints the commands without running them; -B as on a fresh clone, with nothing installed.
            # --no-print-directory: under `make test` this make is nested and would add Entering/Leaving lines.
            printed = subprocess.run(["make", "--no-print-directory", "-n", "-B", target, "TORCH_SPEC=torch==2.6.0"],
                                     cwd=ROOT, capture_output=True, text=True, check=True).stdout
            steps = printed.splitlines()
            venv = next(i for i, s in enumerate(steps) if "-m venv" in s)
            torch_first = next(i for i, s in enumerate(steps) if '"torch==2.6.0"' in s)  # fetched, then installed
            editable = next(i for i, s in enumerate(steps) if "pip install" in s and "-e " in s)
            assert venv < torch_first < editable, f"make {target}: venv, then torch, then phalanx:\n{printed}"
            assert last in steps[-1], f"make {target} ends by running `{last}`:\n{printed}"


# -- the python blocks ---------------------------------------------------------------------------------

class TestPythonBlocks:
    def test_every_python_block_is_run_or_skipped_for_a_reason(self):
        names = set()
        for block in code_blocks("python"):
            if block["skip"]:
                continue
            first = block["code"].splitlines()[0]
            name = first[2:] if first.startswith("# ") else None
            assert RUN_BY_TESTS.get(name) == README, (
                f"README.md line {block['line']}: a python block that no test runs (first line {first!r}); "
                f"name it '# file.py' and run it in tests/e2e/test_readme.py, or mark it "
                f"<!-- readme-test: skip (why) --> if it cannot run alone")
            names.add(name)
        in_readme = {name for name, page in RUN_BY_TESTS.items() if page == README}
        assert names == in_readme, \
            f"tests/e2e/test_readme.py runs blocks the README no longer has: {in_readme - names}"
        for name in RUN_BY_TESTS.keys() - in_readme:
            python_block(name)  # the page that shows it holds it once

    def test_the_one_import_switch(self):
        import torch

        import phalanx

        diffs = [b["code"] for b in code_blocks("diff")]
        assert diffs, "README.md shows the one-import switch as a diff block"
        removed = [line[1:] for line in diffs[0].splitlines() if line.startswith("-")]
        added = [line[1:] for line in diffs[0].splitlines() if line.startswith("+")]
        assert len(removed) == len(added) == 1, f"one import changes, nothing else:\n{diffs[0]}"
        before, after = {}, {}
        exec(removed[0], before)
        exec(added[0], after)
        assert before["DDP"] is torch.nn.parallel.DistributedDataParallel
        assert after["DDP"] is phalanx.DistributedDataParallel
        signature = inspect.signature(after["DDP"].__init__).parameters
        ours = [p for p, info in signature.items()
                if p not in ("self", "unsupported") and info.kind != info.KEYWORD_ONLY]
        torchs = list(inspect.signature(before["DDP"].__init__).parameters)[1:]
        assert ours == torchs[:len(ours)] and ours[-1] == "static_graph", (ours, torchs)
        # phalanx's own arguments (shard=, the audit's, across_hosts=) are keyword-only: torch's positional order stays
        # intact
        assert [p for p, info in signature.items() if info.kind == info.KEYWORD_ONLY] == [
            "shard", "audit_every", "audit", "on_nonfinite", "across_hosts"]
        for name in ("no_sync", "join", "register_comm_hook", "state_dict", "load_state_dict"):
            assert callable(getattr(after["DDP"], name)), name

    def test_training_script_resumes_after_a_worker_dies(self, tmp_path):
        """World size 2: train.py under `phalanx run --max-restarts 3`, rank 1 dying after epoch 2 on the first
        attempt, ends exactly as a run that was never interrupted."""
        script = python_block("train.py")
        clean, failing, inject = tmp_path / "clean", tmp_path / "failing", tmp_path / "inject"
        for folder in (clean, failing, inject):
            folder.mkdir()
        for folder in (clean, failing):
            (folder / "train.py").write_text(script)
        (inject / "sitecustomize.py").write_text(FAIL_ONCE_SITECUSTOMIZE)

        uninterrupted = run([*PHALANX, "run", "--nproc-per-node", "2", "train.py"], clean)
        losses = epoch_losses(uninterrupted)
        assert sorted(losses) == [1, 2, 3, 4, 5] and all(len(v) == 1 for v in losses.values()), uninterrupted
        assert "[rank 1] epoch" not in uninterrupted, "print0 prints on rank 0 only"

        restarted = run([*PHALANX, "run", "--nproc-per-node", "2", "--max-restarts", "3", "train.py"], failing,
                        env={"PYTHONPATH": os.pathsep.join([str(inject), str(ROOT)])})
        assert "restarting the worker group (attempt 2 of 4)" in restarted, restarted
        assert "resumed from" in restarted and "ckpt-00000002.pt" in restarted, restarted
        resumed = epoch_losses(restarted)
        assert all(len(resumed.get(epoch, [])) == 1 for epoch in range(1, 6)), (
            f"each epoch trained once: epochs 1-2, the failure, then 3-5 from the checkpoint\n{restarted}")
        assert resumed == losses, f"the resumed run must end as the uninterrupted one:\n{restarted}\n{uninterrupted}"
        kept = sorted(p.name for p in (failing / "runs/my-job/checkpoints").glob("ckpt-*.pt")
                      if ".part-" not in p.name)  # each rank's part of a checkpoint saved in the background
        # keep=2 keeps the last two, and the newest save a replica audit vouched for (docs/audit.md): here the one
        # restored, which the audit after the restore agreed on
        assert kept == ["ckpt-00000002.pt", "ckpt-00000004.pt", "ckpt-00000005.pt"], \
            f"keep=2 keeps the last two and the newest audited one: {kept}"

    def test_training_script_runs_alone_under_python(self, tmp_path):
        """World size 1: train.py under plain python, twice (the second run resumes at the end)."""
        (tmp_path / "train.py").write_text(python_block("train.py"))
        output = run_alone("train.py", tmp_path)
        assert sorted(epoch_losses(output)) == [1, 2, 3, 4, 5], output
        again = run_alone("train.py", tmp_path)  # everything done: resumes at the end
        assert "resumed from" in again and not epoch_losses(again), again

    def test_torch_ddp_with_the_shared_memory_hook(self, tmp_path):
        """World size 2, under `phalanx run`, then under torchrun with PHALANX_SHM=0. Under torchrun (only), rank 0
        says in one line which allocator the ranks have and the LD_PRELOAD that gives them phalanx's."""
        from phalanx import allocator

        (tmp_path / "torch_ddp_shm.py").write_text(python_block("torch_ddp_shm.py"))
        output = run([*PHALANX, "run", "--nproc-per-node", "2", "torch_ddp_shm.py"], tmp_path)
        assert f"[rank 0] shared memory: {shm_possible()}" in output, output
        assert "allocator:" not in output, f"phalanx run chose the allocator: nothing to advise\n{output}"
        # PHALANX_SHM=0 turns it off; and torchrun starts the same script.
        output = run([*TORCHRUN, "--nproc-per-node", "2", "torch_ddp_shm.py"], tmp_path, env={"PHALANX_SHM": "0"})
        assert "shared memory: False" in output, output
        advice = [line for line in output.splitlines() if "allocator:" in line]
        assert len(advice) == 1 and advice[0].startswith("[rank 0] INFO allocator: "), output
        chosen = allocator.choose()
        if allocator.current() == "glibc" and chosen is not None:  # torchrun's ranks inherit this process's malloc
            assert f"LD_PRELOAD={chosen.path} ({chosen.name}" in advice[0], advice


# -- the commands ------------------------------------------------------------------------------------

class TestCommands:
    def test_help(self, tmp_path):
        """No world: `phalanx --help` and `phalanx run --help`, run as commands."""
        overview = run([*PHALANX, "--help"], tmp_path)
        assert all(name in overview for name in ("run", "demo", "bench")), overview
        run_help = run([*PHALANX, "run", "--help"], tmp_path)
        flags = {word for words in shell_commands() if words[:2] == ["phalanx", "run"] for word in words
                 if word.startswith("--")}
        assert flags and all(flag in run_help for flag in flags), f"flags the README uses: {sorted(flags)}\n{run_help}"

    def test_every_phalanx_command_parses(self, tmp_path, monkeypatch):
        from phalanx.launch import run as launch
        from phalanx.tools import bench, demo

        monkeypatch.chdir(tmp_path)
        (tmp_path / "train.py").write_text(python_block("train.py"))
        (tmp_path / "examples").symlink_to(ROOT / "examples")
        seen = set()
        for words in shell_commands():
            if words[0] != "phalanx":
                continue
            seen.add(words[1])
            if words[1] == "run":
                args = launch.build_parser().parse_args(words[2:])
                launch.check_args(args)  # flags valid together, script present
            elif words[1] == "bench":
                bench.build_parser().parse_args(words[2:])
            elif words[1] == "demo":
                demo.parse_args(words[2:])
            else:
                pytest.fail(f"README.md uses an unknown command: {' '.join(words)}")
        assert {"run", "bench"} <= seen, seen
        assert (ROOT / "examples/slurm/train.sbatch").is_file()

    def test_bench_quick(self, tmp_path):
        """World size 2: the README's `phalanx bench --quick`."""
        command = next(w for w in shell_commands() if w[:3] == ["phalanx", "bench", "--quick"])
        output = run([*PHALANX, *command[1:]], tmp_path, timeout=120)
        assert "phalanx/torch" in output, output
        assert (tmp_path / "bench-results/bench.json").is_file(), output


# -- links, docs ---------------------------------------------------------------------------------------

class TestLinks:
    def test_links_lead_to_files_and_every_doc_is_linked(self):
        text = README.read_text()
        targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
        missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
        assert not missing, f"README.md links to missing files: {missing}"
        linked = {os.path.normpath(t.split("#")[0]) for t in targets}
        docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
        assert docs <= linked, f"docs not linked from README.md: {sorted(docs - linked)}"
        assert "examples" in linked, "README.md links to examples/"

    def test_architecture_names_every_module(self):
        architecture = (ROOT / "docs/architecture.md").read_text()
        package = ROOT / "phalanx"
        modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                         if p.name != "__init__.py" or p.parent == package)
        unnamed = [m for m in modules if f"`{m}`" not in architecture]
        assert not unnamed, f"docs/architecture.md does not describe {unnamed}"
        # The module table's rows: one per module, path relative to phalanx/.
        named = set(re.findall(r"^\| `([\w/]+\.py)` \|", architecture, flags=re.MULTILINE))
        assert named <= set(modules), \
            f"docs/architecture.md describes modules that do not exist: {named - set(modules)}"
