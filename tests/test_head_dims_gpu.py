"""GPU tier of the head dims that are not 64 / 128 / 256 (pytest -m gpu, on the H100): D 80, 96,
112 and 160 (Triton tiles padded to the next power of two, loads and stores masked on the real
dim) and 512 (64-row tiles of 32-key K / V), in bf16 against the float64 reference with the
project's bound (tests/kernel_cases.check: twice PyTorch's own error in the same dtype plus a
rounding term; NaN never passes; outputs poisoned before each run).

Most cases keep q / k / v in NaN-padded buffers (kernel_cases.make_padded_case): the lanes past
the head dim hold NaN in memory and the rows keep a 16-byte aligned stride, so tensor
descriptors are used and must read zeros past the dim, and pointer loads must stay inside it."""

import pytest
import torch

import compiled_attn
from compiled_attn import ops
from compiled_attn.ops.schedule import build_split_work
from tests.kernel_cases import (check, check_pod, force_kv_path, make_case, make_padded_case,
                                params, record_tma)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16
DIMS = [80, 96, 112, 160, 512]
# (qo_lens, kv_lens): odd lengths, a request without queries and one without keys, qo < kv,
# a request longer than several tiles.
QO, KV = [300, 17, 0, 129, 5], [700, 17, 5, 129, 0]


def _case(kind, d, *, padded=True, hq=8, hkv=2, dtype=BF16, page_size=16, seed=0, **kw):
    qo, kv = ([577], [1100]) if kind == "single" else (QO, KV)
    make = make_padded_case if padded else make_case
    return make(kind, qo, kv, hq, hkv, d, dtype=dtype, device="cuda", page_size=page_size,
                seed=seed + d, **kw)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("kind,page", [("single", 0), ("ragged", 0), ("paged", 16),
                                       ("paged", 1)],
                         ids=["single", "ragged", "paged16", "paged1"])
@pytest.mark.parametrize("d", DIMS)
def test_head_dims(d, kind, page, causal):
    # GQA 4:1; the default launch path for each (Triton kernel: no Gluon tile at these dims).
    c = _case(kind, d, page_size=page or 16, seed=page)
    check(c, params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE, head_dim=d))


@pytest.mark.parametrize("d", DIMS)
def test_contiguous_layout(d):
    # The usual layout (rows of exactly d elements, no gap): ragged and paged.
    for kind in ("ragged", "paged"):
        check(_case(kind, d, padded=False, seed=1), params(head_dim=d))


@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("d", DIMS)
def test_split_kv(d, kind):
    # Few query rows against long keys: key chunks write float32 partials of the padded width,
    # _merge_fwd stores the real dim (sinks and v_scale applied there).
    qo, kv = [3, 1, 40, 0, 2], [3000, 970, 2600, 5, 1]
    c = make_padded_case(kind, qo, kv, 8, 2, d, dtype=BF16, device="cuda", page_size=16,
                         sinks=True, seed=d + 7)
    c.work, c.merge = build_split_work(qo, kv, 4, c.block_m, 2, "cuda", num_sms=132,
                                       min_keys_per_chunk=128)
    assert c.merge is not None and int(c.merge[:, 3].max()) > 1
    check(c, params(head_dim=d, v_scale=0.5))


@pytest.mark.parametrize("path", ["host", "persistent", "device", "pointers"])
@pytest.mark.parametrize("kind", ["single", "ragged"])
@pytest.mark.parametrize("d", [80, 96, 112])
def test_kv_load_paths(d, kind, path, monkeypatch):
    # Dense and ragged K / V at D <= 128 may go through tensor descriptors (their shape has the
    # real dim: a box past it reads zeros, not the NaN lanes beside it); every path forced.
    tma = force_kv_path(monkeypatch, path)
    seen = record_tma(monkeypatch)
    c = _case(kind, d, seed=3)
    check(c, params(head_dim=d))
    assert seen == [tma]


@pytest.mark.parametrize("d", [80, 96, 160])
def test_rope(d):
    # In-kernel RoPE: the halves start at d / 2 (40, 48, 80), not at the padded tile's half.
    c = _case("paged", d, seed=4)
    check(c, params(pos_encoding_mode=ops.POS_ROPE_LLAMA, rope_scale=2.0, rope_theta=5e5,
                    head_dim=d))


