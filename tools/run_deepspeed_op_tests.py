#!/usr/bin/env python3
"""Run DeepSpeed's own NVMe op unit tests, unchanged, against deepnvme.compat.

DeepSpeed's files are fetched at run time into a temporary directory and never stored here:

1. the deepspeed sdist (``pip download --no-deps --no-binary :all: deepspeed[==VERSION]``), whose
   ``deepspeed/io`` package (FastFileWriter) the tests drive the handles through;
2. the test files, ``tests/unit/ops/{aio,pin_memory}/test_*.py``: from the sdist if it has them
   (0.19.x sdists do not ship ``tests/``), else from the GitHub archive of tag ``vVERSION``,
   or from ``--tests-dir`` (a directory holding the ``test_*.py`` files, e.g. a checkout's
   ``tests/unit/ops/aio``) where the machine cannot reach GitHub.

The files run with pytest under tools/deepspeed_shim, a stand-in ``deepspeed`` package whose
``deepspeed.ops.op_builder`` is deepnvme.compat, ``deepspeed.accelerator`` is torch (CUDA if
visible, else CPU) and ``unit.common.DistributedTest`` runs each test once in-process as rank 0
(see the shim's docstrings for what is and is not emulated). The shim never imports DeepSpeed's
compiled ops. Exit status is pytest's.

    python tools/run_deepspeed_op_tests.py                     # latest deepspeed
    python tools/run_deepspeed_op_tests.py --version 0.19.8 --tests-dir ~/DeepSpeed/tests/unit/ops/aio
    python tools/run_deepspeed_op_tests.py -- -k offset -x     # arguments after -- go to pytest
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "deepspeed_shim"
TEST_DIRS = ("tests/unit/ops/aio", "tests/unit/ops/pin_memory")
GITHUB_ARCHIVE = "https://github.com/deepspeedai/DeepSpeed/archive/refs/tags/v{version}.tar.gz"
PYTEST_INI = """[pytest]
addopts = -p ds_shim_plugin -p no:cacheprovider -rA --tb=short
"""


def _extract(archive: Path, dest: Path, only: tuple[str, ...] | None = None) -> Path:
    """Extract a .tar.gz (only members under the ``only`` sub-paths, if given); return its root."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        if only is not None:
            members = [m for m in members
                       if any(f"/{sub}/" in f"/{m.name}" for sub in only)]
        if hasattr(tarfile, "data_filter"):  # 3.12, and backported to 3.10.12 / 3.11.4
            tar.extractall(dest, members=members, filter="data")
        else:
            for m in members:
                if m.name.startswith("/") or ".." in Path(m.name).parts:
                    raise RuntimeError(f"refusing archive member outside the tree: {m.name}")
            tar.extractall(dest, members=members)
    roots = [p for p in dest.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise RuntimeError(f"{archive.name}: expected one top-level directory, found {len(roots)}")
    return roots[0]


def download_sdist(version: str | None, work: Path) -> Path:
    """pip-download the deepspeed sdist and extract it; returns the source root."""
    dl = work / "download"
    spec = f"deepspeed=={version}" if version else "deepspeed"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
           "--dest", str(dl), spec]
    print(f"fetching {spec} sdist: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True)
    archives = sorted(dl.glob("deepspeed-*.tar.gz"))
    if len(archives) != 1:
        raise RuntimeError(f"pip download left {len(archives)} deepspeed archives in {dl}")
    return _extract(archives[0], work / "sdist")


def find_tests(tree: Path) -> list[Path]:
    return sorted(p for sub in TEST_DIRS for p in (tree / sub).glob("test_*.py"))


def download_github_tests(version: str, work: Path) -> list[Path]:
    """The op test files of tag ``v{version}`` from GitHub's archive (only those are extracted)."""
    url = GITHUB_ARCHIVE.format(version=version)
    archive = work / "github.tar.gz"
    print(f"the sdist has no tests/; fetching {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=120) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as exc:  # URLError and HTTPError are OSErrors
        raise SystemExit(f"cannot fetch DeepSpeed's tests from {url}: {exc}\n"
                         "pass --tests-dir with DeepSpeed's tests/unit/ops/aio (a checkout or "
                         "an unpacked release archive)") from None
    return find_tests(_extract(archive, work / "github", only=TEST_DIRS))


def sdist_version(src: Path) -> str:
    version_file = src / "version.txt"
    if not version_file.is_file():
        raise RuntimeError(f"{src} has no version.txt; pass --version")
    return version_file.read_text().strip()


def stage(tests: list[Path], work: Path) -> Path:
    """Copy the test files (unchanged) into a run directory laid out as DeepSpeed's tests/."""
    run = work / "run"
    for test in tests:
        sub = next((s for s in TEST_DIRS if f"/{s}/" in test.as_posix()), TEST_DIRS[0])
        dest = run / sub
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(test, dest / test.name)
    (run / "pytest.ini").write_text(PYTEST_INI)
    return run


def run_pytest(run: Path, deepspeed_src: Path | None, pytest_args: list[str]) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(ROOT / "src")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("DEEPNVME_DEEPSPEED_SRC", None)
    if deepspeed_src is not None:
        env["DEEPNVME_DEEPSPEED_SRC"] = str(deepspeed_src)
    cmd = [sys.executable, "-m", "pytest", "-c", str(run / "pytest.ini"), "--rootdir", str(run),
           str(run / "tests"), *pytest_args]
    print(f"running: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, check=False, cwd=run, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="deepspeed version (default: the latest on the index)")
    parser.add_argument("--deepspeed-src", type=Path,
                        help="an extracted DeepSpeed source tree to use instead of downloading the sdist")
    parser.add_argument("--tests-dir", type=Path,
                        help="directory of DeepSpeed test_*.py files (instead of the sdist or GitHub)")
    parser.add_argument("--no-sdist", action="store_true",
                        help="no DeepSpeed sources at all: tests importing deepspeed.io then fail")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="deepnvme-ds-tests-"))
    try:
        src: Path | None = args.deepspeed_src
        if src is None and not args.no_sdist:
            src = download_sdist(args.version, work)
        if args.tests_dir is not None:
            tests = sorted(args.tests_dir.glob("test_*.py"))
        else:
            tests = find_tests(src) if src is not None else []
            if not tests:
                version = args.version or (sdist_version(src) if src is not None else None)
                if version is None:
                    parser.error("--no-sdist needs --tests-dir or --version")
                tests = download_github_tests(version, work)
        if not tests:
            parser.error("no DeepSpeed test files found; pass --tests-dir")
        print("DeepSpeed test files: " + ", ".join(t.name for t in tests), flush=True)
        return run_pytest(stage(tests, work), src, pytest_args)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
