"""Pure group quantisation of streamed weights: error bounds, int4 packing, group boundaries, choices."""

import pytest
import torch
from torch import nn

from deepnvme.inference._quant import (
    SCALE_SUFFIX,
    QuantSetting,
    code_nbytes,
    dequantize,
    encode,
    matrix_shape,
    pack_int4,
    packed_entries,
    plan_quantized,
    quantize,
    resolve_setting,
    scale_nbytes,
    split_bindings,
    unpack_int4,
)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [4, 32, 5])
def test_round_trip_error_is_at_most_half_a_step_per_group(mode, group_size):
    torch.manual_seed(0)
    w = torch.randn(6, group_size * 4) * torch.logspace(-3, 1, 6)[:, None]   # rows of very different size
    setting = QuantSetting(mode, group_size)
    data, scales = encode(w, setting, torch.float32)
    assert data.dtype == torch.uint8 and data.numel() == code_nbytes(mode, 6, group_size * 4, group_size)
    assert scales.numel() == 6 * 4
    back = dequantize(data, scales, (6, group_size * 4), mode=mode, group_size=group_size)
    step = scales.repeat_interleave(group_size).view_as(w)
    err = (back - w).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-12)
    # the scale is the group's max magnitude over qmax: the largest element is hit exactly
    amax = w.abs().view(-1, group_size).amax(1)
    assert torch.allclose(scales, amax / setting.qmax)


def test_bf16_scales_bound_the_error_with_the_rounded_scale():
    torch.manual_seed(1)
    w = (torch.randn(8, 256) * 0.02).to(torch.bfloat16)
    for mode, qmax in (("int8", 127), ("int4", 7)):
        data, scales = encode(w, QuantSetting(mode, 64), torch.bfloat16)
        assert scales.dtype == torch.bfloat16
        back = dequantize(data, scales, (8, 256), mode=mode, group_size=64)
        assert back.dtype == torch.bfloat16
        step = scales.float().repeat_interleave(64).view(8, 256)
        # half a step of quantisation (plus the clamp when the scale rounded down) and bf16 rounding
        bound = step * 0.5 + step * qmax * 2 ** -8 + w.float().abs() * 2 ** -8
        assert torch.all((back.float() - w.float()).abs() <= bound)


def test_groups_do_not_share_scales_across_boundaries():
    w = torch.zeros(2, 8)
    w[0, :4] = 1e-3
    w[0, 4:] = 100.0
    w[1, 3] = -7.0
    codes, scales = quantize(w, QuantSetting("int4", 4), torch.float32)
    assert scales.tolist() == pytest.approx([1e-3 / 7, 100 / 7, 1.0, 0.0])
    assert codes[0].tolist() == [7, 7, 7, 7, 7, 7, 7, 7]
    assert codes[1].tolist() == [0, 0, 0, -7, 0, 0, 0, 0]
    back = dequantize(*encode(w, QuantSetting("int4", 4), torch.float32), (2, 8), mode="int4", group_size=4)
    assert torch.allclose(back, w, rtol=1e-6)    # each group's values are exact multiples of its scale


def test_zero_groups_give_zero_codes_and_no_nan():
    codes, scales = quantize(torch.zeros(3, 6), QuantSetting("int8", 3), torch.bfloat16)
    assert not codes.any() and not scales.any()
    back = dequantize(*encode(torch.zeros(3, 6), QuantSetting("int8", 3), torch.bfloat16), (3, 6),
                      mode="int8", group_size=3)
    assert torch.equal(back, torch.zeros(3, 6, dtype=torch.bfloat16))


