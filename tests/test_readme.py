"""Every ```python block in README.md runs, in order, in a scratch directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert BLOCKS, "README.md lost its python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(BLOCKS[index], f"README.md[python block {index}]", "exec")
    exec(code, {"__name__": f"readme_block_{index}"})


def test_readme_settings_table_matches_the_code():
    from deepnvme.config import settings_markdown
    assert settings_markdown() in README.read_text(), (
        "README's settings table is stale: paste deepnvme.config.settings_markdown() into it")
