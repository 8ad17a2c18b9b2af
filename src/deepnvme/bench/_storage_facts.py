"""What ``deepnvme report --storage`` looks at: facts about the storage under a path, gathered
read-only from procfs and sysfs below a root directory (``/`` normally; a fake tree in tests),
statvfs, and one O_DIRECT probe in the directory itself.

The chain followed: the mount holding the path (``proc/self/mountinfo``), its block device
(``sys/dev/block/MAJ:MIN``, or the mount source under ``sys/class/block`` where the device
number is anonymous, as with btrfs), down through ``slaves/`` to the physical devices. A RAID
is read from ``md/level`` and ``md/chunk_size`` (md), the queue's ``minimum_io_size`` and
``optimal_io_size`` (dm striping, LVM), or ``sys/fs/btrfs/UUID/allocation/data/PROFILE``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

from ..io.durable import create_temp
from ..io.posix import O_DIRECT, POSIX
from ._system import Mount, mount_of
from ._system import read_text as _read

__all__ = ["QueueFacts", "RaidFacts", "StorageFacts", "gather_storage_facts", "data_devices",
           "probe_o_direct"]

# btrfs allocation profiles, and the bytes one device holds of a stripe (BTRFS_STRIPE_LEN)
_BTRFS_PROFILES = ("raid0", "raid10", "raid5", "raid6", "raid1", "raid1c3", "raid1c4", "dup", "single")
_BTRFS_STRIPE = 64 << 10


@dataclasses.dataclass(frozen=True)
class QueueFacts:
    """One block device's ``queue/`` attributes (None where the file is missing)."""

    name: str
    rotational: bool | None = None
    scheduler: str | None = None  # the one in brackets
    schedulers: tuple[str, ...] = ()  # every choice offered
    nr_requests: int | None = None
    max_sectors_kb: int | None = None
    max_hw_sectors_kb: int | None = None
    read_ahead_kb: int | None = None
    logical_block_size: int | None = None
    physical_block_size: int | None = None
    minimum_io_size: int | None = None
    optimal_io_size: int | None = None


@dataclasses.dataclass(frozen=True)
class RaidFacts:
    """A striped or mirrored layout under the path: ``kind`` md, dm or btrfs; ``chunk_bytes``
    is what one device holds of a stripe; ``devices`` the members."""

    kind: str
    name: str
    level: str | None
    chunk_bytes: int | None
    devices: int


@dataclasses.dataclass(frozen=True)
class StorageFacts:
    """Everything the storage checks read; a missing fact is None (the check says UNKNOWN)."""

    path: str
    exists: bool
    mount: Mount | None = None
    device: QueueFacts | None = None  # the device the filesystem sits on (md0, dm-1, nvme0n1)
    leaves: tuple[QueueFacts, ...] = ()  # the physical devices below it (itself if none)
    raid: RaidFacts | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    o_direct: bool | None = None  # None: not probed
    o_direct_detail: str = ""
    dio_memory_align: int | None = None
    dio_offset_align: int | None = None


