"""The storage checks of ``deepnvme report --storage`` over hand-made facts (no disk)."""

from __future__ import annotations

import dataclasses

import pytest

from deepnvme.bench._storage_checks import (
    check_alignment,
    check_device,
    check_filesystem,
    check_free_space,
    check_journal,
    check_max_sectors,
    check_mount_options,
    check_o_direct,
    check_queue_depth,
    check_raid,
    check_scheduler,
    storage_checks,
)
from deepnvme.bench._storage_facts import QueueFacts, RaidFacts, StorageFacts, data_devices
from deepnvme.bench._system import Mount
from deepnvme.bench.storage_report import volume_check
from deepnvme.config import IOConfig

CFG = IOConfig()  # block_size 1 MiB, queue_depth 128, one worker, alignment 4096
NVME = QueueFacts(name="nvme0n1", rotational=False, scheduler="none", schedulers=("none", "mq-deadline"),
                  nr_requests=1023, max_sectors_kb=1280, max_hw_sectors_kb=2048, read_ahead_kb=128,
                  logical_block_size=512, physical_block_size=4096, minimum_io_size=4096,
                  optimal_io_size=0)
XFS = Mount("/mnt/nvme", "xfs", "/dev/nvme0n1", "259:0", ("rw", "noatime"),
            ("rw", "attr2", "inode64", "logbufs=8", "logbsize=256k", "noquota"))


def facts(**changes) -> StorageFacts:
    """A healthy single-NVMe xfs mount; ``changes`` replace fields."""
    base = StorageFacts(path="/mnt/nvme/run", exists=True, mount=XFS, device=NVME, leaves=(NVME,),
                        free_bytes=500 * 10**9, total_bytes=3840 * 10**9, o_direct=True,
                        o_direct_detail="accepted", dio_memory_align=512, dio_offset_align=512)
    return dataclasses.replace(base, **changes)


def mount(**changes) -> Mount:
    return dataclasses.replace(XFS, **changes)


def test_a_healthy_nvme_passes_every_check() -> None:
    checks = storage_checks(facts(), CFG, need=100 * 10**9)
    assert [c.name for c in checks] == ["filesystem", "O_DIRECT", "mount options", "journal", "device",
                                        "raid", "queue depth", "scheduler", "max_sectors_kb",
                                        "dio alignment", "free space"]
    assert {c.status for c in checks} == {"OK"}, [c for c in checks if c.status != "OK"]
    assert all(c.command == "" and c.hint == "" for c in checks)


def test_missing_path_is_one_fail_with_mkdir() -> None:
    (c,) = storage_checks(StorageFacts(path="/mnt/my dir", exists=False), CFG)
    assert c.status == "FAIL" and c.command == "mkdir -p '/mnt/my dir'"


@pytest.mark.parametrize("fstype, status, words", [
    ("ext4", "OK", ""), ("btrfs", "OK", ""), ("tmpfs", "WARN", "memory, not storage"),
    ("nfs4", "WARN", "network or FUSE"), ("fuse.sshfs", "WARN", "network or FUSE"),
    ("vfat", "WARN", "not xfs, ext4 or btrfs"), ("overlay", "WARN", "image layer")])
def test_filesystem_types(fstype, status, words) -> None:
    c = check_filesystem(facts(mount=mount(fstype=fstype)))
    assert c.status == status and words in c.value and c.data["fstype"] == fstype
    if status == "WARN":
        assert c.hint and ("mkfs.xfs" in c.command or "docker run -v" in c.command)
    assert check_filesystem(facts(mount=None)).status == "UNKNOWN"


