"""The storage checks of ``deepnvme report --storage``: pure functions from
:class:`StorageFacts` and deepnvme's settings to a :class:`Check` (OK, WARN, FAIL or UNKNOWN),
each non-OK one with what to change (``hint``) and a shell command that changes it.

Commands that write ``/sys`` need root and last until reboot (a udev rule keeps them);
remounts need root; commands with ``<device>`` erase that device and need it filled in.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from typing import Any

from ..config import IOConfig
from ._storage_facts import QueueFacts, StorageFacts, data_devices
from ._units import fmt_size
from .report import FAIL, OK, UNKNOWN, WARN, Check

__all__ = ["storage_checks", "GOOD_FILESYSTEMS"]

GOOD_FILESYSTEMS = ("xfs", "ext4", "btrfs")
_MEMORY_FS = ("tmpfs", "ramfs")
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre", "virtiofs")
_CACHED_FS = _MEMORY_FS + ("zfs",)  # accept O_DIRECT but serve it from memory (zfs before 2.3)
_FAST_SCHEDULERS = ("none", "mq-deadline")
_DEFAULT_COMMIT = 5  # ext4's journal commit interval, seconds
_GOOD_LOGBSIZE = 256 << 10  # xfs's largest log buffer


def _q(path: str) -> str:
    return shlex.quote(path)


def _mkfs(path: str) -> str:
    return f"mkfs.xfs /dev/<device> && mount -o noatime /dev/<device> {_q(path)}"


def _sysfs_write(leaves: Sequence[QueueFacts], attr: str, value: object) -> str:
    """``echo VALUE > /sys/block/DEV/queue/ATTR`` for one device, ``| tee`` for several."""
    paths = [f"/sys/block/{d.name}/queue/{attr}" for d in leaves]
    if len(paths) == 1:
        return f"echo {value} > {paths[0]}"
    return f"echo {value} | tee {' '.join(paths)}"


def check_filesystem(f: StorageFacts) -> Check:
    """xfs, ext4 and btrfs are OK; memory, overlay, network and FUSE filesystems are not storage
    deepnvme can drive directly."""
    if not f.exists:
        return Check("filesystem", FAIL, f"{f.path} does not exist",
                     "create the directory or pass an existing one", command=f"mkdir -p {_q(f.path)}")
    if f.mount is None:
        return Check("filesystem", UNKNOWN, "no mount found in /proc/self/mountinfo",
                     "run on Linux with /proc mounted")
    m = f.mount
    value = f"{m.fstype} on {m.mountpoint} from {m.source}"
    data = {"fstype": m.fstype, "mountpoint": m.mountpoint}
    if m.fstype in GOOD_FILESYSTEMS:
        return Check("filesystem", OK, value, data=data)
    if m.fstype in _MEMORY_FS:
        why = "memory, not storage"
    elif m.fstype == "overlay":
        return Check("filesystem", WARN, value + " (a container's image layer)",
                     "mount a host directory on local NVMe into the container", data,
                     command=f"docker run -v /mnt/nvme:{_q(f.path)} ...  # or a hostPath/local volume")
    elif m.fstype in _NETWORK_FS or m.fstype.startswith("fuse"):
        why = "a network or FUSE filesystem"
    else:
        why = "not xfs, ext4 or btrfs"
    return Check("filesystem", WARN, f"{value} ({why})",
                 "put the files on a local xfs or ext4 filesystem on NVMe (the command erases "
                 "<device>)", data, command=_mkfs(f.path))


def check_o_direct(f: StorageFacts) -> Check:
    """Whether an aligned O_DIRECT write and read went through, and whether they bypass memory."""
    if f.o_direct is None:
        return Check("O_DIRECT", UNKNOWN, f.o_direct_detail or "not probed",
                     "make the directory writable so a probe file can be made",
                     data={"o_direct": None})
    fs = f.mount.fstype if f.mount else ""
    if not f.o_direct:
        journal = "data=journal" in (f.mount.super_options if f.mount else ())
        return Check("O_DIRECT", WARN, f.o_direct_detail,
                     "deepnvme falls back to buffered I/O: use xfs, or ext4 without data=journal",
                     {"o_direct": False},
                     command=_remount_data(f) if journal else _mkfs(f.path))
    if fs in _CACHED_FS:
        return Check("O_DIRECT", WARN, f"accepted, but {fs} serves it from memory",
                     "O_DIRECT here measures memory, not a drive: use xfs or ext4 on NVMe",
                     {"o_direct": True}, command=_mkfs(f.path))
    if fs == "ext4" and f.mount is not None and "data=journal" in f.mount.super_options:
        return Check("O_DIRECT", WARN, "accepted, but ext4 data=journal does it through the "
                     "page cache", "mount with data=ordered (not possible by remount)",
                     {"o_direct": True}, command=_remount_data(f))
    return Check("O_DIRECT", OK, f.o_direct_detail, data={"o_direct": True})


def check_mount_options(f: StorageFacts) -> Check:
    """``noatime`` (or ``relatime``) and no ``sync``: a read should not write, a write should
    not wait for the device unless asked (deepnvme fsyncs where it must)."""
    if f.mount is None:
        return Check("mount options", UNKNOWN, "no mount found", "run on Linux with /proc mounted")
    opts = set(f.mount.options) | set(f.mount.super_options)
    mp = _q(f.mount.mountpoint)
    atime = "noatime" if "noatime" in opts else "relatime" if "relatime" in opts else "strictatime"
    data = {"atime": atime, "sync": "sync" in opts}
    changes, commands = [], []
    if atime == "strictatime":
        changes.append("strictatime: every read writes the file's access time; mount with noatime")
        commands.append(f"mount -o remount,noatime {mp}")
    if "sync" in opts:
        changes.append("sync: every write waits for the device; mount async")
        commands.append(f"mount -o remount,async {mp}")
    value = atime + (", sync" if "sync" in opts else "")
    if not changes:
        return Check("mount options", OK, value, data=data)
    return Check("mount options", WARN, value, "; ".join(changes), data, command=" && ".join(commands))


def _remount_data(f: StorageFacts) -> str:
    m = f.mount
    return "" if m is None else (f"umount {_q(m.mountpoint)} && mount -o data=ordered "
                                 f"{_q(m.source)} {_q(m.mountpoint)}")


def _option(opts: Sequence[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in opts if o.startswith(key + "=")), None)


def _kib(text: str) -> int | None:
    """``256k`` / ``262144`` / ``1m`` as bytes (xfs's logbsize syntax)."""
    unit = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:].lower(), 1)
    try:
        return int(text.rstrip("kKmM")) * unit
    except ValueError:
        return None