def data_devices(level: str | None, devices: int) -> int:
    """Devices a full stripe spreads data over: all for raid0, half for raid10, one less for
    raid5, two less for raid6, one for mirrors and single."""
    if level in ("raid0", "0"):
        return devices
    if level in ("raid10", "10"):
        return max(1, devices // 2)
    if level in ("raid5", "5", "raid4", "4"):
        return max(1, devices - 1)
    if level in ("raid6", "6"):
        return max(1, devices - 2)
    return 1


def _int(path: str) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _queue(node: str) -> QueueFacts:
    q = os.path.join(node, "queue")
    line = _read(os.path.join(q, "scheduler")) or ""
    words = line.split()
    chosen = [w[1:-1] for w in words if w.startswith("[")]
    rot = _read(os.path.join(q, "rotational"))
    return QueueFacts(
        name=os.path.basename(node), rotational=None if rot is None else rot == "1",
        scheduler=chosen[0] if chosen else (words[0] if len(words) == 1 else None),
        schedulers=tuple(w.strip("[]") for w in words),
        **{k: _int(os.path.join(q, k)) for k in (
            "nr_requests", "max_sectors_kb", "max_hw_sectors_kb", "read_ahead_kb",
            "logical_block_size", "physical_block_size", "minimum_io_size", "optimal_io_size")})


def _whole_disk(node: str) -> str:
    """A partition's parent disk (whose ``queue/`` holds the settings), else ``node``."""
    return os.path.dirname(node) if os.path.exists(os.path.join(node, "partition")) else node


def _node_of(root: str, mount: Mount) -> str | None:
    """The sysfs directory of the mount's block device: by device number, or by the source's
    name where the number is anonymous (major 0: btrfs, overlay, tmpfs)."""
    sys_root = os.path.join(root, "sys")
    link = os.path.join(sys_root, "dev", "block", mount.dev)
    if not mount.dev.startswith("0:") and os.path.exists(link):
        return os.path.realpath(link)
    if mount.source.startswith("/dev/"):
        named = os.path.join(sys_root, "class", "block", os.path.basename(mount.source))
        if os.path.exists(named):
            return os.path.realpath(named)
    return None


def _leaves(node: str, depth: int = 0) -> list[str]:
    """The physical devices under ``node`` through ``slaves/`` (md, dm), whole disks."""
    slaves = os.path.join(node, "slaves")
    names = sorted(os.listdir(slaves)) if os.path.isdir(slaves) and depth < 8 else []
    if not names:
        return [_whole_disk(node)]
    found: list[str] = []
    for name in names:
        for leaf in _leaves(os.path.realpath(os.path.join(slaves, name)), depth + 1):
            if leaf not in found:
                found.append(leaf)
    return found


def _block_raid(node: str, depth: int = 0) -> RaidFacts | None:
    """The first md array, or striped dm device, from ``node`` down."""
    name = os.path.basename(node)
    slaves = os.path.join(node, "slaves")
    members = sorted(os.listdir(slaves)) if os.path.isdir(slaves) else []
    if os.path.isdir(os.path.join(node, "md")):
        level = _read(os.path.join(node, "md", "level"))
        count = _int(os.path.join(node, "md", "raid_disks")) or len(members)
        return RaidFacts("md", name, level, _int(os.path.join(node, "md", "chunk_size")), count)
    if os.path.isdir(os.path.join(node, "dm")):
        dm_name = _read(os.path.join(node, "dm", "name")) or name
        io_min = _int(os.path.join(node, "queue", "minimum_io_size")) or 0
        io_opt = _int(os.path.join(node, "queue", "optimal_io_size")) or 0
        lbs = _int(os.path.join(node, "queue", "logical_block_size")) or 512
        for member in members if depth < 8 else []:
            below = _block_raid(os.path.realpath(os.path.join(slaves, member)), depth + 1)
            if below is not None:
                return below
        if io_opt > io_min > lbs and io_opt % io_min == 0:
            return RaidFacts("dm", dm_name, "striped", io_min, io_opt // io_min)
        if len(members) > 1:
            return RaidFacts("dm", dm_name, "linear", None, len(members))
    return None


def _btrfs_raid(root: str, mount: Mount) -> tuple[RaidFacts, list[str]] | None:
    """The data profile of the btrfs filesystem whose member is the mount's source, and the
    sysfs directories of its member devices."""
    base = os.path.join(root, "sys", "fs", "btrfs")
    dev = os.path.basename(mount.source)
    for uuid in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        devices = os.path.join(base, uuid, "devices")
        if not os.path.isdir(devices) or dev not in os.listdir(devices):
            continue
        alloc = os.path.join(base, uuid, "allocation", "data")
        present = set(os.listdir(alloc)) if os.path.isdir(alloc) else set()
        level = next((p for p in _BTRFS_PROFILES if p in present), None)
        striped = level in ("raid0", "raid10", "raid5", "raid6")
        members = [_whole_disk(os.path.realpath(os.path.join(devices, d)))
                   for d in sorted(os.listdir(devices))]
        return RaidFacts("btrfs", uuid, level, _BTRFS_STRIPE if striped else None,
                         len(members)), members
    return None


def probe_o_direct(directory: str) -> tuple[bool, str, int | None, int | None]:
    """(accepted, detail, memory alignment, offset alignment) of one aligned O_DIRECT write and
    read of a temporary file in ``directory`` (removed after). Raises OSError when no file can
    be created there."""
    path = create_temp(directory, "deepnvme-report")
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        try:
            fd = os.open(path, os.O_RDWR | O_DIRECT)
        except OSError as exc:
            return False, f"refused ({exc.strerror})", None, None
        try:
            os.pwritev(fd, [buf], 0)
            os.preadv(fd, [buf], 0)
            try:
                align = POSIX.dio_alignment(fd)
            except OSError:
                align = None
        except OSError as exc:
            return False, f"open works but I/O fails ({exc.strerror})", None, None
        finally:
            os.close(fd)
    finally:
        buf.close()
        os.unlink(path)
    if align is None:
        return True, "accepted (alignment not reported)", None, None
    return True, "accepted", align.memory, align.offset


def gather_storage_facts(path: str, *, root: str = "/", probe: bool = True) -> StorageFacts:
    """The facts about the storage under ``path``; blocking, milliseconds. ``root`` is where
    ``proc/`` and ``sys/`` are read; ``probe`` writes, reads and deletes one page in ``path``."""
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return StorageFacts(path=real, exists=False)
    mount = mount_of(real, mountinfo=os.path.join(root, "proc", "self", "mountinfo"))
    node = _node_of(root, mount) if mount is not None else None
    device = _queue(_whole_disk(node)) if node is not None else None
    leaves = tuple(_queue(leaf) for leaf in _leaves(node)) if node is not None else ()
    raid = _block_raid(node) if node is not None else None
    btrfs = _btrfs_raid(root, mount) if mount is not None and mount.fstype == "btrfs" else None
    if btrfs is not None:
        raid, leaves = btrfs[0], tuple(_queue(m) for m in btrfs[1])
    st = os.statvfs(real)
    probed: tuple[bool | None, str, int | None, int | None] = (None, "not probed", None, None)
    if probe:
        try:
            probed = probe_o_direct(real)
        except OSError as exc:  # no file can be created here
            probed = (None, f"not probed: cannot create a file ({exc.strerror})", None, None)
    return StorageFacts(path=real, exists=True, mount=mount, device=device, leaves=leaves,
                        raid=raid, free_bytes=st.f_bavail * st.f_frsize,
                        total_bytes=st.f_blocks * st.f_frsize, o_direct=probed[0],
                        o_direct_detail=probed[1], dio_memory_align=probed[2],
                        dio_offset_align=probed[3])