def test_o_direct_refused_emulated_and_unprobed() -> None:
    refused = check_o_direct(facts(o_direct=False, o_direct_detail="open refused: Invalid argument"))
    assert refused.status == "WARN" and "buffered" in refused.hint and "mkfs.xfs" in refused.command
    journal = facts(o_direct=False, mount=mount(fstype="ext4", source="/dev/sda1",
                                                super_options=("rw", "data=journal")))
    assert check_o_direct(journal).command == "umount /mnt/nvme && mount -o data=ordered /dev/sda1 /mnt/nvme"
    tmpfs = check_o_direct(facts(mount=mount(fstype="tmpfs")))
    assert tmpfs.status == "WARN" and "from memory" in tmpfs.value
    assert check_o_direct(facts(o_direct=None, o_direct_detail="not probed")).status == "UNKNOWN"
    silent = check_o_direct(dataclasses.replace(journal, o_direct=True))  # what ext4 really does
    assert silent.status == "WARN" and "page cache" in silent.value and "data=ordered" in silent.command


def test_mount_options_atime_and_sync() -> None:
    assert check_mount_options(facts()).value == "noatime"
    assert check_mount_options(facts(mount=mount(options=("rw", "relatime")))).status == "OK"
    strict = check_mount_options(facts(mount=mount(options=("rw",))))
    assert strict.status == "WARN" and strict.data["atime"] == "strictatime"
    assert strict.command == "mount -o remount,noatime /mnt/nvme"
    both = check_mount_options(facts(mount=mount(options=("rw",), super_options=("rw", "sync"))))
    assert both.value == "strictatime, sync"
    assert both.command == "mount -o remount,noatime /mnt/nvme && mount -o remount,async /mnt/nvme"
    assert both.data == {"atime": "strictatime", "sync": True}


def test_journal_options_per_filesystem() -> None:
    ext4 = mount(fstype="ext4", source="/dev/nvme0n1p1")
    assert check_journal(facts(mount=dataclasses.replace(ext4, super_options=("rw",)))).value == "data=ordered"
    j = check_journal(facts(mount=dataclasses.replace(ext4, super_options=("rw", "data=journal"))))
    assert j.status == "WARN" and "twice" in j.hint and "data=ordered /dev/nvme0n1p1" in j.command
    c = check_journal(facts(mount=dataclasses.replace(ext4, super_options=("rw", "commit=1"))))
    assert c.status == "WARN" and c.command == "mount -o remount,commit=5 /mnt/nvme"
    assert check_journal(facts(mount=dataclasses.replace(ext4, super_options=("commit=30",)))).status == "OK"
    small = check_journal(facts(mount=mount(super_options=("rw", "logbsize=32k"))))
    assert small.status == "WARN" and small.command == (
        "umount /mnt/nvme && mount -o logbsize=256k /dev/nvme0n1 /mnt/nvme")
    assert check_journal(facts()).value == "logbsize=256k"
    assert check_journal(facts(mount=mount(super_options=("rw",)))).value == "logbsize default"
    comp = check_journal(facts(mount=mount(fstype="btrfs", super_options=("rw", "compress=zstd:3"))))
    assert comp.status == "WARN" and comp.command == "mount -o remount,compress=no /mnt/nvme"


def test_data_devices_per_level() -> None:
    assert [data_devices(level, 4) for level in ("raid0", "raid10", "raid5", "raid6", "raid1", None)] == [
        4, 2, 3, 2, 1, 1]


def on_md(raid: RaidFacts, sunit: int, swidth: int, **changes) -> StorageFacts:
    """xfs made on the array with sunit/swidth (512-byte units) in its mount options."""
    opts = ("rw", "logbsize=256k", f"sunit={sunit}", f"swidth={swidth}")
    return facts(raid=raid, mount=mount(source="/dev/md0", super_options=opts), **changes)