def check_journal(f: StorageFacts) -> Check:
    """Journal and log options of the filesystem: ext4 ``data=journal`` (writes every block twice,
    and O_DIRECT falls back to buffered) and a ``commit=`` below 5 s, xfs ``logbsize`` below
    256k, btrfs ``compress`` (O_DIRECT on compressed files is buffered)."""
    if f.mount is None:
        return Check("journal", UNKNOWN, "no mount found", "run on Linux with /proc mounted")
    m, opts = f.mount, f.mount.super_options
    mp, src = _q(m.mountpoint), _q(m.source)
    if m.fstype == "ext4":
        data, commit = _option(opts, "data") or "ordered", _option(opts, "commit")
        value = f"data={data}" + (f", commit={commit}" if commit else "")
        if data == "journal":
            return Check("journal", WARN, value, "data=journal writes every block twice and "
                         "turns O_DIRECT into buffered I/O: mount with data=ordered (not possible "
                         "by remount)", {"ext4_data": data}, command=_remount_data(f))
        if commit and commit.isdigit() and int(commit) < _DEFAULT_COMMIT:
            return Check("journal", WARN, value, f"the journal commits every {commit} s; the "
                         f"default {_DEFAULT_COMMIT} s writes less", {"ext4_data": data},
                         command=f"mount -o remount,commit={_DEFAULT_COMMIT} {mp}")
        return Check("journal", OK, value, data={"ext4_data": data})
    if m.fstype == "xfs":
        text = _option(opts, "logbsize")
        size = _kib(text) if text else None
        if size is not None and size < _GOOD_LOGBSIZE:
            return Check("journal", WARN, f"logbsize={text}", "small log buffers slow saves of many "
                         "files: mount with logbsize=256k (not possible by remount)",
                         command=f"umount {mp} && mount -o logbsize=256k {src} {mp}")
        return Check("journal", OK, f"logbsize={text}" if text else "logbsize default")
    if m.fstype == "btrfs":
        comp = next((o for o in opts if o.startswith("compress")), None)
        if comp:
            return Check("journal", WARN, comp, "O_DIRECT on compressed files is buffered: "
                         "turn compression off for new files", command=f"mount -o remount,compress=no {mp}")
        return Check("journal", OK, "no compression")
    return Check("journal", OK, f"nothing to check on {m.fstype}")


