"""Pinned, hand-computed FLOP counts and the dense peak table (analysis/flops.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from analysis.flops import (
    PEAK_FLOPS,
    UnknownDevice,
    UnknownDtype,
    flops_breakdown,
    hardware_flops,
    mfu,
    num_floating_point_operations,
    pad_vocab_size,
    peak_flops,
    tflops_per_gpu,
)

# h=8, s=4, L=2, 2 query heads of d=4, 1 KV group (GQA), SwiGLU ffn=16, padded vocab 16.
SMALL = SimpleNamespace(
    num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
    kv_channels=None, seq_length=4, vocab_size=16, swiglu=True, num_experts=None,
    moe_router_topk=2, moe_ffn_hidden_size=None,
)


def test_small_config_hand_expansion():
    # Per token and layer (q = 8, kv = 4):
    #   attn_proj = 3*2*(h*(q + 2kv) + q*h) = 6*(8*16 + 64) = 1152
    #   attn_core = 3*2*(q*s/2*2)           = 6*32          = 192   (causal)
    #   mlp       = 3*2*h*ffn*3             = 6*8*16*3      = 2304  (SwiGLU: 3 matrices)
    # logits per token = 3*2*h*V = 6*8*16 = 768; tokens = 3 sequences * 4 = 12
    parts = flops_breakdown(SMALL, 3, padded_vocab_size=16)
    assert parts == {"attn_proj": 1152 * 2 * 12, "attn_core": 192 * 2 * 12, "mlp": 2304 * 2 * 12,
                     "mtp": 0.0, "logits": 768 * 12}
    assert num_floating_point_operations(SMALL, 3, padded_vocab_size=16) == 96768
    # full attention square (pre core 0.12): core term doubles
    assert num_floating_point_operations(SMALL, 3, causal=False, padded_vocab_size=16) == 96768 + 4608


def test_full_attention_matches_megatrons_older_12x_formula():
    # Megatron core 0.7 (training.py): 12*B*s*L*h^2*((1 + g/n + s/h)*q/h + ffn/h*1.5 + V/(2*L*h))
    B, s, L, h, n, g, ffn, V = 3, 4, 2, 8, 2, 1, 16, 16
    old = 12 * B * s * L * h * h * ((1 + g / n + s / h) * 1 + ffn / h * 1.5 + V / (2 * L * h))
    assert num_floating_point_operations(SMALL, 3, causal=False, padded_vocab_size=16) == old


def test_gelu_has_two_mlp_matrices_swiglu_three():
    gelu = SimpleNamespace(**{**vars(SMALL), "swiglu": False})
    assert flops_breakdown(gelu, 1, padded_vocab_size=16)["mlp"] * 3 == (
        flops_breakdown(SMALL, 1, padded_vocab_size=16)["mlp"] * 2
    )


def test_recompute_hand_values():
    base = 96768
    assert hardware_flops(SMALL, 3, padded_vocab_size=16) == base
    # selective: one more forward of the core attention = 192*2*12/3
    assert hardware_flops(SMALL, 3, recompute="selective", padded_vocab_size=16) == base + 1536
    # full: one more forward of every layer = (1152+192+2304)*2*12/3
    assert hardware_flops(SMALL, 3, recompute="full", padded_vocab_size=16) == base + 29184
    with pytest.raises(ValueError, match="recompute"):
        hardware_flops(SMALL, 3, recompute="sometimes")


GPT3 = dict(num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
            seq_length=2048, vocab_size=50257, swiglu=False)


def test_gpt3_175b_against_narayanan_2021_and_6NT():
    B, s, l, h = 1536, 2048, 96, 12288
    V = pad_vocab_size(50257, 128, 1)
    assert V == 50304
    # Narayanan et al. 2021 (arXiv:2104.04473) appendix, full recompute, full attention:
    # 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))
    paper = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    got = hardware_flops(GPT3, B, recompute="full", causal=False)
    assert math.isclose(got, paper, rel_tol=1e-12)
    # 6*N*T sanity: N = 12*l*h^2 (layers) + V*h (embedding); model flops with causal attention
    # exceed 6NT only by the attention square, s/(12h) ~ 1.4% here.
    N = 12 * l * h * h + V * h
    ratio = num_floating_point_operations(GPT3, B) / (6 * N * B * s)
    assert 1.0 < ratio < 1.03


def test_moe_routed_and_mtp_terms():
    moe = dict(vars(SMALL), num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4,
               moe_shared_expert_intermediate_size=8, moe_layer_freq=[1, 0], mtp_num_layers=1)
    parts = flops_breakdown(moe, 1, padded_vocab_size=16)
    tokens = 4
    # layer 0 MoE: routed 4*2 + shared 8; layer 1 dense 16; MTP copies the last (dense) layer
    assert parts["mlp"] == 6 * 8 * (4 * 2 * 3 + 8 * 3 + 16 * 3 * 2) * tokens
    assert parts["attn_proj"] == 1152 * 3 * tokens  # 2 layers + 1 MTP layer
    assert parts["mtp"] == 6 * (3 * 8 + 2 * 64) * tokens
    assert parts["logits"] == 768 * 2 * tokens


def test_vocab_padding_follows_tp_and_mapping_input():
    d = dict(vars(SMALL), vocab_size=50257)
    assert flops_breakdown(d, 1, tp=4)["logits"] == 6 * 8 * pad_vocab_size(50257, 128, 4) * 4
    assert pad_vocab_size(50257, 128, 4) == 50688


def test_missing_required_field_is_an_error():
    with pytest.raises(ValueError, match="hidden_size"):
        num_floating_point_operations({"num_layers": 2}, 1)


def test_dense_peaks_not_sparse():
    assert peak_flops("a100", "bf16") == 312e12
    assert peak_flops("h100_sxm", "bf16") == 989e12
    assert peak_flops("H100-SXM", "bfloat16") == 989e12
    assert peak_flops("h100_pcie", "bf16") == 756e12
    assert peak_flops("h200", "bf16") == 989e12
    assert peak_flops("mi300x", "bf16") == pytest.approx(1307.4e12)
    assert peak_flops("b200", "fp8") == 4500e12
    for dev in ("a100", "h100_sxm", "h100_pcie", "h200", "b200", "mi300x"):
        for dt in ("bf16", "fp16", "tf32"):
            assert peak_flops(dev, dt) > 0
        assert peak_flops(dev, "tf32") < peak_flops(dev, "bf16")
    for dev in ("h100_sxm", "h100_pcie", "h200", "b200", "mi300x"):
        assert peak_flops(dev, "fp8") == pytest.approx(2 * peak_flops(dev, "bf16"), rel=1e-3)


def test_unknown_device_is_an_error_listing_known_ones():
    with pytest.raises(UnknownDevice, match="h100_sxm") as e:
        peak_flops("h100", "bf16")  # ambiguous: SXM or PCIe?
    assert isinstance(e.value, KeyError)
    with pytest.raises(KeyError):
        peak_flops("cpu", "bf16")
    with pytest.raises(UnknownDtype, match="fp8"):
        peak_flops("a100", "fp8")
    assert set(PEAK_FLOPS) >= {"a100", "h100_sxm", "h100_pcie", "h200", "b200", "mi300x"}


def test_mfu_and_tflops():
    # 989e12 FLOPs over 8 GPUs in 2 s -> 61.8125 TFLOP/s/GPU -> MFU 6.25% on H100 SXM
    assert tflops_per_gpu(989e12, 2.0, 8) == pytest.approx(61.8125)
    assert mfu(989e12, 2.0, 8, "h100_sxm", "bf16") == pytest.approx(0.0625)
    with pytest.raises(ValueError):
        tflops_per_gpu(1.0, 0.0, 8)