def test_raid0_stripe_against_block_size() -> None:
    md = RaidFacts("md", "md0", "raid0", 512 << 10, 4)  # stripe 2 MiB
    ok = check_raid(on_md(md, 1024, 4096), CFG)  # 1 MiB blocks: 2 chunks each, 128 in flight
    assert ok.status == "OK" and ok.data["raid_stripe_bytes"] == 2 << 20
    assert "chunk 512 KiB, stripe 2 MiB" in ok.value
    odd = check_raid(on_md(dataclasses.replace(md, chunk_bytes=768 << 10), 1536, 6144), CFG)
    assert odd.status == "WARN" and "straddle" in odd.hint
    assert odd.command == f"export DEEPNVME_BLOCK_SIZE={768 * 1024 * 4}"
    idle = check_raid(on_md(md, 1024, 4096), CFG.replace(block_size=512 << 10, queue_depth=2))
    assert idle.status == "WARN" and "idle" in idle.hint  # 1 MiB in flight < 2 MiB stripe


def test_xfs_made_without_the_arrays_stripe() -> None:
    md = RaidFacts("md", "md0", "raid0", 512 << 10, 4)
    bare = check_raid(facts(raid=md, mount=mount(source="/dev/md0")), CFG)
    assert bare.status == "WARN" and "xfs has no stripe" in bare.value
    assert bare.command == "mkfs.xfs -f -d su=512k,sw=4 /dev/md0"
    other = check_raid(on_md(md, 128, 512), CFG)  # made for a 64 KiB x 4 stripe
    assert other.status == "WARN" and "sunit=128, swidth=512" in other.value
    ext4 = check_raid(facts(raid=md, mount=mount(fstype="ext4", source="/dev/md0")), CFG)
    assert ext4.status == "OK"  # ext4's stripe= is in filesystem blocks: not checked


def test_parity_raid_needs_whole_stripes_and_linear_is_flagged() -> None:
    r5 = RaidFacts("md", "md1", "raid5", 256 << 10, 5)  # 4 data drives: stripe 1 MiB
    assert check_raid(on_md(r5, 512, 2048), CFG).status == "OK"
    r5_6 = dataclasses.replace(r5, devices=6)  # 5 data drives: 1.25 MiB stripe
    bad = check_raid(on_md(r5_6, 512, 2560), CFG)
    assert bad.status == "WARN" and "partial stripes" in bad.hint
    linear = check_raid(facts(raid=RaidFacts("dm", "vg-data", "linear", None, 2)), CFG)
    assert linear.status == "WARN" and linear.command.startswith("lvcreate --type striped -i 2")
    single = check_raid(facts(raid=RaidFacts("btrfs", "u", "single", None, 3)), CFG)
    assert single.command == "btrfs balance start -dconvert=raid0 /mnt/nvme"
    mirror = check_raid(facts(raid=RaidFacts("md", "md2", "raid1", None, 2)), CFG)
    assert mirror.status == "OK" and "not striped" in mirror.value
    assert check_raid(facts(), CFG).value == "none: one device (nvme0n1)"
    assert check_raid(facts(device=None, leaves=()), CFG).status == "UNKNOWN"


def test_queue_depth_per_drive() -> None:
    shallow = dataclasses.replace(NVME, nr_requests=64)
    one = check_queue_depth(facts(leaves=(shallow,)), CFG)
    assert one.status == "WARN" and one.command == "echo 128 > /sys/block/nvme0n1/queue/nr_requests"
    other = dataclasses.replace(shallow, name="nvme1n1")
    two = check_queue_depth(facts(leaves=(shallow, other)), CFG)  # 64 each for 2 drives
    assert two.status == "OK" and two.data == {"nr_requests": 64, "in_flight_per_drive": 64}
    four = check_queue_depth(facts(leaves=(shallow, other)), CFG.replace(intra_op_parallelism=4))
    assert four.command == ("echo 256 | tee /sys/block/nvme0n1/queue/nr_requests "
                            "/sys/block/nvme1n1/queue/nr_requests")
    assert check_queue_depth(facts(leaves=()), CFG).status == "UNKNOWN"