def check_raid(f: StorageFacts, config: IOConfig) -> Check:
    """The RAID under the path and its stripe against deepnvme's ``block_size``: a chunk (what
    one drive holds of a stripe) should divide the block size, and for parity RAID a whole
    stripe (chunk x data drives) should, so no write is a partial stripe."""
    r, bs = f.raid, config.block_size
    if r is None:
        if f.device is None:
            return Check("raid", UNKNOWN, "no block device found under the path",
                         "nothing to check where no block device backs the path")
        return Check("raid", OK, f"none: one device ({f.device.name})", data={"raid_level": None})
    devices = f"{r.level or 'unknown level'} over {r.devices} device(s) ({r.kind} {r.name})"
    data: dict[str, Any] = {"raid_level": r.level, "raid_devices": r.devices,
                            "raid_chunk_bytes": r.chunk_bytes}
    if r.level in ("linear", "single") and r.devices > 1:
        fix = (f"btrfs balance start -dconvert=raid0 {_q(f.mount.mountpoint)}"
               if r.kind == "btrfs" and f.mount else
               f"lvcreate --type striped -i {r.devices} -I 1m -l 100%FREE -n data <vg>")
        return Check("raid", WARN, devices, "a file lies on one drive at a time: stripe the "
                     "drives (RAID-0) or use a deepnvme Volume over one directory per drive",
                     data, command=fix)
    if r.chunk_bytes is None:
        return Check("raid", OK, devices + ", not striped", data=data)
    width = r.chunk_bytes * data_devices(r.level, r.devices)
    value = (f"{devices}, chunk {fmt_size(r.chunk_bytes)}, stripe {fmt_size(width)}; "
             f"block_size {fmt_size(bs)}")
    data["raid_stripe_bytes"] = width
    parity = r.level in ("raid4", "raid5", "raid6", "4", "5", "6")
    if bs % r.chunk_bytes or (parity and bs % width):
        return Check("raid", WARN, value, "requests straddle chunks" + (
            " and write partial stripes (read-modify-write)" if parity else "") +
            f": set block_size to a multiple of {fmt_size(width if parity else r.chunk_bytes)}",
            data, command=f"export DEEPNVME_BLOCK_SIZE={width}")
    if bs * config.queue_depth * config.intra_op_parallelism < width:
        return Check("raid", WARN, value, "fewer bytes in flight than one stripe: some drives "
                     "idle; raise block_size or queue_depth", data,
                     command=f"export DEEPNVME_BLOCK_SIZE={width}")
    return _xfs_stripe(f, value, data, width) or Check("raid", OK, value, data=data)


def _xfs_stripe(f: StorageFacts, value: str, data: dict[str, Any], width: int) -> Check | None:
    """A WARN where xfs on an md/dm stripe was made without that stripe (``sunit``/``swidth``
    in the mount options, 512-byte units): its allocations then ignore chunk boundaries."""
    r = f.raid
    if f.mount is None or f.mount.fstype != "xfs" or r is None or r.kind == "btrfs" or not r.chunk_bytes:
        return None
    sunit, swidth = _option(f.mount.super_options, "sunit"), _option(f.mount.super_options, "swidth")
    if sunit and swidth and sunit.isdigit() and swidth.isdigit() and \
            (int(sunit) * 512, int(swidth) * 512) == (r.chunk_bytes, width):
        return None
    told = f"sunit={sunit}, swidth={swidth}" if sunit else "no stripe"
    return Check("raid", WARN, f"{value}; xfs has {told}", "xfs does not align to this stripe: "
                 "make it again with the stripe (the command erases the array)", data,
                 command=f"mkfs.xfs -f -d su={r.chunk_bytes >> 10}k,sw={width // r.chunk_bytes} "
                         f"{f.mount.source}")


