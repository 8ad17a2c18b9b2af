"""Read-only facts about the machine from /proc and /sys (mounts, block devices, memory)."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["Mount", "BlockDevice", "mount_of", "block_device", "mem_available", "read_text"]


@dataclasses.dataclass(frozen=True)
class Mount:
    mountpoint: str
    fstype: str
    source: str
    dev: str  # "major:minor"
    options: tuple[str, ...] = ()  # per-mount options (rw, noatime, relatime ...)
    super_options: tuple[str, ...] = ()  # the filesystem's own (data=ordered, logbsize=...)


@dataclasses.dataclass(frozen=True)
class BlockDevice:
    name: str
    model: str | None
    rotational: bool | None
    scheduler: str | None


def _unescape(field: str) -> str:
    """mountinfo escapes spaces, tabs, newlines and backslashes as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_of(path: str, *, mountinfo: str = "/proc/self/mountinfo") -> Mount | None:
    """The mount holding ``path`` (longest mount point prefix of its real path), or None."""
    real = os.path.realpath(path)
    best: Mount | None = None
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if not sep or len(parts) < 5 or len(rparts) < 2:
            continue
        point = _unescape(parts[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mountpoint)):
            best = Mount(point, rparts[0], _unescape(rparts[1]), parts[2],
                          tuple(parts[5].split(",")) if len(parts) > 5 else (),
                          tuple(rparts[2].split(",")) if len(rparts) > 2 else ())
    return best


def read_text(path: str) -> str | None:
    """A small file's text, stripped (sysfs, procfs), or None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def block_device(dev: str, *, sys_root: str = "/sys") -> BlockDevice | None:
    """The whole-disk block device behind ``dev`` ("major:minor"), with what /sys tells of it."""
    link = os.path.join(sys_root, "dev", "block", dev)
    if not os.path.exists(link):
        return None
    node = os.path.realpath(link)
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)
    name = os.path.basename(node)
    queue = os.path.join(node, "queue")
    rot = read_text(os.path.join(queue, "rotational"))
    sched_line = read_text(os.path.join(queue, "scheduler"))
    scheduler = None
    if sched_line:
        chosen = [w[1:-1] for w in sched_line.split() if w.startswith("[")]
        scheduler = chosen[0] if chosen else sched_line
    model = read_text(os.path.join(node, "device", "model"))
    if not model:
        vendor = read_text(os.path.join(node, "device", "vendor"))
        model = f"vendor {vendor}" if vendor else None
    return BlockDevice(name, model, None if rot is None else rot == "1", scheduler)


def mem_available() -> int | None:
    """Bytes of MemAvailable from /proc/meminfo, or None."""
    text = read_text("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
