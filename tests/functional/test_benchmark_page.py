"""BENCHMARKS.md is what benchmarks/render_page.py prints from benchmarks/results/*.json and the
page template, so the page and the data cannot drift apart."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"
LOG = ROOT / "benchmarks" / "LOG.md"
TABLE_NAMES = ["engines_auto", "manager", "restore", "load", "load_into", "dcp", "offload", "vllm_load",
               "vllm_stream", "data", "manager_ranks_shared", "offload_ranks", "hf_load", "gpu_io", "gpu_load",
               "gpu_offload", "volume", "stream_quant"]


@pytest.fixture(scope="module")
def renderer():
    spec = importlib.util.spec_from_file_location("render_page", ROOT / "benchmarks" / "render_page.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_page"] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("render_page", None)


def test_page_is_up_to_date(renderer):
    assert PAGE.read_text() == renderer.render(), (
        "BENCHMARKS.md differs from what benchmarks/render_page.py prints: edit benchmarks/page_template.md "
        "or the TABLES of the script, never the page, then run python benchmarks/render_page.py --write")


def test_page_is_short_and_its_links_resolve():
    text = PAGE.read_text()
    # a results page, not a notebook: 350 lines held eleven sections; the GPU, multi-rank offload and
    # Hugging Face sections of 2026-11-27 brought it to 420 (one table and a few lines of why each); the
    # volume and quantised-streaming sections to 450, after the OpenMP table and two tables without JSON left
    assert len(text.splitlines()) <= 450
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert any(link.startswith("benchmarks/results/") for link in links)
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []


def _scaled(value: Any) -> Any:
    """Every float in a JSON document times 1.5 (counts, names and dates unchanged)."""
    if isinstance(value, float):
        return value * 1.5
    if isinstance(value, dict):
        return {k: _scaled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scaled(v) for v in value]
    return value


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_every_listed_file_feeds_its_table(renderer, tmp_path, name):
    # a table must change when the figures of any one of its files change: no figure is typed in by hand
    sources = renderer.TABLES[name].sources
    for src in sources:
        (tmp_path / src.file).write_text((renderer.RESULTS / src.file).read_text())
    before = renderer.table(name, tmp_path)
    assert before == renderer.table(name)
    for src in sources:
        original = (tmp_path / src.file).read_text()
        (tmp_path / src.file).write_text(json.dumps(_scaled(json.loads(original))))
        after = renderer.table(name, tmp_path)
        (tmp_path / src.file).write_text(original)
        rows = [line for line in after if line.startswith(f"| {src.device} |")]
        assert rows and rows != [line for line in before if line.startswith(f"| {src.device} |")], src.file


def test_every_table_is_on_the_page(renderer):
    template = (ROOT / "benchmarks" / "page_template.md").read_text()
    assert sorted(re.findall(r"^\{\{([a-z_]+)\}\}$", template, re.M)) == sorted(renderer.TABLES)
    assert sorted(TABLE_NAMES) == sorted(renderer.TABLES)  # every table is checked above


def test_figures_in_the_prose_come_from_the_log():
    # the hand-written text (and the tables of runs that kept no JSON) may only quote the lab log
    template = (ROOT / "benchmarks" / "page_template.md").read_text()
    log = LOG.read_text()
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", template))
    assert figures and sorted(f for f in figures if f not in log) == []


def test_errors_name_the_file_and_the_placeholder(renderer, tmp_path):
    bad = tmp_path / "template.md"
    bad.write_text("# page\n\n{{no_such_table}}\n")
    with pytest.raises(KeyError, match=r"template.md:3 names \{\{no_such_table\}\}"):
        renderer.render(bad)
    with pytest.raises(FileNotFoundError, match="2026-11-25-dcp3-disk.json"):
        renderer.table("dcp", tmp_path)
    disk, ram = renderer.TABLES["dcp"].sources
    (tmp_path / ram.file).write_text((renderer.RESULTS / ram.file).read_text())
    (tmp_path / disk.file).write_text(json.dumps({"results": {}}))
    with pytest.raises(KeyError, match="needs the key 'large' missing in one of 2026-11-25-dcp3-disk.json"):
        renderer.table("dcp", tmp_path)


def test_check_and_write(renderer, tmp_path, monkeypatch):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# stale\n")
    monkeypatch.setattr(renderer, "PAGE", page)
    assert renderer.main(["--check"]) == 1
    assert renderer.main(["--write"]) == 0
    assert page.read_text() == renderer.render()
    assert renderer.main(["--check"]) == 0
