"""tools/run_deepspeed_op_tests.py without the network: its shim runs a DeepSpeed-style test file
(DeepSpeed's imports, unchanged) against deepnvme, and its archive extraction keeps only tests."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE_SPECIFIC = True  # runs a subprocess; the engine it uses is not this process's
RUNNER = ROOT / "tools" / "run_deepspeed_op_tests.py"

# Written the way DeepSpeed's op tests are: only DeepSpeed's import paths, nothing of deepnvme's.
DEEPSPEED_STYLE_TEST = textwrap.dedent('''
    import os
    import pytest
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder
    from unit.common import DistributedTest

    if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
        pytest.skip("async_io not compatible", allow_module_level=True)


    class TestShim(DistributedTest):
        world_size = 2

        def test_round_trip(self, tmpdir):
            assert dist.get_rank() == 0 and get_accelerator().device_name() in ("cpu", "cuda")
            h = AsyncIOBuilder().load().aio_handle(1024, 2, False, False, 2)
            pin = PinMemoryBuilder().load().pin_handle()
            buf = pin.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.uint8))
            assert h.is_pinned(buf)
            buf.copy_(torch.ByteTensor(list(os.urandom(4096))))
            path = os.path.join(tmpdir, "f")
            fd = os.open(path, os.O_CREAT | os.O_WRONLY)
            assert h.async_pwrite(buffer=buf, fd=fd, file_offset=0) == 0 and h.wait() == 1
            os.close(fd)
            back = torch.zeros(4096, dtype=torch.uint8)
            assert h.pread(buffer=back, filename=path, validate=False, **{"async": False}) == 1
            assert back.tolist() == buf.tolist()
            assert pin.free_cpu_locked_tensor(buf)

        def test_must_fail(self):
            assert AsyncIOBuilder().load().aio_handle().get_alignment() == 4096
''')


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_deepspeed_op_tests", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shim_runs_a_deepspeed_style_file_against_deepnvme(tmp_path):
    tests = tmp_path / "ds_tests"
    tests.mkdir()
    (tests / "test_shim_sample.py").write_text(DEEPSPEED_STYLE_TEST)
    proc = subprocess.run([sys.executable, str(RUNNER), "--no-sdist", "--tests-dir", str(tests)],
                          capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # one test passes, the other is meant to fail
    assert "1 failed, 1 passed" in out, out
    assert "FAILED tests/unit/ops/aio/test_shim_sample.py::TestShim::test_must_fail" in out, out
    assert "test_round_trip (world_size=2)" in out, out  # the shim says it ran once, as rank 0
    assert f"deepnvme 0.1.0 from {ROOT / 'src' / 'deepnvme'}" in out, out


def test_archive_extraction_keeps_only_the_op_tests(tmp_path):
    runner = _load_runner()
    archive = tmp_path / "ds.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("DeepSpeed-0.1/tests/unit/ops/aio/test_aio.py",
                     "DeepSpeed-0.1/tests/unit/ops/adam/test_adam.py",
                     "DeepSpeed-0.1/setup.py"):
            data = b"# test\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    root = runner._extract(archive, tmp_path / "out", only=runner.TEST_DIRS)
    assert [p.name for p in runner.find_tests(root)] == ["test_aio.py"]
    assert not (root / "setup.py").exists()
    assert not (root / "tests" / "unit" / "ops" / "adam").exists()