def test_scheduler_on_solid_state_and_spinning() -> None:
    bfq = dataclasses.replace(NVME, scheduler="bfq")
    c = check_scheduler(facts(leaves=(bfq,)))
    assert c.status == "WARN" and c.command == "echo none > /sys/block/nvme0n1/queue/scheduler"
    assert check_scheduler(facts(leaves=(dataclasses.replace(NVME, scheduler="mq-deadline"),))).status == "OK"
    hdd = dataclasses.replace(bfq, name="sda", rotational=True)
    assert check_scheduler(facts(leaves=(hdd,))).status == "OK"
    assert check_scheduler(facts(leaves=(dataclasses.replace(NVME, scheduler=None),))).status == "UNKNOWN"


def test_max_sectors_kb_against_the_request() -> None:
    low = dataclasses.replace(NVME, max_sectors_kb=512)
    c = check_max_sectors(facts(leaves=(low,)), CFG)
    assert c.status == "WARN" and c.command == "echo 1024 > /sys/block/nvme0n1/queue/max_sectors_kb"
    capped = dataclasses.replace(low, max_hw_sectors_kb=512)
    c = check_max_sectors(facts(leaves=(capped,)), CFG)
    assert c.command == f"export DEEPNVME_BLOCK_SIZE={512 * 1024}"
    striped = facts(leaves=(low,), raid=RaidFacts("md", "md0", "raid0", 256 << 10, 4))
    c = check_max_sectors(striped, CFG)  # each drive gets 256 KiB chunks
    assert c.status == "OK" and c.data["request_bytes"] == 256 << 10


def test_alignment_and_physical_sector() -> None:
    assert check_alignment(facts(), CFG).data == {"dio_offset_bytes": 512, "physical_sector_bytes": 4096}
    odd = check_alignment(facts(), CFG.replace(block_size=(1 << 20) + 512))
    assert odd.status == "WARN" and odd.command == f"export DEEPNVME_BLOCK_SIZE={(1 << 20) + 4096}"
    big = dataclasses.replace(NVME, logical_block_size=8192, physical_block_size=8192)
    c = check_alignment(facts(device=big, dio_offset_align=None), CFG)
    assert c.status == "WARN" and c.command == "export DEEPNVME_ALIGNMENT=8192"
    assert check_alignment(facts(device=None, dio_offset_align=None), CFG).status == "UNKNOWN"


def test_free_space_against_need() -> None:
    assert check_free_space(facts(), None).data == {"free_bytes": 500 * 10**9, "need_bytes": None}
    assert check_free_space(facts(), 400 * 10**9).status == "OK"
    close = check_free_space(facts(), 480 * 10**9)
    assert close.status == "WARN"
    short = check_free_space(facts(), 600 * 10**9)
    assert short.status == "FAIL" and "free 100.0 GB" in short.hint
    assert short.command.startswith("deepnvme clean /mnt/nvme/run")


def test_device_rotational() -> None:
    assert check_device(facts()).status == "OK"
    hdd = check_device(facts(leaves=(dataclasses.replace(NVME, name="sdb", rotational=True),)))
    assert hdd.status == "WARN" and "mkfs.xfs" in hdd.command
    vd = check_device(facts(leaves=(dataclasses.replace(NVME, name="vda", rotational=True),)))
    assert vd.status == "WARN" and vd.command == "" and "virtual" in vd.hint
    assert check_device(facts(leaves=())).status == "UNKNOWN"


def test_volume_directories_on_their_own_drives() -> None:
    one = facts(path="/mnt/a")
    two = facts(path="/mnt/b", leaves=(dataclasses.replace(NVME, name="nvme1n1"),))
    assert volume_check([one, two]).value == "2 directories on 2 drive(s)"
    same = volume_check([one, facts(path="/mnt/c"), two])
    assert same.status == "WARN" and "/mnt/a and /mnt/c share a drive" in same.value
    shm = facts(leaves=(), mount=mount(fstype="tmpfs", dev="0:27"))
    assert volume_check([shm, dataclasses.replace(shm, path="/dev/shm/b")]).status == "WARN"
    assert volume_check([one, facts(leaves=(), mount=None)]).status == "UNKNOWN"
