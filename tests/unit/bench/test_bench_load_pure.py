"""Pure parts of ``deepnvme bench load`` (deepnvme.bench.load): format sniffing, cold/warm marking, ranking."""

from __future__ import annotations

import struct

import pytest

from deepnvme.bench._load_source import SAFETENSORS, TORCH, Checkpoint, sniff
from deepnvme.bench._reading import cache_state, pick_eviction
from deepnvme.bench.load import LoadBenchResult, LoadRun, ReaderRow


def test_sniff_by_content() -> None:
    header = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    st = struct.pack("<Q", len(header)) + header
    assert sniff(st[:9], len(st) + 4) == SAFETENSORS
    assert sniff(b"PK\x03\x04rest", 100) == TORCH
    assert sniff(b"hello world", 11) is None
    assert sniff(struct.pack("<Q", 1000) + b"{", 50) is None  # header longer than the file
    assert sniff(struct.pack("<Q", 10) + b"[", 50) is None
    assert sniff(b"", 0) is None


@pytest.mark.parametrize("resident, total, state", [
    (0, 1000, "cold"), (10, 1000, "cold"), (11, 1000, "warm"), (1000, 1000, "warm"),
    (None, 1000, "warm"), (0, 0, "cold"), (4096, 1 << 30, "cold"),
])
def test_cache_state(resident, total, state) -> None:
    assert cache_state(resident, total) == state


def test_pick_eviction_keeps_an_explicit_choice(monkeypatch) -> None:
    assert pick_eviction("fadvise") == "fadvise" and pick_eviction("none") == "none"
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert pick_eviction("auto") == "fadvise"


def test_auto_drops_the_page_cache_only_where_allowed(monkeypatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("os.access", lambda path, mode: path == "/proc/sys/vm/drop_caches")
    assert pick_eviction("auto") == "drop-caches"
    monkeypatch.setattr("os.access", lambda path, mode: False)   # root in a container: read-only /proc/sys
    assert pick_eviction("auto") == "fadvise"


def _row(name: str, *seconds: float, cache: str = "cold") -> ReaderRow:
    runs = tuple(LoadRun(seconds=s, cache=cache, resident_bytes=0) for s in seconds)
    return ReaderRow(reader=name, call=name, tensors=1, runs=runs)


def _result(*rows: ReaderRow) -> LoadBenchResult:
    ckpt = Checkpoint(path="m", format=SAFETENSORS, files=("/m",), nbytes=2_000_000_000)
    return LoadBenchResult(checkpoint=ckpt, device="cpu", reps=len(rows[0].runs), eviction="fadvise",
                           rows=rows, notes=())


def test_ranking_and_headline() -> None:
    result = _result(_row("deepnvme", 1.0, 1.2, 5.0), _row("safetensors", 2.5, 2.4, 2.6),
                     _row("torch.load", 3.0, 3.0, 3.0))
    assert [r.reader for r in result.ranked] == ["deepnvme", "safetensors", "torch.load"]
    assert result.rows[0].gbps(result.checkpoint.nbytes).median == pytest.approx(2 / 1.2)
    assert result.ratio(result.rows[2]) == pytest.approx(2.5)
    assert result.headline() == "fastest here: deepnvme (2.08x the next)"
    assert _result(_row("safe_open", 1.0)).headline() == "fastest here: safe_open (the only reader)"


def test_row_cache_mark() -> None:
    mixed = ReaderRow(reader="x", call="x", tensors=1, runs=(
        LoadRun(seconds=1.0, cache="cold", resident_bytes=0),
        LoadRun(seconds=1.0, cache="warm", resident_bytes=4096)))
    assert mixed.cache == "mixed" and _row("y", 1.0, cache="warm").cache == "warm"
    assert _result(mixed).to_dict()["readers"][0]["cache"] == "mixed"
