"""The head dims the kernel runs (ops.contracts.KERNEL_HEAD_DIMS: multiples of 8 from 16 to 256,
and 512) as every layer sees them: the API's validation on CUDA (and its message naming the
set), the tiles and launch configuration each dim gets, and the reference at those dims. The
kernel itself at these dims: tests/interpret/test_head_dims_interp.py (CPU) and
tests/test_head_dims_gpu.py."""

from __future__ import annotations

import pytest
import torch

from compiled_attn.ops import choose
import compiled_attn as fi
from compiled_attn import _validate as V
from compiled_attn.ops import contracts
from compiled_attn.ops import prefill_kernel as K

SUPPORTED = [*range(16, 257, 8), 512]


def test_kernel_head_dims_are_the_documented_set():
    assert sorted(contracts.KERNEL_HEAD_DIMS) == SUPPORTED


@pytest.mark.parametrize("d", SUPPORTED)
def test_every_supported_dim_validates_on_cuda(d):
    V.check_head_dims(d, d, "cuda")
    V.check_head_dims(d, 64, "cuda")  # D_qk and D_vo need not match


@pytest.mark.parametrize("d", [1, 8, 12, 36, 100, 257, 264, 384, 1024])
def test_unsupported_dim_names_the_argument_and_the_set(d):
    msg = rf"head_dim_qk = {d} has no kernel on the GPU.*multiple of 8 from 16 to 256, or 512"
    with pytest.raises(ValueError, match=msg):
        V.check_head_dims(d, 64, "cuda")
    with pytest.raises(ValueError, match=rf"head_dim_vo = {d} has no kernel"):
        V.check_head_dims(64, d, "cuda")
    V.check_head_dims(d, d, "cpu")  # the CPU reference takes any head dim


@pytest.mark.parametrize("d", [80, 96, 112])
def test_padded_dims_take_their_power_of_twos_tiles(d):
    # A dim between powers of two runs the tiles of the next one (the same work per tile).
    for kv in (None, 512, 1024, 4096, 8192):
        for causal in (True, False):
            assert choose.tile(d, d, 2, kv, causal) == choose.tile(128, 128, 2, kv, causal)
    for bm in (64, 128, 256):
        for mask in (contracts.MASK_CAUSAL, contracts.MASK_CUSTOM):
            assert choose.config(bm, d, d, 1, mask) == choose.config(bm, 128, 128, 1, mask)
    assert K._dims(d, d, False) == dict(BLOCK_DQK=128, BLOCK_DVO=128, DQK=d, DVO=d)


def test_head_dim_512_tiles_fit_shared_memory():
    # 64-row tiles, 32-key K / V tiles two deep, pointer loads (no descriptor: a TMA box is at
    # most 256 elements wide): Q 64 KB + 2 x (K + V) 128 KB at most of an H100's 227 KB.
    for kv in (None, 64, 8192):
        for paged in (False, True):
            assert choose.tile(512, 512, 4, kv, True, paged, page_size=16 if paged else 0) == 64
    for mask in (contracts.MASK_NONE, contracts.MASK_CAUSAL, contracts.MASK_CUSTOM):
        cfg = choose.config(64, 512, 512, 1, mask)
        assert cfg == dict(BLOCK_N=32, num_warps=8, num_stages=2, TMA=False)
        smem = 64 * 512 * 2 + cfg["num_stages"] * 2 * cfg["BLOCK_N"] * 512 * 2
        assert smem <= 227 * 1024


def test_rope_half_tiles_are_dot_deep():
    # RoPE splits q / k into halves, each a dot operand: at least 16 lanes (D 16 and 24 pad).
    assert K._dims(16, 16, True)["BLOCK_DQK"] == 32
    assert K._dims(24, 24, True)["BLOCK_DQK"] == 32
    assert K._dims(16, 16, False)["BLOCK_DQK"] == 16
    assert K._dims(80, 80, True) == dict(BLOCK_DQK=128, BLOCK_DVO=128, DQK=80, DVO=80)


def test_launch_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match=r"D_qk = 100 has no kernel.*multiple of 8"):
        K._dims(100, 100, False)
    with pytest.raises(ValueError, match=r"D_vo = 520 has no kernel"):
        K._dims(512, 520, False)


@pytest.mark.parametrize("d", [80, 96, 112, 160])
def test_rope_reference_at_odd_half_dims(d):
    # The reference's rotation pairs (c, c + D/2) with angle pos * theta^(-2c/D): the kernel's
    # rule at every dim, checked here against the complex-number form.
    from compiled_attn.ops.reference import rope_llama

    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, d, generator=g, dtype=torch.float64)
    pos = torch.arange(5) * 3
    half = d // 2
    freq = 1e4 ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    z = torch.complex(x[:, :half], x[:, half:]) * torch.polar(torch.ones(5, half,
                                                                         dtype=torch.float64),
                                                              pos[:, None] * freq[None])
    want = torch.cat([z.real, z.imag], -1)
    got = rope_llama(x[:, None], pos, 1.0, 1e4)[:, 0]  # [N, H, D] with one head
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_wrapper_plans_every_head_dim_on_cpu():
    # On CPU the wrappers plan and run any dim (the reference); 80 against SDPA.
    g = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4, 80, generator=g)
    k = torch.randn(9, 2, 80, generator=g)
    v = torch.randn(9, 2, 80, generator=g)
    out = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.ones(7, 9, dtype=torch.bool).tril(9 - 7)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask)
    torch.testing.assert_close(out, want.transpose(0, 1), rtol=1e-5, atol=1e-5)
