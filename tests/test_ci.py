"""CI runs exactly the README's Quick start test command (lint, types, tests)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, "README's Quick start lost its bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_ci_runs_the_readme_quick_start_test_command():
    test_command = _quick_start_commands()[-1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == test_command


def test_the_test_command_checks_lint_and_types_before_the_tests():
    test_command = _quick_start_commands()[-1]
    assert re.search(r"ruff check \. && mypy && python -m pytest -q$", test_command)