def check_queue_depth(f: StorageFacts, config: IOConfig) -> Check:
    """Each drive's ``nr_requests`` against the requests deepnvme keeps in flight on it:
    ``queue_depth x intra_op_parallelism`` per handle, spread over the drives."""
    if not f.leaves or any(d.nr_requests is None for d in f.leaves):
        return Check("queue depth", UNKNOWN, "nr_requests not readable",
                     "nothing to check where no block device backs the path")
    in_flight = config.queue_depth * config.intra_op_parallelism
    per_drive = math.ceil(in_flight / len(f.leaves))
    value = ", ".join(f"{d.name} {d.nr_requests}" for d in f.leaves)
    value += f" (deepnvme keeps {per_drive} in flight per drive)"
    short = [d for d in f.leaves if (d.nr_requests or 0) < per_drive]
    data = {"nr_requests": min(d.nr_requests or 0 for d in f.leaves), "in_flight_per_drive": per_drive}
    if not short:
        return Check("queue depth", OK, value, data=data)
    return Check("queue depth", WARN, value, "requests wait in the block layer: raise nr_requests "
                 "(up to what the device takes) or lower queue_depth", data,
                 command=_sysfs_write(short, "nr_requests", per_drive))


def check_scheduler(f: StorageFacts) -> Check:
    """``none`` or ``mq-deadline`` on NVMe and other SSDs; fair-queueing schedulers cost CPU
    per request at NVMe rates."""
    if not f.leaves or any(d.scheduler is None for d in f.leaves):
        return Check("scheduler", UNKNOWN, "queue/scheduler not readable",
                     "nothing to check where no block device backs the path")
    value = ", ".join(f"{d.name} {d.scheduler}" for d in f.leaves)
    slow = [d for d in f.leaves if not d.rotational and d.scheduler not in _FAST_SCHEDULERS]
    if not slow:
        return Check("scheduler", OK, value)
    return Check("scheduler", WARN, value, "use 'none' on NVMe", command=_sysfs_write(slow, "scheduler", "none"))


def check_max_sectors(f: StorageFacts, config: IOConfig) -> Check:
    """``max_sectors_kb`` against the request each drive gets (``block_size``, or the RAID chunk
    where smaller): a smaller limit splits every request."""
    if not f.leaves or any(d.max_sectors_kb is None for d in f.leaves):
        return Check("max_sectors_kb", UNKNOWN, "queue/max_sectors_kb not readable",
                     "nothing to check where no block device backs the path")
    request = config.block_size
    if f.raid is not None and f.raid.chunk_bytes:
        request = min(request, f.raid.chunk_bytes)
    want = max(1, request >> 10)
    value = ", ".join(f"{d.name} {d.max_sectors_kb}" for d in f.leaves) + f" (requests of {fmt_size(request)})"
    small = [d for d in f.leaves if (d.max_sectors_kb or 0) < want]
    data = {"max_sectors_kb": min(d.max_sectors_kb or 0 for d in f.leaves), "request_bytes": request}
    if not small:
        return Check("max_sectors_kb", OK, value, data=data)
    hw = min(d.max_hw_sectors_kb or 0 for d in small)
    if hw >= want:
        return Check("max_sectors_kb", WARN, value, "each request is split: raise max_sectors_kb",
                     data, command=_sysfs_write(small, "max_sectors_kb", want))
    limit = min(d.max_sectors_kb or 0 for d in small) << 10
    return Check("max_sectors_kb", WARN, value, f"the device takes at most {hw} KiB per request: "
                 "lower block_size to it", data, command=f"export DEEPNVME_BLOCK_SIZE={limit}")


