"""``deepnvme report``: is this environment usable for fast tensor I/O? (DeepSpeed's ds_report).

Every check is OK, WARN (works, but slower or with a limitation) or FAIL (will not work), and
anything not OK carries a hint that says what to do.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import platform
import resource
import shutil
import sys
import warnings
from typing import Any

import torch

from ..checkpoint._load_path import lookup
from ..io.durable import create_temp
from ._engines import EngineStatus, auto_per_transfer, engine_statuses
from ._storage_facts import probe_o_direct
from ._system import block_device, mount_of
from ._units import GB, fmt_size

__all__ = ["OK", "WARN", "FAIL", "UNKNOWN", "Check", "Report", "run_report"]

OK, WARN, FAIL = "OK", "WARN", "FAIL"
UNKNOWN = "UNKNOWN"  # the facts a check needs could not be read (storage checks only)
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre")


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report; ``data`` holds its facts as numbers and booleans for ``--json``
    (``value`` is the text for people); ``hint`` says what to change and ``command`` (storage
    checks) is a shell command that changes it."""

    name: str
    status: str
    value: str
    hint: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    command: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    directory: str
    checks: tuple[Check, ...]
    engines: tuple[EngineStatus, ...] = ()

    @property
    def ok(self) -> bool:
        """True when no check FAILed."""
        return all(c.status != FAIL for c in self.checks)

    @property
    def facts(self) -> dict[str, Any]:
        """Every check's ``data`` in one mapping (bytes, counts and booleans, typed)."""
        return {k: v for c in self.checks for k, v in c.data.items()}

    def to_dict(self) -> dict[str, Any]:
        auto = next((e.name for e in self.engines if e.auto), None)
        return {"directory": self.directory, "ok": self.ok, "facts": self.facts,
                "checks": [dataclasses.asdict(c) for c in self.checks],
                "engines": [e.to_dict() for e in self.engines], "auto_engine": auto,
                "auto_per_transfer": [dataclasses.asdict(c)
                                      for c in auto_per_transfer(self.engines)]}


def _software(directory: str) -> list[Check]:
    from .._version import __version__

    py = sys.version_info
    checks = [
        Check("python", OK if py >= (3, 10) else FAIL, platform.python_version(),
              "" if py >= (3, 10) else "deepnvme needs Python 3.10 or newer"),
        Check("torch", OK, torch.__version__),
        Check("deepnvme", OK, f"{__version__} ({os.path.dirname(os.path.dirname(__file__))})"),
        Check("cpus", OK, f"{os.cpu_count()} (intra_op_parallelism above this rarely helps)",
              data={"cpus": os.cpu_count()}),
    ]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        checks.append(Check("cuda", OK, f"{torch.cuda.device_count()} device(s): {names}",
                            data={"cuda_devices": torch.cuda.device_count()}))
    else:
        checks.append(Check("cuda", WARN, f"not available (torch {torch.__version__})",
                            "CPU tensors work; for GPU tensors install a CUDA build of torch "
                            "and the NVIDIA driver", data={"cuda_devices": 0}))
    checks.append(_gds_check(directory))
    checks.extend((_omp_check(), _alignment_check()))
    fio = shutil.which("fio")
    checks.append(Check("fio", OK if fio else WARN, fio or "not found",
                        "" if fio else "'deepnvme bench --compare' also times fio: apt-get install fio",
                        data={"fio": fio is not None}))
    return checks


def _gds_check(directory: str) -> Check:
    """deepnvme's GdsHandle status (opens the cuFile driver where it can and registers a file
    in ``directory``), with the fix."""
    from ..handles.gds import gds_status

    status = gds_status(directory if os.path.isdir(directory) else None)
    data = {"gds": status.available}
    if not status.available:
        return Check("gpudirect storage", WARN, f"not available: {status.detail}",
                     "GPU tensors are staged through pinned host memory; for GPUDirect install "
                     "NVIDIA GDS (nvidia-fs driver, libcufile) and pip install 'deepnvme[gds]'",
                     data)
    if status.mode != "nvidia-fs":
        return Check("gpudirect storage", WARN, f"usable in {status.mode} mode: {status.detail}",
                     "load the nvidia-fs kernel module (modprobe nvidia_fs) for direct DMA", data)
    return Check("gpudirect storage", OK, f"usable in {status.mode} mode: {status.detail}",
                 data=data)


