"""register_external_parameter: a module whose forward uses a parameter another module owns
(a head computed with the embedding's weight in the root's forward) trains bitwise like memory
once registered; unregistered, it sees the placeholder; bad calls are clear errors."""

import copy

import pytest
import torch
from torch import nn

import deepnvme
from deepnvme import OffloadMemoryError
from deepnvme.offload import offload_parameters, register_external_parameter

VOCAB, DIM = 64, 32


class RootHead(nn.Module):
    """The output projection is the embedding's weight, used in the root's own forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, 64)
        self.l2 = nn.Linear(64, DIM)

    def forward(self, x):
        h = self.l2(torch.relu(self.l1(self.emb(x))))
        return nn.functional.linear(h, self.emb.weight)


def data(n):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (4, 6), generator=g), torch.randint(0, VOCAB, (4, 6), generator=g))
            for _ in range(n)]


def step(model, opt, x, y):
    opt.zero_grad()
    out = model(x)
    nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt.step()
    return out.detach()


def pair():
    torch.manual_seed(0)
    a = RootHead()
    return a, copy.deepcopy(a)


# 8 KiB embedding, 8.3-8.4 KB linears: the budget holds any two (and one update: a parameter
# and its gradient), so reading l2 evicts the embedding before the root's forward uses it
BUDGET = 20_000


def test_registered_external_parameter_trains_bitwise_like_memory(tmp_path):
    a, b = pair()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    off = offload_parameters(b, tmp_path / "p", max_in_memory_bytes=BUDGET, min_offload_bytes=0)
    register_external_parameter(b, b.emb.weight)
    register_external_parameter(b, b.emb.weight)   # twice is once
    opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=tmp_path / "s",
                                 sub_group_bytes=8_500, lr=1e-2)
    for x, y in data(4):
        assert torch.equal(step(a, ref, x, y), step(b, opt, x, y))
    for name, value in a.state_dict().items():
        assert torch.equal(value, off.state_dict()[name]), name
    assert off.stats().peak_bytes <= BUDGET + 8192   # plus the one gradient just produced
    off.close()
    opt.close()


def test_an_unregistered_external_parameter_holds_the_placeholder(tmp_path):
    _, b = pair()
    with offload_parameters(b, tmp_path, max_in_memory_bytes=BUDGET, min_offload_bytes=0):
        with torch.no_grad():
            out = b(data(1)[0][0])
    assert torch.isnan(out).all()   # why the registration exists: the NaN placeholder shows it


class Head(nn.Module):
    """Owns no parameter: projects with a weight it borrows from the embedding."""

    def __init__(self, emb):
        super().__init__()
        self.borrowed = [emb]   # a plain list: not a submodule

    def forward(self, h):
        return nn.functional.linear(h, self.borrowed[0].weight)


class ChildHead(RootHead):
    def __init__(self):
        super().__init__()
        self.head = Head(self.emb)

    def forward(self, x):
        return self.head(self.l2(torch.relu(self.l1(self.emb(x)))))


def test_registration_on_a_child_module_without_parameters(tmp_path):
    torch.manual_seed(0)
    a = ChildHead()
    b = copy.deepcopy(a)
    x, _ = data(1)[0]
    with offload_parameters(b, tmp_path, max_in_memory_bytes=BUDGET, min_offload_bytes=0) as off:
        with torch.no_grad():
            assert torch.isnan(b(x)).all()
        off.register_external_parameter(b.head, b.head.borrowed[0].weight)
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
        out = b(x)
        out.sum().backward()   # the backward finds the borrowed weight too
        a(x).sum().backward()
        assert torch.equal(off.gradient("emb.weight"), a.emb.weight.grad)


def test_bad_registrations_are_clear_errors(tmp_path):
    _, b = pair()
    stranger = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not offloaded"):
        register_external_parameter(b, stranger.weight)
    with offload_parameters(b, tmp_path, max_in_memory_bytes=BUDGET, min_offload_bytes=0) as off:
        with pytest.raises(ValueError, match="not one of the offloaded model's"):
            off.register_external_parameter(b, stranger.weight)
        with pytest.raises(ValueError, match="not part of the offloaded model"):
            off.register_external_parameter(stranger, b.emb.weight)
        with pytest.raises(OffloadMemoryError, match="'l1' would need 16640 bytes .* emb.weight"):
            off._store.budget = 16_000   # l1 (8448 B) and the embedding (8192 B) no longer fit
            off.register_external_parameter(b.l1, b.emb.weight)
