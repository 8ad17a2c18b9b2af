"""README.md and docs/*.md are a newcomer's path with no traps: every example in them runs.

The same rules hold for README.md and every page of docs/. Every fenced block has a language.
```python blocks run in order, each in a scratch directory. Shell examples (```bash/```console
blocks, and ```text transcripts whose lines start with ``$ ``) run each ``deepnvme ...``/
``python -m deepnvme ...`` command with this checkout's ``src`` first on PYTHONPATH, in a
scratch directory, and must exit 0. An HTML comment on the line right before a fence changes
that, visibly: ``<!-- not run: REASON -->`` skips the block (the reason is required),
``<!-- exit status N: REASON -->`` (or ``N or M``) expects that status. Relative links between
the pages, and their ``#anchors``, must resolve; every docs/ page is linked from README.md, and
README.md stays a front page (at most 250 lines). Failures name the page and line.
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
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SRC = ROOT / "src"
README_MAX_LINES = 250
SHELL_LANGS = {"bash", "sh", "shell", "console"}
SHELL_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "&"}
FENCE = re.compile(r"^```(.*)$")
MARKER = re.compile(r"^<!--\s*(not run|exit status)\b(.*?)-->$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
EXIT_SPEC = re.compile(r"^\s*(\d+(?:\s+or\s+\d+)*)\s*:\s*(\S.*)$")


def relative(path: Path) -> str:
    """``path`` as the tests name it: relative to the repository root (as given when outside it)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its page, language, text, the line of its opening fence, the marker before it."""

    page: str
    lang: str
    body: str
    line: int
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.lang} block)"

    def commands(self) -> list[str]:
        """The shell commands the block shows: ``$ `` lines of a transcript, or a script's lines."""
        lines = self.body.splitlines()
        if self.lang in ("console", "text"):
            return [line[2:].strip() for line in lines if line.startswith("$ ")]
        if self.lang in SHELL_LANGS:
            return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return []


def parse_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Split ``text`` (of ``page``) into fenced blocks; a fence without a language or without an end is an error."""
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
            raise ValueError(f"{page}:{i + 1}: a fence without a language opens a block "
                             "(a stray closing fence, or an example that lost its opening one?)")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: the {lang} block is never closed")
        before = lines[i - 1].strip() if i else ""
        marker = before if before.startswith("<!--") and MARKER.match(before) else None
        blocks.append(Block(page, lang, "\n".join(lines[i + 1:end]) + "\n", i + 1, marker))
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


def heading_anchors(text: str) -> set[str]:
    """The ``#anchors`` GitHub makes of a page's headings (outside fenced blocks)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def links(text: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every markdown link outside fenced blocks."""
    found: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            found.extend((number, target) for target in LINK.findall(line))
    return found


def broken_link(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, does not resolve; None when it does (or is a web address)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None
    path_part, _, anchor = target.partition("#")
    resolved = (page.parent / path_part).resolve() if path_part else page
    if not resolved.exists():
        return f"{path_part} does not exist"
    if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
        return f"{relative(resolved)} has no heading with the anchor #{anchor}"
    return None


def read_page(page: Path) -> tuple[str, list[Block], str]:
    """A page's text, its blocks, and the parse error ('' when none)."""
    text = page.read_text()
    try:
        return text, parse_blocks(text, relative(page)), ""
    except ValueError as exc:
        return text, [], str(exc)


PARSED = {relative(page): read_page(page) for page in PAGES}
TEXT = PARSED["README.md"][0]
BLOCKS = [block for _, blocks, _ in PARSED.values() for block in blocks]
PYTHON = [b for b in BLOCKS if b.lang == "python" and expected_status(b) is not None]
SHELL = [b for b in BLOCKS if b.commands() and expected_status(b) is not None]


def block_id(block: Block) -> str:
    return f"{block.page}:line{block.line}"


@pytest.mark.parametrize("page", list(PARSED))
def test_fences_are_well_formed(page):
    assert not PARSED[page][2], PARSED[page][2]


def test_readme_keeps_python_and_shell_examples():
    readme_blocks = PARSED["README.md"][1]
    assert any(b.lang == "python" for b in readme_blocks), "README.md lost its python examples"
    assert any(b.commands() for b in readme_blocks), "README.md lost its shell examples"


def test_docs_exist_and_readme_links_every_page():
    pages = [relative(page) for page in PAGES[1:]]
    assert pages, "docs/ has no pages"
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(TEXT)}
    orphans = [page for page in pages if (ROOT / page).resolve() not in linked]
    assert not orphans, f"README.md links no page of {orphans}: add one link per topic"