@pytest.mark.parametrize("d", [96, 512])
def test_options_gqa7_fp16(d):
    # GQA 7:1 in fp16, with window, soft cap, ALiBi, custom mask.
    for i, p in enumerate([params(window_left=63, head_dim=d),
                           params(logits_soft_cap=30.0, head_dim=d),
                           params(pos_encoding_mode=ops.POS_ALIBI, head_dim=d),
                           params(mask_mode=ops.MASK_CUSTOM, head_dim=d)]):
        c = _case("ragged", d, hq=14, hkv=2, dtype=torch.float16, seed=10 + i,
                  alibi=p["pos_encoding_mode"] == ops.POS_ALIBI,
                  custom_mask=p["mask_mode"] == ops.MASK_CUSTOM)
        check(c, p)


def test_dqk_ne_dvo():
    for dqk, dvo in ((96, 64), (512, 80)):
        c = make_padded_case("ragged", QO, KV, 8, 2, dqk, dvo, dtype=BF16, device="cuda",
                             seed=dqk + dvo)
        check(c, params(head_dim=dqk))


@pytest.mark.parametrize("d", [96, 512])
def test_pod(d):
    # POD's prefill and decode parts in one launch at these dims (its per-part tiles halve
    # BLOCK_N and stages: both loops share one kernel's shared memory).
    pre = make_padded_case("paged", [300, 0, 129], [700, 6, 129], 8, 2, d, dtype=BF16,
                           device="cuda", page_size=16, seed=21)
    dec = make_padded_case("paged", [1] * 6, [900, 1, 33, 0, 17, 2049], 8, 2, d, dtype=BF16,
                           device="cuda", page_size=16, seed=22)
    check_pod(pre, dec, params(head_dim=d), params(mask_mode=ops.MASK_NONE, head_dim=d))


@pytest.mark.parametrize("d", [96, 512])
def test_paged_wrapper(d):
    # The public wrapper plans these dims on CUDA and runs them; its plan may split long keys.
    c = _case("paged", d, padded=False, seed=5)
    w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
    w.plan(c.qo_indptr.cpu(), c.kv_indptr.cpu(), c.page_indices.cpu(), c.last_page_len.cpu(),
           8, 2, d, 16, causal=True, q_data_type=BF16)
    check(c, params(head_dim=d), runner=lambda c, p, o: w.run(c.q, (c.k, c.v), return_lse=True))


def test_unsupported_head_dim_names_the_set():
    w = compiled_attn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1, device="cuda"))
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"head_dim_qk = 100 has no kernel.*multiple of 8 "
                                         r"from 16 to 256, or 512"):
        w.plan(indptr, indptr, 2, 2, 100)
    q = torch.randn(4, 2, 36, device="cuda", dtype=BF16)
    with pytest.raises(ValueError, match=r"D_qk = 36 has no kernel"):
        compiled_attn.single_prefill_with_kv_cache(q, q, q)


def test_fx_rewrite_and_hf_attention():
    # The FX rewrite replaces SDPA at D 80 with the op and leaves D 264 (no kernel) as written;
    # the transformers attention function runs D 96 (Phi-3-mini's). D 36 (no kernel either) was
    # rewritten on the H200 (torch 2.11): torch's CUDA SDPA pads a head dim to a multiple of 8
    # before the pass sees it, so the op may run D 40; either way the result is checked.
    from compiled_attn import fx_passes, hf

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=True)

    def bhsd(d, seed):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(2, h, 200, d, generator=g).to("cuda", BF16)
                     for h in (8, 2, 2))

    def bound_check(out, args):
        # against float64 SDPA, within twice bf16 SDPA's own error plus a rounding term
        want = Sdpa()(*(a.double() for a in args))
        torch_err = (Sdpa()(*args).double() - want).abs().max().item()
        err = (out.double() - want).abs().max().item()
        assert not torch.isnan(out).any()
        eps = torch.finfo(BF16).eps
        assert err <= 2 * torch_err + eps * want.abs().max().item(), (err, torch_err)

    for d, rewritten in ((80, True), (264, False), (36, None)):
        args = bhsd(d, d)
        torch._dynamo.reset()
        fx_passes.counters.clear()
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            out = compiled_attn.compile(Sdpa(), fullgraph=True)(*args)
        c = dict(fx_passes.counters)
        if rewritten is not None:
            assert c.get("rewritten", 0) == int(rewritten), c
        # (torch 2.11 on the H200 lowers D 264 SDPA with GQA to its math form, which the pass
        # leaves as unmatched; the head-dim skip itself is pinned under the interpreter:
        # tests/interpret/test_head_dims_interp.py)
        bound_check(out, args)

    class Module(torch.nn.Module):
        is_causal = True

    args = bhsd(96, 5)
    out, _ = hf.attention_forward(Module(), *args, None)
    bound_check(out.transpose(1, 2), args)
