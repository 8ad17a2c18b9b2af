"""``deepnvme report --storage``'s fact gathering over fake procfs/sysfs trees built in tmp_path,
and the whole report on this machine's tmp dir (structure only: the machine decides the rest)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from deepnvme.bench.storage_report import gather_storage_facts, run_storage_report
from deepnvme.config import IOConfig

QUEUE = {"rotational": "0", "scheduler": "[none] mq-deadline kyber", "nr_requests": "1023",
         "max_sectors_kb": "1280", "max_hw_sectors_kb": "2048", "read_ahead_kb": "128",
         "logical_block_size": "512", "physical_block_size": "4096", "minimum_io_size": "4096",
         "optimal_io_size": "0"}


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def link(at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(os.path.relpath(target, at.parent))


def disk(sys: Path, name: str, *, partition: str | None = None, **queue: str) -> Path:
    """A whole disk under sys/devices with a queue/ (and one partition); returns the node to use."""
    node = sys / "devices" / "pci0000:00" / name
    for key, value in {**QUEUE, **queue}.items():
        write(node / "queue" / key, value)
    link(sys / "class" / "block" / name, node)
    if partition is None:
        return node
    part = node / partition
    write(part / "partition", "1")
    link(sys / "class" / "block" / partition, part)
    return part


def mountinfo(root: Path, line: str) -> None:
    write(root / "proc" / "self" / "mountinfo",
          "22 1 0:21 / /proc rw,relatime - proc proc rw\n" + line)


def test_md_raid0_over_partitions(tmp_path) -> None:
    root, data = tmp_path / "root", tmp_path / "data"
    data.mkdir()
    sys = root / "sys"
    md = sys / "devices" / "virtual" / "block" / "md0"
    for key, value in {"level": "raid0", "chunk_size": str(512 << 10), "raid_disks": "2"}.items():
        write(md / "md" / key, value)
    for key, value in {**QUEUE, "scheduler": "none"}.items():
        write(md / "queue" / key, value)
    link(sys / "dev" / "block" / "9:0", md)
    for i in range(2):
        part = disk(sys, f"nvme{i}n1", partition=f"nvme{i}n1p1", nr_requests=str(64 << i))
        link(md / "slaves" / f"nvme{i}n1p1", part)
    mountinfo(root, f"30 1 9:0 / {data} rw,noatime shared:1 - xfs /dev/md0 rw,logbsize=64k,sunit=1024,swidth=2048")
    f = gather_storage_facts(str(data), root=str(root), probe=False)
    assert f.mount is not None and f.mount.options == ("rw", "noatime")
    assert f.mount.super_options == ("rw", "logbsize=64k", "sunit=1024", "swidth=2048")
    assert f.device is not None and f.device.name == "md0" and f.device.scheduler == "none"
    assert [d.name for d in f.leaves] == ["nvme0n1", "nvme1n1"]  # whole disks, not partitions
    assert [d.nr_requests for d in f.leaves] == [64, 128]
    assert f.leaves[0].schedulers == ("none", "mq-deadline", "kyber")
    assert f.raid is not None and (f.raid.kind, f.raid.level, f.raid.chunk_bytes, f.raid.devices) == (
        "md", "raid0", 512 << 10, 2)
    assert f.o_direct is None and f.free_bytes and f.free_bytes > 0
    report = run_storage_report(str(data), root=str(root), probe=False, config=IOConfig())
    checks = {c.name: c for c in report.checks}
    assert checks["journal"].status == "WARN"  # logbsize=64k
    assert checks["raid"].status == "OK" and checks["raid"].data["raid_stripe_bytes"] == 1 << 20
    assert checks["O_DIRECT"].status == "UNKNOWN"


def test_lvm_stripe_read_from_io_min_and_io_opt(tmp_path) -> None:
    root, data = tmp_path / "root", tmp_path / "data"
    data.mkdir()
    sys = root / "sys"
    dm = sys / "devices" / "virtual" / "block" / "dm-0"
    write(dm / "dm" / "name", "vg-data")
    for key, value in {**QUEUE, "minimum_io_size": str(256 << 10),
                       "optimal_io_size": str(1 << 20)}.items():
        write(dm / "queue" / key, value)
    link(sys / "dev" / "block" / "253:0", dm)
    for i in range(4):
        link(dm / "slaves" / f"nvme{i}n1", disk(sys, f"nvme{i}n1"))
    mountinfo(root, f"30 1 253:0 / {data} rw,relatime - ext4 /dev/mapper/vg-data rw")
    f = gather_storage_facts(str(data), root=str(root), probe=False)
    assert f.raid is not None and (f.raid.kind, f.raid.name, f.raid.level, f.raid.chunk_bytes,
                                   f.raid.devices) == ("dm", "vg-data", "striped", 256 << 10, 4)
    assert len(f.leaves) == 4


def test_btrfs_raid0_found_by_its_source_device(tmp_path) -> None:
    root, data = tmp_path / "root", tmp_path / "data"
    data.mkdir()
    sys = root / "sys"
    nodes = [disk(sys, f"nvme{i}n1") for i in range(2)]
    fs = sys / "fs" / "btrfs" / "1234-abcd"
    for i, node in enumerate(nodes):
        link(fs / "devices" / f"nvme{i}n1", node)
    write(fs / "allocation" / "data" / "raid0" / "total_bytes", "1073741824")
    write(fs / "allocation" / "data" / "total_bytes", "1073741824")
    mountinfo(root, f"30 1 0:45 / {data} rw,noatime - btrfs /dev/nvme0n1 rw,ssd,space_cache=v2")
    f = gather_storage_facts(str(data), root=str(root), probe=False)
    assert f.raid is not None and (f.raid.kind, f.raid.level, f.raid.chunk_bytes, f.raid.devices) == (
        "btrfs", "raid0", 64 << 10, 2)
    assert [d.name for d in f.leaves] == ["nvme0n1", "nvme1n1"]


def test_no_block_device_and_missing_path(tmp_path) -> None:
    root, data = tmp_path / "root", tmp_path / "data"
    data.mkdir()
    mountinfo(root, f"30 1 0:50 / {data} rw - tmpfs tmpfs rw,size=1024k")
    f = gather_storage_facts(str(data), root=str(root), probe=False)
    assert f.mount is not None and f.mount.fstype == "tmpfs"
    assert f.device is None and f.leaves == () and f.raid is None
    missing = gather_storage_facts(str(tmp_path / "nope"), root=str(root))
    assert missing.exists is False and missing.mount is None


def test_report_on_this_machine_has_every_check(tmp_path) -> None:
    report = run_storage_report(str(tmp_path), need=1 << 20)
    names = [c.name for c in report.checks]
    assert names == ["filesystem", "O_DIRECT", "mount options", "journal", "device", "raid",
                     "queue depth", "scheduler", "max_sectors_kb", "dio alignment", "free space"]
    assert all(c.status in ("OK", "WARN", "FAIL", "UNKNOWN") for c in report.checks)
    assert all(c.hint for c in report.checks if c.status != "OK")
    assert report.facts.o_direct is not None and report.facts.mount is not None
    data = json.loads(json.dumps(report.to_dict()))
    assert data["need_bytes"] == 1 << 20 and data["settings"]["block_size"] > 0
    assert [c["name"] for c in data["checks"]] == names
    assert set(data["checks"][0]) == {"name", "status", "value", "hint", "data", "command"}
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
