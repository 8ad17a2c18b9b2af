"""deepnvme.integrations.transformers.Trainer: checkpoints, rotation and resume against transformers' Trainer."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

from deepnvme.integrations import transformers as dn_transformers  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (32, 12), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _trainer(cls, out, max_steps):
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, save_total_limit=2,
                                          per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True,
                                          report_to=[], logging_steps=100, seed=0, disable_tqdm=True,
                                          dataloader_num_workers=0)
    return cls(model=_model(), args=args, train_dataset=_Tokens())


def _weights(folder):
    return safetensors_torch.load_file(os.path.join(folder, "model.safetensors"))


def _written_by_deepnvme(path):
    with open(path, "rb") as f:
        return (8 + int.from_bytes(f.read(8), "little")) % 4096 == 0


@pytest.mark.slow
def test_checkpoints_rotate_and_resume_both_ways(tmp_path):
    trainer = _trainer(dn_transformers.Trainer, tmp_path / "ours", 6)
    trainer.train()
    ours = tmp_path / "ours"
    assert sorted(os.listdir(ours)) == ["checkpoint-4", "checkpoint-6"]  # save_total_limit=2
    ck4, ck6 = ours / "checkpoint-4", ours / "checkpoint-6"
    assert _written_by_deepnvme(ck4 / "model.safetensors")
    assert {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= set(os.listdir(ck4))
    assert torch.load(ck4 / "optimizer.pt", weights_only=True)["state"]  # plain torch.load reads it
    final = _weights(ck6)

    # transformers' own Trainer resumes from our checkpoint-4 and lands on our checkpoint-6
    theirs = _trainer(transformers.Trainer, tmp_path / "theirs", 6)
    theirs.train(resume_from_checkpoint=str(ck4))
    resumed = _weights(tmp_path / "theirs" / "checkpoint-6")
    assert not _written_by_deepnvme(tmp_path / "theirs" / "checkpoint-6" / "model.safetensors")
    assert final.keys() == resumed.keys() and all(torch.equal(final[k], resumed[k]) for k in final)

    # ours resumes from theirs (transformers wrote checkpoint-6 there) and from its own newest
    again = _trainer(dn_transformers.Trainer, tmp_path / "theirs", 8)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 8
    assert sorted(os.listdir(tmp_path / "theirs")) == ["checkpoint-6", "checkpoint-8"]


def test_resume_restores_the_exact_state(tmp_path, monkeypatch):
    from deepnvme.integrations import _hf_trainer

    calls = []
    for name in ("load_into", "load"):
        real = getattr(_hf_trainer, name)
        monkeypatch.setattr(_hf_trainer, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    full = _trainer(dn_transformers.Trainer, tmp_path / "full", 4)
    full.train()
    half = _trainer(dn_transformers.Trainer, tmp_path / "half", 4)
    half.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert calls.count("load_into") == 1 and calls.count("load") == 2  # model, optimizer, scheduler
    a, b = _weights(tmp_path / "full" / "checkpoint-4"), _weights(tmp_path / "half" / "checkpoint-4")
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(tmp_path / "full" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    sb = torch.load(tmp_path / "half" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert all(torch.equal(sa["state"][i]["exp_avg"], sb["state"][i]["exp_avg"]) for i in sa["state"])