_FEW_CPUS = 8  # at or below this many cores, spinning OpenMP threads starve background I/O


def _omp_check(cpus: int | None = None, policy: str | None = None) -> Check:
    """OpenMP's wait policy: on few cores, torch's threads spinning between operations take the
    CPU that background reads and writes need (saves, offloaded training, weight streaming)."""
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    policy = os.environ.get("OMP_WAIT_POLICY") if policy is None else policy
    data = {"omp_wait_policy": policy or None}
    if not torch.backends.openmp.is_available():
        return Check("openmp wait", OK, "torch is not built with OpenMP", data=data)
    if (policy or "").strip().lower() == "passive":
        return Check("openmp wait", OK, "OMP_WAIT_POLICY=PASSIVE", data=data)
    value = f"OMP_WAIT_POLICY={policy}" if policy else "OMP_WAIT_POLICY unset (threads spin)"
    if cpus > _FEW_CPUS:
        return Check("openmp wait", OK, f"{value}; {cpus} cores leave room for I/O", data=data)
    return Check("openmp wait", WARN, f"{value} on {cpus} cores",
                 "background saves, offloaded training and weight streaming share these cores "
                 "with torch's spinning threads: start Python with OMP_WAIT_POLICY=PASSIVE "
                 "(read once, when OpenMP starts)", data)


def _alignment_check() -> Check:
    """Where torch puts a large CPU tensor: O_DIRECT reads land straight in existing tensors
    (load_into, restore) only when they start on a page."""
    probe = torch.empty(4 << 20, dtype=torch.uint8)
    offset = probe.data_ptr() % mmap.PAGESIZE
    data = {"torch_alloc_page_offset": offset}
    if offset == 0:
        return Check("tensor alignment", OK, "large CPU tensors start on a page", data=data)
    return Check("tensor alignment", WARN,
                 f"large CPU tensors start {offset} B past a page: reads into existing tensors "
                 "go through bounce buffers",
                 "start Python with THP_MEM_ALLOC_ENABLE=1 (torch then page-aligns CPU "
                 "allocations of 2 MiB and more)", data)


_ENGINE_HINTS = {
    "io_uring": "needs Linux 5.1+ with io_uring allowed (sysctl kernel.io_uring_disabled=0; "
                "container seccomp profiles often block io_uring_setup)",
    "aio": "needs a kernel built with Linux AIO (CONFIG_AIO) and room under fs.aio-max-nr",
    "threads": "threads needs only preadv/pwritev; please report this as a bug",
}


def _engine_checks(engines: tuple[EngineStatus, ...]) -> list[Check]:
    """One line per engine, then the one ``auto`` picks (and DEEPNVME_ENGINE if it is set)."""
    checks = [Check(f"engine {e.name}", OK if e.available else WARN,
                    f"{'available' if e.available else 'not available'}: {e.detail}",
                    "" if e.available else _ENGINE_HINTS.get(e.name, "")) for e in engines]
    auto = next((e.name for e in engines if e.auto), None)
    if auto is None:
        checks.append(Check("engine auto", FAIL, "no engine runs here",
                            "every engine failed its probe (see above); please report this"))
        return checks
    value = f"{auto} (the first available of {', '.join(e.name for e in engines)})"
    env = os.environ.get("DEEPNVME_ENGINE")
    if env:
        value += f"; DEEPNVME_ENGINE={env} sets handles' engine instead"
    per_transfer = auto_per_transfer(engines)
    if per_transfer:
        value += ", per transfer as below"
    checks.append(Check("engine auto", OK, value))
    checks += [Check(f"engine auto: {c.transfer}", OK, f"{c.mover}: {c.why}")
               for c in per_transfer]
    return checks


