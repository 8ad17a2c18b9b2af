"""The pure stripe math and layout records of volumes: no disk."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepnvme import Volume, VolumeLayoutError
from deepnvme.errors import ConfigError
from deepnvme.io.volume import VolumeRecord, check_records, part_size, split_ranges, stripe_spans

ENGINE_SPECIFIC = True  # pure: nothing here depends on the engine


def test_spans_round_robin_with_partial_units():
    spans = stripe_spans(4096 + 100, 3 * 4096, drives=2, stripe=4096)
    assert [(s.drive, s.part_offset, s.buf_offset, s.length) for s in spans] == [
        (1, 100, 0, 3996), (0, 4096, 3996, 4096), (1, 4096, 8092, 4096), (0, 8192, 12188, 100)]
    assert stripe_spans(10, 0, drives=3, stripe=4096) == []


@given(offset=st.integers(0, 1 << 20), length=st.integers(0, 1 << 18),
       drives=st.integers(1, 5), stripe=st.sampled_from([4096, 8192, 65536]))
def test_spans_cover_the_range_once_and_match_a_reference(offset, length, drives, stripe):
    spans = stripe_spans(offset, length, drives=drives, stripe=stripe)
    assert sum(s.length for s in spans) == length
    pos = 0
    for s in spans:
        assert s.buf_offset == pos and 0 < s.length <= stripe
        logical = offset + pos
        # every byte of the span maps back through the reference formula
        for b in (0, s.length - 1):
            unit = (logical + b) // stripe
            assert s.drive == unit % drives
            assert s.part_offset + b == (unit // drives) * stripe + (logical + b) % stripe
        pos += s.length


@given(ranges=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 17)), max_size=12),
       drives=st.integers(1, 5), stripe=st.sampled_from([4096, 8192, 65536]))
def test_split_ranges_is_stripe_spans_of_each_range_in_order(ranges, drives, stripe):
    addresses = [1_000_000 * (k + 1) for k in range(len(ranges))]
    got = split_ranges(addresses, [n for _, n in ranges], [o for o, _ in ranges], drives=drives, stripe=stripe)
    want: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in range(drives)]
    for address, (offset, length) in zip(addresses, ranges):
        for s in stripe_spans(offset, length, drives=drives, stripe=stripe):
            want[s.drive][0].append(address + s.buf_offset)
            want[s.drive][1].append(s.length)
            want[s.drive][2].append(s.part_offset)
    assert got == want


def test_split_ranges_refuses_a_negative_range():
    with pytest.raises(ValueError, match="offset -1"):
        split_ranges([0], [10], [-1], drives=2, stripe=4096)


@given(size=st.integers(0, 1 << 20), drives=st.integers(1, 5),
       stripe=st.sampled_from([4096, 12288]))
def test_part_sizes_add_up_and_match_the_spans(size, drives, stripe):
    sizes = [part_size(size, d, drives=drives, stripe=stripe) for d in range(drives)]
    assert sum(sizes) == size
    ends = [0] * drives
    for s in stripe_spans(0, size, drives=drives, stripe=stripe):
        ends[s.drive] = max(ends[s.drive], s.part_offset + s.length)
    assert ends == sizes


def test_volume_checks_its_arguments(tmp_path):
    vol = Volume([tmp_path / "a", str(tmp_path / "b")], stripe="64K")
    assert vol.stripe == 65536 and vol.paths == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert vol == Volume([tmp_path / "a", tmp_path / "b"], stripe=65536)
    assert (vol / "d" / "x.bin").name == "d/x.bin"
    assert (vol / "x.bin").part(1) == str(tmp_path / "b" / "x.bin.part1")
    with pytest.raises(ConfigError, match="multiple of 4096"):
        Volume([tmp_path / "a"], stripe=1000)
    with pytest.raises(ConfigError, match="twice"):
        Volume([tmp_path / "a", tmp_path / "a"])
    with pytest.raises(ConfigError, match="list of directories"):
        Volume(str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least one"):
        Volume([])
    for bad in ("../x", "/abs", "", "x.volume.json"):
        with pytest.raises(ConfigError, match="relative path"):
            vol / bad


def _records(vol, size=10_000, file_id="f"):
    vpath = vol / "x.bin"
    return vpath, [VolumeRecord.for_size(vpath, size, index=d, file_id=file_id)
                   for d in range(len(vol.paths))]


def test_records_round_trip_and_refuse_other_layouts():
    vol = Volume(["/d0", "/d1"], stripe=4096)
    vpath, recs = _records(vol)
    assert check_records(vpath, [VolumeRecord.from_json(r.to_json(), where="w") for r in recs]) \
        == recs[0]
    assert recs[0].parts == (5904, 4096)
    swapped = Volume(["/d1", "/d0"], stripe=4096)
    with pytest.raises(VolumeLayoutError, match="another order"):
        check_records(swapped / "x.bin", recs)
    with pytest.raises(VolumeLayoutError, match="written on drives"):
        check_records(Volume(["/d0", "/d2"], stripe=4096) / "x.bin", recs)
    with pytest.raises(VolumeLayoutError, match="stripe=4096.*stripe=8192"):
        check_records(Volume(["/d0", "/d1"], stripe=8192) / "x.bin", recs)
    _, other = _records(vol, file_id="g")
    with pytest.raises(VolumeLayoutError, match="another write") as info:
        check_records(vpath, [recs[0], other[1]])
    assert info.value.path == "/d1/x.bin.volume.json"
    with pytest.raises(VolumeLayoutError, match="record of drive 0"):
        check_records(vpath, [recs[0], recs[0]])


@pytest.mark.parametrize("data", [None, {"format": "x"}, {"format": "deepnvme-volume", "version": 9},
                                  {"format": "deepnvme-volume", "version": 1, "name": "x"}])
def test_bad_records_are_refused(data):
    with pytest.raises(VolumeLayoutError, match="not a deepnvme volume layout record"):
        VolumeRecord.from_json(data, where="/d0/x.volume.json")