def test_readme_is_a_front_page():
    lines = len(TEXT.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to a page of docs/")


@pytest.mark.parametrize("page", list(PARSED))
def test_every_marker_sits_on_a_fence_and_says_why(page):
    """A marker must be the line right before a fence (else it silently marks nothing) and give a reason."""
    text, blocks, _ = PARSED[page]
    marked = {b.line - 1 for b in blocks if b.marker}
    for number, line in enumerate(text.splitlines(), start=1):
        if MARKER.match(line.strip()):
            assert number in marked, f"{page}:{number}: {line.strip()!r} is not right before a fence"
    for block in blocks:
        if block.marker and block.marker.startswith("<!-- not run"):
            reason = MARKER.match(block.marker).group(2).lstrip(":").strip()  # type: ignore[union-attr]
            assert block.marker.split("not run", 1)[1].lstrip().startswith(":") and reason, (
                f"{block.where}: a not-run block needs a reason: '<!-- not run: why -->'")
        elif block.marker:
            expected_status(block)


@pytest.mark.parametrize("page", list(PARSED))
def test_every_shell_command_runs_or_is_marked(page):
    """A shell example either runs here (deepnvme commands only) or says why not."""
    for block in SHELL:
        if block.page != page:
            continue
        for command in block.commands():
            assert deepnvme_argv(command) is not None, (
                f"{block.where}: {command!r} is not a plain deepnvme command, so the tests cannot run "
                "it: make it one, or put '<!-- not run: why -->' on the line before the fence")


@pytest.mark.parametrize("page", list(PARSED))
def test_links_resolve(page):
    """Relative links reach an existing file, and a heading of it where they name an #anchor."""
    broken = [f"{page}:{number}: ({target}) {why}" for number, target in links(PARSED[page][0])
              if (why := broken_link(ROOT / page, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("block", PYTHON, ids=block_id)
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(block.body, f"{block.page}[python block at line {block.line}]", "exec")
    exec(code, {"__name__": f"doc_block_{block.line}"})


@pytest.mark.parametrize("block", SHELL, ids=block_id)
def test_shell_block_runs(block, tmp_path):
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


def test_parser_finds_broken_fences_markers_and_links(tmp_path):
    """The checks above can fail: a stray fence, an unclosed block, a marker without a reason, a bad link."""
    with pytest.raises(ValueError, match=r"docs/x\.md:1: a fence without a language"):
        parse_blocks("```\ncode\n```\n", "docs/x.md")
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
    assert parse_blocks("x\n```python\npass\n```\n", "docs/a.md")[0].where == "docs/a.md:2 (python block)"

    assert heading_anchors("# A `b`: c?\n```bash\n# not a heading\n```\n## A b c\n## A b c\n") == {
        "a-b-c", "a-b-c-1", "a-b-c-2"}
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](#top) [bad](#nowhere) [gone](missing.md) [web](https://example.com)\n"
                    "```text\n[not a link](nothing.md)\n```\n")
    assert [target for _, target in links(page.read_text())] == ["#top", "#nowhere", "missing.md", "https://example.com"]
    assert broken_link(page, "#top") is None and broken_link(page, "https://example.com") is None
    assert "no heading" in (broken_link(page, "#nowhere") or "")
    assert "does not exist" in (broken_link(page, "missing.md") or "")


def test_ci_runs_the_quick_start_test_command():
    """.ci/run runs exactly the README's Quick start test command (its last line)."""
    quick_start = TEXT.split("## Quick start", 1)[1]
    command = next(b for b in parse_blocks(quick_start) if b.lang == "bash").commands()[-1]
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci_lines[-1] == command
    assert command.endswith("ruff check . && mypy && python -m pytest -q"), "CI checks lint and types too"


def test_settings_table_matches_the_code():
    from deepnvme.config import settings_markdown
    assert settings_markdown() in PARSED["docs/settings.md"][0], (
        "docs/settings.md's settings table is stale: paste deepnvme.config.settings_markdown() into it")
