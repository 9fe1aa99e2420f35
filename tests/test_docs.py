"""The documentation runs.

* Every ```python block of README.md and docs/**/*.md is executed; the blocks of one file
  run in order in one shared namespace. Use ```text, ```bash (or any other language) for
  blocks that must not run.
* The docstring examples of every muonfx module pass under ``doctest``.
* docs/api.md has a section for every public name, and mkdocs.yml lists every page.
* The site builds with ``mkdocs build --strict`` (no broken links or anchors).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

import muonfx
from muonfx import seam

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "muonfx"

ALL_DOC_FILES = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md"))
# pages made only of tables and prose (no ```python block to run)
PROSE_ONLY = {"docs/performance.md", "docs/evidence.md", "docs/design-notes.md"}
DOC_FILES = [f for f in ALL_DOC_FILES if f not in PROSE_ONLY]

# An opening ```python fence (optionally indented, e.g. inside a list) up to the closing
# fence with the same indentation.
_OPEN = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")

DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


@pytest.fixture
def isolated_torch():
    """Run examples seeded, on one thread, and restore torch's global state afterwards.

    The examples use tiny tensors: one thread is fastest, and it keeps them fast on a
    loaded machine, where multi-threaded kernels on tiny tensors slow down many-fold.
    """
    threads = torch.get_num_threads()
    backends = list(seam._BACKENDS)
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            yield
    finally:
        torch.set_num_threads(threads)
        seam._BACKENDS[:] = backends  # a failing example must not leave a backend installed


def python_blocks(text: str, where: str) -> list[tuple[int, str]]:
    """``(first line number of the code, code)`` for every ```python block in ``text``."""
    lines = text.splitlines(keepends=True)
    blocks = []
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i].rstrip("\n"))
        if not m:
            i += 1
            continue
        close = re.compile(rf"^{re.escape(m.group('indent'))}```[ \t]*$")
        start = i + 1
        j = start
        while j < len(lines) and not close.match(lines[j].rstrip("\n")):
            j += 1
        if j == len(lines):
            raise ValueError(f"{where}:{i + 1}: ```python block is never closed")
        blocks.append((start + 1, textwrap.dedent("".join(lines[start:j]))))
        i = j + 1
    return blocks


def run_blocks(path: Path, rel: str) -> None:
    blocks = python_blocks(path.read_text(encoding="utf-8"), rel)
    assert blocks, f"{rel} has no ```python blocks: list it in PROSE_ONLY if that is intended"
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for index, (line, code) in enumerate(blocks):
        # Pad with newlines so tracebacks point at the real line of the markdown file
        # (and show its source, which linecache reads from that file).
        compiled = compile("\n" * (line - 1) + code, str(path), "exec")
        tb = None
        try:
            exec(compiled, namespace)
        except Exception:
            tb = traceback.format_exc()
        if tb is not None:  # fail outside the except block: no chained exception noise
            pytest.fail(
                f"{rel}: ```python block {index} (of {len(blocks)}, starting at line {line}) "
                f"failed:\n\n{textwrap.indent(code, '    ')}\n{tb}",
                pytrace=False,
            )


@pytest.mark.parametrize("rel", DOC_FILES)
def test_markdown_python_blocks_run(rel, isolated_torch):
    path = ROOT / rel
    if not path.exists():
        pytest.skip(f"{rel} does not exist")
    run_blocks(path, rel)


def test_fence_parser():
    text = "x\n```python\na = 1\n```\n```text\nnot run\n```\n- item\n\n    ```python\n    b = 2\n    ```\n"
    assert python_blocks(text, "t") == [(3, "a = 1\n"), (11, "b = 2\n")]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\nx = 1\n", "t")


# ---------------------------------------------------------------------------
# docstring examples
# ---------------------------------------------------------------------------


def _module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__main__":
            continue  # importing it would run the command line
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


MODULES = _module_names()


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("muonfx"):
            pytest.skip(f"{name} needs the optional dependency {e.name!r}")
        raise


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, capsys, isolated_torch):
    module = _import(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS, verbose=False)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    failed, attempted = runner.summarize(verbose=False)
    capsys.readouterr()  # drop summarize()'s own printout
    assert failed == 0, f"{failed} of {attempted} docstring examples failed in {name}:\n" + "".join(report)


def test_docstring_examples_exist():
    finder = doctest.DocTestFinder(exclude_empty=True)
    attempted = 0
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        attempted += sum(len(t.examples) for t in finder.find(module, name))
    assert attempted >= 20, f"only {attempted} docstring examples found in muonfx"


# ---------------------------------------------------------------------------
# the pages cover the API and the site lists the pages
# ---------------------------------------------------------------------------


def test_api_page_covers_every_public_name():
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^#{2,4} `(?:muonfx\.|mfx\.)?([A-Za-z_][A-Za-z0-9_]*)`", api, re.M))
    missing = [n for n in muonfx.__all__ if n not in headings]
    assert not missing, (
        f"docs/api.md has no section for {missing}: add a heading '### `name`' with the "
        "formula, the defaults' source and a runnable example"
    )


def test_mkdocs_nav_lists_every_page():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    in_nav = set(re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", config, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages <= in_nav, f"pages missing from mkdocs.yml nav: {sorted(pages - in_nav)}"
    assert in_nav <= pages, f"mkdocs.yml nav names missing pages: {sorted(in_nav - pages)}"


def test_mkdocs_build_strict(tmp_path):
    """The site builds with --strict: every page in the nav, no broken links or anchors."""
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed: pip install -e '.[dev]'")
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").exists()


def test_prose_only_pages_really_have_no_code_to_run():
    for rel in PROSE_ONLY:
        assert not python_blocks((ROOT / rel).read_text(encoding="utf-8"), rel), rel


# ---------------------------------------------------------------------------
# shell blocks: every `muonfx ...` command shown in the docs parses and validates
# (the commands themselves run in their short form in tests/test_cli.py)
# ---------------------------------------------------------------------------

_SHELL_OPEN = re.compile(r"^[ \t]*```(bash|sh|shell|console)[ \t]*$")


def _muonfx_commands():
    out = []
    for rel in ALL_DOC_FILES + ["examples/README.md"]:
        lines = (ROOT / rel).read_text(encoding="utf-8").splitlines()
        inside = False
        for n, line in enumerate(lines, 1):
            if _SHELL_OPEN.match(line):
                inside = True
                continue
            if inside and line.strip().startswith("```"):
                inside = False
                continue
            cmd = line.split("#", 1)[0].strip()
            if inside and (cmd.startswith("muonfx ") or cmd.startswith("python -m muonfx ")):
                out.append((f"{rel}:{n}", cmd))
    return out


def test_docs_show_muonfx_commands():
    assert len(_muonfx_commands()) >= 5


@pytest.mark.parametrize("where,cmd", _muonfx_commands())
def test_muonfx_commands_in_docs_parse(where, cmd):
    import shlex

    from muonfx.cli import build_parser
    from muonfx.cli.args import resolve, validate

    argv = shlex.split(cmd)
    argv = argv[3:] if argv[:3] == ["python", "-m", "muonfx"] else argv[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code == 0:  # --help
            return
        pytest.fail(f"{where}: `{cmd}` does not parse (exit {e.code})")
    if args.command == "train":
        # what depends on this machine rather than on the command: a GPU, a checkpoint file
        if args.device == "cuda" and not torch.cuda.is_available():
            args.device = "cpu"
        if args.resume is not None and not Path(args.resume).exists():
            args.resume = None
        err = validate(resolve(args))
        assert err is None, f"{where}: `{cmd}`: {err}"
