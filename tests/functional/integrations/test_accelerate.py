"""deepnvme.integrations.accelerate with a real Accelerator on CPU."""

import random

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
np = pytest.importorskip("numpy")
safetensors_torch = pytest.importorskip("safetensors.torch")

from deepnvme.integrations import accelerate as dn_accelerate  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: stored once in model.safetensors

    def forward(self, x):
        return self.head(torch.relu(self.body(self.emb(x))))


def _setup():
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _train(acc, model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randint(0, 50, (8, 4))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


def _snapshot(model, opt, sched):
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: ({n: clone(x) for n, x in s.items()}) for k, s in opt.state_dict()["state"].items()},
            sched.state_dict())


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def _draws():
    return torch.rand(4), random.random(), np.random.rand()


def _save_train_load(tmp_path, save_acc_installed, load_acc_installed):
    acc, model, opt, sched = _setup()
    if save_acc_installed:
        dn_accelerate.install(acc)
    _train(acc, model, opt, sched, 3)
    acc.save_state(tmp_path)
    saved = _snapshot(model, opt, sched)
    after = _draws()
    _train(acc, model, opt, sched, 3)  # moves everything on, RNG included
    assert not _equal(saved[0], _snapshot(model, opt, sched)[0])
    if load_acc_installed != save_acc_installed:
        (dn_accelerate.install if load_acc_installed else dn_accelerate.uninstall)(acc)
    acc.load_state(tmp_path)
    restored = _snapshot(model, opt, sched)
    for a, b in zip(saved, restored):
        assert _equal(a, b)
    assert model.head.weight is model.emb.weight  # the tie survives the in-place load
    draws = _draws()
    assert torch.equal(draws[0], after[0]) and draws[1:] == after[1:]
    return acc


def _written_by_deepnvme(path):
    with open(path, "rb") as f:  # deepnvme pads the safetensors header to a 4096-byte boundary
        return (8 + int.from_bytes(f.read(8), "little")) % 4096 == 0


def test_save_and_load_state_through_deepnvme(tmp_path, monkeypatch):
    calls = []
    for name in ("save_safetensors", "save", "load_into", "load"):
        real = getattr(dn_accelerate, name)
        monkeypatch.setattr(dn_accelerate, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    _save_train_load(tmp_path, True, True)
    assert {"save_safetensors", "save", "load_into", "load"} <= set(calls)
    assert _written_by_deepnvme(tmp_path / "model.safetensors")
    assert "head.weight" not in safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert torch.load(tmp_path / "optimizer.bin", weights_only=True)["state"]  # a torch.save file
    assert accelerate.checkpointing.save.__module__ == "accelerate.utils.other"  # swapped back afterwards


def test_plain_accelerator_reads_ours_and_we_read_theirs(tmp_path):
    _save_train_load(tmp_path / "a", True, False)
    _save_train_load(tmp_path / "b", False, True)
    assert not _written_by_deepnvme(tmp_path / "b" / "model.safetensors")


def test_install_is_idempotent_and_checks_its_argument():
    acc = accelerate.Accelerator(cpu=True)
    assert dn_accelerate.install(acc) is acc
    wrapped = acc.save_state
    dn_accelerate.install(acc)
    assert acc.save_state is wrapped
    dn_accelerate.uninstall(acc)
    assert acc.save_state.__func__ is accelerate.Accelerator.save_state
    with pytest.raises(TypeError, match="Accelerator"):
        dn_accelerate.install(object())
