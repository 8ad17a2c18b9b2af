"""DeepNVMeCheckpointIO under a real Lightning Trainer on CPU, against Lightning's TorchCheckpointIO."""

import errno
import logging
import os
import sys
import threading
import time

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

from deepnvme.integrations.lightning import DeepNVMeCheckpointIO  # noqa: E402


class _Net(L.LightningModule):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _data(width: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, width, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _trainer(root, max_steps, plugins, **ckpt):
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_last=True, **ckpt)
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=plugins, callbacks=[callback],
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=root), callback


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_trainer_top_k_last_and_resume(tmp_path):
    torch.manual_seed(0)
    trainer, callback = _trainer(tmp_path, 10, [DeepNVMeCheckpointIO()], save_top_k=2, monitor="train_loss")
    model = _Net()
    assert isinstance(trainer.strategy.checkpoint_io, DeepNVMeCheckpointIO)
    trainer.fit(model, _data())
    names = sorted(os.listdir(tmp_path))
    ckpts = [n for n in names if n.endswith(".ckpt")]
    assert "last.ckpt" in ckpts and len(ckpts) == 3, names  # top 2 + last; older ones removed
    assert not [n for n in names if not n.endswith(".ckpt")], names  # no temporary files left
    last = tmp_path / "last.ckpt"
    theirs = TorchCheckpointIO().load_checkpoint(last, weights_only=False)
    plain = torch.load(last, weights_only=False)
    ours = DeepNVMeCheckpointIO().load_checkpoint(last, weights_only=False)
    assert theirs["global_step"] == 10 and _equal(theirs, plain) and _equal(ours, plain)
    assert _equal(plain["state_dict"], {f"layer.{k}": v for k, v in model.layer.state_dict().items()})
    for name in ckpts:  # every file Lightning's own reader accepts
        assert TorchCheckpointIO().load_checkpoint(tmp_path / name)["epoch"] >= 0

    resumed, _ = _trainer(tmp_path, 16, [DeepNVMeCheckpointIO()], save_top_k=2, monitor="train_loss")
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["step"] = trainer.global_step
            seen["weights"] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    resumed.callbacks.append(Probe())
    resumed.fit(_Net(), _data(), ckpt_path="last")
    assert seen["step"] == 10
    assert _equal(seen["weights"], plain["state_dict"])
    assert resumed.global_step == 16
    assert torch.load(last, weights_only=False)["global_step"] == 16


def test_reads_torch_checkpoint_io_files_and_resumes_from_them(tmp_path):
    torch.manual_seed(0)
    trainer, _ = _trainer(tmp_path, 4, [TorchCheckpointIO()], save_top_k=-1)
    trainer.fit(_Net(), _data())
    last = tmp_path / "last.ckpt"
    assert _equal(DeepNVMeCheckpointIO().load_checkpoint(last, weights_only=False),
                  torch.load(last, weights_only=False))
    resumed, _ = _trainer(tmp_path, 6, [DeepNVMeCheckpointIO()], save_top_k=-1)
    resumed.fit(_Net(), _data(), ckpt_path=str(last))
    assert torch.load(last, weights_only=False)["global_step"] == 6


def test_save_returns_before_the_write_and_snapshots(tmp_path, monkeypatch):
    from deepnvme.checkpoint import _writer

    gate, real = threading.Event(), _writer.reserve
    monkeypatch.setattr(_writer, "reserve", lambda *a, **k: (gate.wait(10), real(*a, **k))[1])
    io = DeepNVMeCheckpointIO()
    w = torch.arange(1000, dtype=torch.float32)
    io.save_checkpoint({"w": w, "step": 1}, tmp_path / "sub" / "a.ckpt")  # creates the folder
    assert not (tmp_path / "sub" / "a.ckpt").exists()  # staged, not written yet
    w.add_(1)  # training goes on: the file keeps the values of the save's moment
    gate.set()
    io.teardown()
    out = torch.load(tmp_path / "sub" / "a.ckpt")
    assert out["step"] == 1 and torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))


def test_failure_surfaces_at_next_save_then_teardown(tmp_path, monkeypatch, caplog):
    from deepnvme.checkpoint import _writer

    real = _writer.reserve

    def reserve(path, size, **kwargs):
        if "bad" in os.path.basename(path):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(path, size, **kwargs)

    monkeypatch.setattr(_writer, "reserve", reserve)
    io = DeepNVMeCheckpointIO(max_in_flight=2)
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "bad1.ckpt")
    deadline = time.monotonic() + 10
    while not io._pending[0].done():
        assert time.monotonic() < deadline, "the save did not finish"
        time.sleep(0.01)
    with pytest.raises(OSError, match="injected"):
        io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "good.ckpt")
    io.save_checkpoint({"w": torch.ones(10)}, tmp_path / "bad2.ckpt")
    with pytest.raises(OSError, match="injected"):
        io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["good.ckpt"]
    io.save_checkpoint({"w": torch.zeros(3)}, tmp_path / "after.ckpt")  # usable after teardown
    io.teardown()
    assert torch.equal(torch.load(tmp_path / "after.ckpt")["w"], torch.zeros(3))


def test_remove_waits_for_a_pending_save_and_removes_folders(tmp_path):
    io = DeepNVMeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(100_000)}, tmp_path / "x.ckpt")
    io.remove_checkpoint(tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"1")
    io.remove_checkpoint(tmp_path / "d")
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # nothing there: no error, as Lightning's
    io.teardown()
    assert os.listdir(tmp_path) == []


def test_synchronous_mode_and_argument_checks(tmp_path):
    io = DeepNVMeCheckpointIO(asynchronous=False)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "s.ckpt")
    assert torch.equal(torch.load(tmp_path / "s.ckpt")["w"], torch.ones(4))
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "t.ckpt", storage_options={"a": 1})
    with pytest.raises(ValueError, match="remote URL"):
        io.save_checkpoint({}, "s3://bucket/t.ckpt")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(ValueError, match="max_in_flight"):
        DeepNVMeCheckpointIO(max_in_flight=0)


def test_weights_only_default_follows_torch(tmp_path):
    torch.save({"f": _Net}, tmp_path / "code.ckpt")  # a class reference: refused by weights_only
    io = DeepNVMeCheckpointIO()
    with pytest.raises(Exception, match="weights_only"):
        io.load_checkpoint(tmp_path / "code.ckpt")
    assert io.load_checkpoint(tmp_path / "code.ckpt", weights_only=False)["f"] is _Net


def test_import_deepnvme_imports_no_framework():
    import subprocess

    code = ("import deepnvme, deepnvme.integrations, sys; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]", out.stderr


def test_pytorch_lightning_trainer_accepts_the_plugin(tmp_path, caplog):
    pl = pytest.importorskip("pytorch_lightning")
    caplog.set_level(logging.WARNING)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", plugins=[DeepNVMeCheckpointIO()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    assert isinstance(trainer.strategy.checkpoint_io, DeepNVMeCheckpointIO)