@pytest.mark.parametrize("group_size", [1, 2, 3, 7, 8])
def test_int4_packing_of_odd_and_even_counts(group_size):
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(group_size * 2)[: group_size * 5]
    packed = pack_int4(codes, group_size)
    assert packed.dtype == torch.uint8 and packed.numel() == 5 * ((group_size + 1) // 2)
    assert torch.equal(unpack_int4(packed, group_size).reshape(-1), codes)


def test_int4_byte_layout_pairs_the_two_halves_of_a_group():
    codes = torch.tensor([1, 2, -3, -8, 7], dtype=torch.int8)   # one group of 5: halves [1, 2, -3] and [-8, 7]
    assert pack_int4(codes, 5).tolist() == [1 | (8 << 4), 2 | (7 << 4), 0xD]   # -8 -> 0x8, -3 -> 0xD, pad 0


def test_setting_checks_and_defaults():
    assert resolve_setting(None, None) is None
    assert resolve_setting("int4", None) == QuantSetting("int4", 128)
    assert QuantSetting("int8", 64).record(torch.bfloat16) == {"quantize": "int8", "group_size": 64,
                                                               "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="quantize must be one of"):
        resolve_setting("int3", None)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        resolve_setting("int8", 0)
    with pytest.raises(ValueError, match="applies only with quantize"):
        resolve_setting(None, 64)


class _Conv1D(nn.Module):   # transformers' GPT-2 layer, by name: weight (in, out)
    def __init__(self, nin: int, nout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nin, nout))
        self.bias = nn.Parameter(torch.zeros(nout))


_Conv1D.__name__ = "Conv1D"


def test_only_linear_weights_are_quantised_and_group_size_errors_name_the_tensor():
    lin, conv, norm = nn.Linear(64, 32), _Conv1D(48, 16), nn.LayerNorm(64)
    assert matrix_shape(lin, "weight", lin.weight) == (32, 64, False)
    assert matrix_shape(conv, "weight", conv.weight) == (16, 48, True)
    assert matrix_shape(lin, "bias", lin.bias) is None and matrix_shape(norm, "weight", norm.weight) is None
    emb = nn.Embedding(10, 64)
    groups = [("b.lin.weight", lin.weight, [(lin, "weight")]), ("b.lin.bias", lin.bias, [(lin, "bias")]),
              ("b.conv.weight", conv.weight, [(conv, "weight")]), ("b.emb.weight", emb.weight, [(emb, "weight")]),
              ("b.shared", lin.weight, [(lin, "weight"), (emb, "weight")])]
    assert plan_quantized(groups, QuantSetting("int8", 16)) == {"b.lin.weight": (32, 64, False),
                                                                "b.conv.weight": (16, 48, True)}
    assert plan_quantized(groups, None) == {}
    with pytest.raises(ValueError, match=r"group_size 32 does not divide the input dimension 48 of "
                                         r"b\.conv\.weight \(shape \(48, 16\)\)"):
        plan_quantized(groups, QuantSetting("int4", 32))


def test_packed_entries_and_bindings_of_a_transposed_weight():
    torch.manual_seed(2)
    w = torch.randn(12, 8)                           # Conv1D (in=12, out=8): quantised as its (8, 12) transpose
    calls = []

    def produce():
        calls.append(1)
        return w

    setting = QuantSetting("int4", 6)
    entries = packed_entries("c.weight", w.numel() * 4, produce, (8, 12, True), setting, torch.float32)
    assert [(k, n) for k, n, _ in entries] == [("c.weight", 8 * 2 * 3), ("c.weight" + SCALE_SUFFIX, 16 * 4)]
    assert scale_nbytes(8, 12, 6, torch.float32) == 64
    data, scales = entries[0][2](), entries[1][2]()
    assert len(calls) == 1                            # quantised once for both entries
    back = dequantize(data, scales, (8, 12), mode="int4", group_size=6).t()
    assert torch.allclose(back, w, atol=float(w.abs().max()) / 7 / 2 + 1e-6)
    param = nn.Parameter(torch.empty(12, 8))
    plain, quant = split_bindings([("c.weight", param)], {"c.weight": 0, "c.weight" + SCALE_SUFFIX: 64},
                                  {"c.weight": (8, 12, True)}, setting)
    assert plain == [] and quant[0].transposed and quant[0].code_nbytes == 48 and quant[0].scale_count == 16
    with pytest.raises(ValueError, match="holds no scales for c.weight"):
        split_bindings([("c.weight", param)], {"c.weight": 0}, {"c.weight": (8, 12, True)}, setting)
    assert packed_entries("n", 4, produce, None, setting, torch.float32)[0][:2] == ("n", 4)