def _has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (capability 14, e.g. root)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        return False  # unknown: report the limit as it stands
    return False


def _memlock_checks() -> list[Check]:
    from ..memory.pinned import free_cpu_locked_tensor, is_pinned, new_cpu_locked_tensor

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    text = "unlimited" if unlimited else fmt_size(soft) if soft else "0 B"
    if not unlimited and hard != resource.RLIM_INFINITY:
        text += f" (hard {fmt_size(hard) if hard else '0 B'})"
    big = unlimited or soft >= 1 << 30
    if not big and _has_cap_ipc_lock():
        big, text = True, text + "; CAP_IPC_LOCK lifts it for this process"
    checks = [Check("RLIMIT_MEMLOCK", OK if big else WARN, text,
                    "" if big else "buffers above this size are not page-locked: raise it with "
                    "'ulimit -l unlimited' or memlock in /etc/security/limits.conf (containers: "
                    "--ulimit memlock=-1)", _memlock_data(soft, hard))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = new_cpu_locked_tensor(16 * mmap.PAGESIZE)
    locked = is_pinned(t)
    free_cpu_locked_tensor(t)
    checks.append(Check("mlock", OK if locked else WARN,
                        "works" if locked else "refused for a 64 KiB buffer",
                        "" if locked else "raise RLIMIT_MEMLOCK (see above)",
                        data={"mlock": locked}))
    checks.append(_huge_page_check())
    return checks


def _huge_page_check() -> Check:
    """Transparent huge pages for locked buffers (:mod:`deepnvme.memory.pinned`): a direct
    transfer from huge pages has 512x fewer pages for the kernel to pin."""
    from ..memory.pinned import huge_page_mode, huge_page_size

    mode, size = huge_page_mode(), huge_page_size()
    granted = mode in ("always", "madvise") and size > 0
    value = (f"{mode} ({fmt_size(size)} pages): locked buffers of {fmt_size(size)} and more use them"
             if granted else f"{mode}: locked buffers use {fmt_size(mmap.PAGESIZE)} pages")
    hint = "" if granted else (
        "direct transfers cost more CPU per byte (the kernel pins every small page): "
        "'echo madvise > /sys/kernel/mm/transparent_hugepage/enabled' (root)"
        if mode == "never" else "this kernel offers no transparent huge pages (CONFIG_TRANSPARENT_HUGEPAGE)")
    return Check("huge pages", OK if granted else WARN, value, hint,
                 data={"huge_pages": granted, "huge_page_bytes": size or None})


def _memlock_data(soft: int, hard: int) -> dict[str, Any]:
    """RLIMIT_MEMLOCK in bytes, None where unlimited."""
    def size(limit: int) -> int | None:
        return None if limit == resource.RLIM_INFINITY else limit

    return {"memlock_soft_bytes": size(soft), "memlock_hard_bytes": size(hard),
            "memlock_unlimited": soft == resource.RLIM_INFINITY}


_ALIGN_UNKNOWN = {"dio_alignment_memory_bytes": None, "dio_alignment_offset_bytes": None}


def _probe_o_direct(directory: str) -> tuple[Check, Check]:
    """Write and read one aligned block with O_DIRECT in ``directory``; report the alignment."""
    accepted, detail, memory, offset = probe_o_direct(directory)
    if not accepted:
        hint = ("reads and writes go through the page cache; put files on a local ext4/xfs "
                "filesystem for O_DIRECT" if detail.startswith("refused")
                else "deepnvme falls back to buffered I/O here")
        return (Check("O_DIRECT", WARN, detail, hint, {"o_direct": False}),
                Check("dio alignment", WARN, "n/a (no O_DIRECT)", data=_ALIGN_UNKNOWN))
    if memory is None or offset is None:
        a = Check("dio alignment", OK, "not reported by the kernel (statx DIOALIGN needs Linux 6.1+); "
                  "4096 B assumed", data=_ALIGN_UNKNOWN)
    else:
        a = Check("dio alignment", OK, f"memory {memory} B, file offset {offset} B",
                  data={"dio_alignment_memory_bytes": memory, "dio_alignment_offset_bytes": offset})
    return Check("O_DIRECT", OK, "accepted", data={"o_direct": True}), a


def _dir_checks(directory: str) -> list[Check]:
    if not os.path.isdir(directory):
        return [Check("directory", FAIL, f"{directory} does not exist",
                      "pass an existing directory with --dir", {"writable": False})]
    try:
        os.unlink(create_temp(directory, "deepnvme-report"))
    except OSError as exc:
        return [Check("directory", FAIL, f"{directory}: cannot create files ({exc.strerror})",
                      "use a directory you can write to (--dir)", {"writable": False})]
    checks = [Check("directory", OK, f"{os.path.abspath(directory)} (writable)",
                    data={"writable": True})]
    mount = mount_of(directory)
    if mount is None:
        checks.append(Check("filesystem", WARN, "unknown (no /proc/self/mountinfo)"))
    else:
        fs_status, fs_hint = OK, ""
        if mount.fstype in ("tmpfs", "ramfs"):
            fs_status, fs_hint = WARN, "this is memory, not storage: benchmark a disk-backed directory"
        elif mount.fstype in _NETWORK_FS or mount.fstype.startswith("fuse"):
            fs_status, fs_hint = WARN, "network/FUSE filesystem: local NVMe is much faster"
        checks.append(Check("filesystem", fs_status,
                            f"{mount.fstype} on {mount.mountpoint} from {mount.source}", fs_hint,
                            {"fstype": mount.fstype}))
    checks.extend(_probe_o_direct(directory))
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    checks.append(Check("free space", OK if free >= 2 * GB else WARN, f"{free / GB:.1f} GB",
                        "" if free >= 2 * GB else "'deepnvme bench' needs --io-size x --procs free",
                        {"free_bytes": free}))
    checks.extend(_device_checks(mount.dev if mount else None))
    return checks


def _device_checks(dev: str | None) -> list[Check]:
    info = block_device(dev) if dev else None
    if info is None:
        return [Check("block device", WARN, "none found (not a local block device)",
                      "deepnvme is made for local NVMe; results here reflect this filesystem")]
    checks = [Check("block device", OK, f"/dev/{info.name}" + (f", {info.model}" if info.model else ""))]
    if info.rotational is not None:
        virt = info.name.startswith(("vd", "xvd"))
        checks.append(Check("rotational", WARN if info.rotational else OK,
                            "yes" if info.rotational else "no (SSD/NVMe)",
                            ("virtual disks often report rotational=1 whatever backs them"
                             if virt else "a spinning disk: expect ~0.2 GB/s, not NVMe speed")
                            if info.rotational else "", {"rotational": info.rotational}))
    if info.scheduler is not None:
        slow = info.scheduler in ("bfq", "cfq")
        checks.append(Check("io scheduler", WARN if slow else OK, info.scheduler,
                            f"'none' suits NVMe: echo none > /sys/block/{info.name}/queue/scheduler"
                            if slow else ""))
    return checks


def _load_path_check(directory: str) -> Check:
    """How the loaders read on ``directory``'s device, and why (measured on first load)."""
    try:
        choice = lookup(directory)
    except OSError as exc:
        return Check("load path", WARN, f"cannot stat {directory!r}: {exc.strerror}",
                     "pass an existing directory with --dir")
    if choice is None:
        return Check("load path", OK, "not measured on this device yet: the first load of a file "
                     "of 128 MiB or more measures it, or run `deepnvme tune --load --dir "
                     f"{directory}`")
    return Check("load path", OK, f"{choice.device}: fresh loads {choice.fresh}, load_into "
                 f"{choice.into} ({choice.reason})", data=choice.to_dict())


def run_report(directory: str = ".") -> Report:
    """Collect every check for the environment and for ``directory``; blocking, a few ms."""
    engines = engine_statuses()
    checks = (_software(directory) + _engine_checks(engines) + _memlock_checks() + _dir_checks(directory)
              + [_load_path_check(directory)])
    return Report(os.path.abspath(directory), tuple(checks), engines)