def check_alignment(f: StorageFacts, config: IOConfig) -> Check:
    """The O_DIRECT alignment the kernel reports (or the logical sector) and the physical
    sector against ``alignment`` and ``block_size``: chunks smaller than, or not a multiple
    of, the physical sector cost the drive a read-modify-write."""
    dev = f.device
    logical = f.dio_offset_align or (dev.logical_block_size if dev else None)
    physical = (dev.physical_block_size if dev else None) or logical
    if logical is None or physical is None:
        return Check("dio alignment", UNKNOWN, "neither statx nor the device reports it",
                     f"deepnvme assumes {config.alignment} B (the alignment setting)")
    value = f"offset {logical} B, physical sector {physical} B; alignment {config.alignment} B, " \
            f"block_size {fmt_size(config.block_size)}"
    data = {"dio_offset_bytes": logical, "physical_sector_bytes": physical}
    if f.dio_offset_align is None and logical > config.alignment:
        return Check("dio alignment", WARN, value, "the kernel does not report the alignment and "
                     "the device needs more than deepnvme assumes", data,
                     command=f"export DEEPNVME_ALIGNMENT={logical}")
    if config.block_size % physical:
        size = -(-config.block_size // physical) * physical
        return Check("dio alignment", WARN, value, "block_size is not a multiple of the physical "
                     "sector", data, command=f"export DEEPNVME_BLOCK_SIZE={size}")
    return Check("dio alignment", OK, value, data=data)


def check_free_space(f: StorageFacts, need: int | None) -> Check:
    """Free bytes (statvfs, as an unprivileged user sees them) against ``need``: FAIL below it,
    WARN within 10% of it (filesystems slow down when nearly full)."""
    if f.free_bytes is None:
        return Check("free space", UNKNOWN, "statvfs failed", "check that the path exists")
    value = f"{f.free_bytes / 1e9:.1f} GB free of {(f.total_bytes or 0) / 1e9:.1f} GB"
    data = {"free_bytes": f.free_bytes, "need_bytes": need}
    if need is None:
        return Check("free space", OK, value + " (pass --need SIZE to compare)", data=data)
    value += f", {need / 1e9:.1f} GB needed"
    if f.free_bytes >= need * 1.1:
        return Check("free space", OK, value, data=data)
    status = FAIL if f.free_bytes < need else WARN
    return Check("free space", status, value, f"free {max(0, need - f.free_bytes) / 1e9:.1f} GB "
                 "or more, or pick a larger volume (deepnvme clean removes leftover temporary files)",
                 data, command=f"deepnvme clean {_q(f.path)} && du -sh {_q(f.path)}/* | sort -h | tail")


def check_device(f: StorageFacts) -> Check:
    """Whether the drives are solid state; a rotational drive moves ~0.2 GB/s."""
    if not f.leaves:
        return Check("device", UNKNOWN, "no block device under the path",
                     "deepnvme is made for local NVMe; a memory or network filesystem has none")
    value = ", ".join(f"{d.name} ({'rotational' if d.rotational else 'solid state'})" for d in f.leaves)
    spinning = [d for d in f.leaves if d.rotational]
    if not spinning:
        return Check("device", OK, value, data={"rotational": False})
    if all(d.name.startswith(("vd", "xvd")) for d in spinning):
        return Check("device", WARN, value, "virtual disks often report rotational=1 whatever "
                     "backs them: ask what the host gives this disk", {"rotational": True})
    return Check("device", WARN, value, "a spinning disk: put the files on NVMe (the command "
                 "erases <device>)", {"rotational": True}, command=_mkfs(f.path))


def storage_checks(facts: StorageFacts, config: IOConfig, *, need: int | None = None) -> tuple[Check, ...]:
    """Every storage check, in the order printed; pure (no system reads)."""
    if not facts.exists:
        return (check_filesystem(facts),)
    return (check_filesystem(facts), check_o_direct(facts), check_mount_options(facts),
            check_journal(facts), check_device(facts), check_raid(facts, config),
            check_queue_depth(facts, config), check_scheduler(facts),
            check_max_sectors(facts, config), check_alignment(facts, config),
            check_free_space(facts, need))
