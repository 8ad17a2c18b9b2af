"""README.md is a newcomer's path with no traps: every example in it runs.

Every fenced block has a language. ```python blocks run in order, each in a scratch directory.
Shell examples (```bash/```console blocks, and ```text transcripts whose lines start with
``$ ``) run each ``deepnvme ...``/``python -m deepnvme ...`` command with this checkout's
``src`` first on PYTHONPATH, in a scratch directory, and must exit 0. An HTML comment on the
line right before a fence changes that, visibly: ``<!-- not run: REASON -->`` skips the block
(the reason is required), ``<!-- exit status N: REASON -->`` (or ``N or M``) expects that status.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SRC = ROOT / "src"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SHELL_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "&"}
FENCE = re.compile(r"^```(.*)$")
MARKER = re.compile(r"^<!--\s*(not run|exit status)\b(.*?)-->$")
EXIT_SPEC = re.compile(r"^\s*(\d+(?:\s+or\s+\d+)*)\s*:\s*(\S.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its language, text, the line of its opening fence, the marker before it."""

    lang: str
    body: str
    line: int
    marker: str | None

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang} block)"

    def commands(self) -> list[str]:
        """The shell commands the block shows: ``$ `` lines of a transcript, or a script's lines."""
        lines = self.body.splitlines()
        if self.lang in ("console", "text"):
            return [line[2:].strip() for line in lines if line.startswith("$ ")]
        if self.lang in SHELL_LANGS:
            return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return []


def parse_blocks(text: str) -> list[Block]:
    """Split ``text`` into fenced blocks; a fence without a language or without an end is an error."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        lang = opening.group(1).strip()
        if not lang:
            raise ValueError(f"README.md:{i + 1}: a fence without a language opens a block "
                             "(a stray closing fence, or an example that lost its opening one?)")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"README.md:{i + 1}: the {lang} block is never closed")
        before = lines[i - 1].strip() if i else ""
        marker = before if before.startswith("<!--") and MARKER.match(before) else None
        blocks.append(Block(lang, "\n".join(lines[i + 1:end]) + "\n", i + 1, marker))
        i = end + 1
    return blocks


def expected_status(block: Block) -> set[int] | None:
    """Exit statuses the block's commands must end with; None for a block marked not run."""
    if block.marker is None:
        return {0}
    kind, rest = MARKER.match(block.marker).groups()  # type: ignore[union-attr]
    if kind == "not run":
        return None
    spec = EXIT_SPEC.match(rest)
    assert spec, f"{block.where}: write the marker as '<!-- exit status N: why -->', not {block.marker!r}"
    return {int(n) for n in spec.group(1).split("or")}


def deepnvme_argv(command: str) -> list[str] | None:
    """``command`` as an argv running this checkout's deepnvme, or None if it is something else."""
    argv = shlex.split(command)
    if any(word in SHELL_OPERATORS for word in argv):
        return None
    if argv[:1] == ["deepnvme"]:
        return [sys.executable, "-m", "deepnvme", *argv[1:]]
    if argv[:3] == ["python", "-m", "deepnvme"]:
        return [sys.executable, "-m", "deepnvme", *argv[3:]]
    return None


TEXT = README.read_text()
try:
    BLOCKS, PARSE_ERROR = parse_blocks(TEXT), ""
except ValueError as exc:
    BLOCKS, PARSE_ERROR = [], str(exc)
PYTHON = [b for b in BLOCKS if b.lang == "python" and expected_status(b) is not None]
SHELL = [b for b in BLOCKS if b.commands() and expected_status(b) is not None]


def test_readme_fences_are_well_formed():
    assert not PARSE_ERROR, PARSE_ERROR
    assert PYTHON and SHELL, "README.md lost its python or shell examples"


def test_every_marker_sits_on_a_fence_and_says_why():
    """A marker must be the line right before a fence (else it silently marks nothing) and give a reason."""
    marked = {b.line - 1 for b in BLOCKS if b.marker}
    for number, line in enumerate(TEXT.splitlines(), start=1):
        if MARKER.match(line.strip()):
            assert number in marked, f"README.md:{number}: {line.strip()!r} is not right before a fence"
    for block in BLOCKS:
        if block.marker and block.marker.startswith("<!-- not run"):
            reason = MARKER.match(block.marker).group(2).lstrip(":").strip()  # type: ignore[union-attr]
            assert block.marker.split("not run", 1)[1].lstrip().startswith(":") and reason, (
                f"{block.where}: a not-run block needs a reason: '<!-- not run: why -->'")
        elif block.marker:
            expected_status(block)


def test_every_shell_command_runs_or_is_marked():
    """A shell example either runs here (deepnvme commands only) or says why not."""
    for block in SHELL:
        for command in block.commands():
            assert deepnvme_argv(command) is not None, (
                f"{block.where}: {command!r} is not a plain deepnvme command, so the tests cannot run "
                "it: make it one, or put '<!-- not run: why -->' on the line before the fence")


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=lambda i: f"line{PYTHON[i].line}")
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = PYTHON[index]
    code = compile(block.body, f"README.md[python block at line {block.line}]", "exec")
    exec(code, {"__name__": f"readme_block_{block.line}"})


@pytest.mark.parametrize("index", range(len(SHELL)), ids=lambda i: f"line{SHELL[i].line}")
def test_readme_shell_block_runs(index, tmp_path):
    block = SHELL[index]
    statuses = expected_status(block)
    assert statuses is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    for command in block.commands():
        argv = deepnvme_argv(command)
        if argv is None:
            pytest.fail(f"{block.where}: {command!r} cannot run (see test_every_shell_command_runs_or_is_marked)")
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode in statuses, (
            f"{block.where}: {command!r} exited {done.returncode}, expected {sorted(statuses)}\n"
            f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}")


def test_parser_finds_broken_fences_and_markers():
    """The checks above can fail: a stray fence, an unclosed block, a marker without a reason."""
    with pytest.raises(ValueError, match="without a language"):
        parse_blocks("text\n```\ncode\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        parse_blocks("```python\nx = 1\n")
    marked = parse_blocks("<!-- exit status 2 or 130: usage -->\n```console\n$ deepnvme\n```\n")
    assert expected_status(marked[0]) == {2, 130}
    assert expected_status(parse_blocks("<!-- not run: slow -->\n```bash\npip install x\n```\n")[0]) is None
    bad = parse_blocks("<!-- exit status two -->\n```console\n$ deepnvme\n```\n")[0]
    with pytest.raises(AssertionError):
        expected_status(bad)
    assert deepnvme_argv("pip install -e .") is None
    assert deepnvme_argv("deepnvme bench && echo ok") is None
    assert deepnvme_argv("python -m deepnvme --version") == [sys.executable, "-m", "deepnvme", "--version"]
    assert parse_blocks("```text\n$ deepnvme report\nOK\n```\n")[0].commands() == ["deepnvme report"]


def test_ci_runs_the_quick_start_test_command():
    """.ci/run runs exactly the README's Quick start test command (its last line)."""
    quick_start = TEXT.split("## Quick start", 1)[1]
    command = next(b for b in parse_blocks(quick_start) if b.lang == "bash").commands()[-1]
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines[-1] == command
    assert command.endswith("ruff check . && mypy && python -m pytest -q"), "CI checks lint and types too"


def test_readme_settings_table_matches_the_code():
    from deepnvme.config import settings_markdown
    assert settings_markdown() in TEXT, (
        "README's settings table is stale: paste deepnvme.config.settings_markdown() into it")
