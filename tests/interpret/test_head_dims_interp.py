"""Head dims that are not a power of two (and 512) in the Triton kernel, run on CPU tensors by
the Triton interpreter against the float64 reference (tests/kernel_cases.py): the kernel pads
its tiles to a power of two and masks every load and store on the real dim. Each case keeps the
lanes past the real dim NaN in memory (q, k, v and the caches are views into wider NaN-filled
buffers), so a load that reads past the dim, or a store that writes past it, shows up."""

import pytest
import torch

from compiled_attn import ops
from compiled_attn.ops import contracts
from compiled_attn.ops.schedule import build_split_work
from tests.kernel_cases import (check, check_pod, force_kv_path, make_case, make_padded_case,
                                params, record_tma, run)

BATCH = ([5, 0, 70, 3, 9], [9, 4, 70, 0, 4])  # odd lengths, empty requests, qo > kv


@pytest.mark.parametrize("d", [80, 96, 112, 160])
@pytest.mark.parametrize("kind", ["single", "ragged", "paged"])
def test_head_dims(kind, d):
    qo, kv = ([37], [50]) if kind == "single" else BATCH
    c = make_padded_case(kind, qo, kv, 4, 2, d, page_size=5, seed=d)
    check(c, params(head_dim=d))


@pytest.mark.parametrize("mode", ["none", "rope", "soft_cap_alibi", "custom", "sinks"])
def test_head_dim_96_options(mode):
    # The logit transforms and masks at a padded dim; RoPE rotates pairs (c, c + D/2) of the
    # real dim (its halves start at 48 here, not at the tile's 64).
    p = {"none": params(mask_mode=ops.MASK_NONE, head_dim=96),
         "rope": params(pos_encoding_mode=ops.POS_ROPE_LLAMA, rope_scale=2.0, rope_theta=500.0,
                        head_dim=96),
         "soft_cap_alibi": params(logits_soft_cap=2.0, sm_scale=0.5,
                                  pos_encoding_mode=ops.POS_ALIBI),
         "custom": params(mask_mode=ops.MASK_CUSTOM, head_dim=96),
         "sinks": params(v_scale=0.5, head_dim=96)}[mode]
    c = make_padded_case("paged", *BATCH, 4, 2, 96, page_size=16, custom_mask=mode == "custom",
                         alibi=mode == "soft_cap_alibi", sinks=mode == "sinks", seed=7)
    check(c, p)


@pytest.mark.parametrize("d", [16, 24, 80])
@pytest.mark.parametrize("kind", ["ragged", "single"])
def test_rope_head_dims(kind, d):
    # In-kernel RoPE at dims whose halves (8, 12, 40) are not a power of two or are narrower
    # than a dot's depth (16): the half tiles are padded and masked.
    qo, kv = ([20], [33]) if kind == "single" else ([9, 20], [30, 20])
    c = make_padded_case(kind, qo, kv, 2, 1, d, seed=d + 1)
    check(c, params(pos_encoding_mode=ops.POS_ROPE_LLAMA, rope_theta=1e4, head_dim=d))


def test_dqk_ne_dvo_padded_fp32():
    c = make_padded_case("ragged", [13, 30], [20, 45], 6, 2, 96, 40, dtype=torch.float32,
                         seed=3)
    check(c, params(head_dim=96))


@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("d", [80, 160])
def test_split_kv(d, kind):
    # Split-KV partials hold the padded tile's width; the merge stores the real dim only.
    qo, kv = [3, 1, 40, 0, 2], [300, 97, 260, 5, 1]
    c = make_padded_case(kind, qo, kv, 4, 2, d, page_size=16, sinks=True, seed=31)
    c.work, c.merge = build_split_work(qo, kv, 2, c.block_m, 2, num_sms=32, min_keys_per_chunk=64)
    assert c.merge is not None and int(c.merge[:, 3].max()) > 2
    check(c, params(head_dim=d))


@pytest.mark.parametrize("path", ["host", "persistent", "device", "pointers"])
@pytest.mark.parametrize("kind", ["ragged", "single"])
def test_kv_load_paths(kind, path, monkeypatch):
    # Descriptors describe K / V with their real dim: a box past it reads zeros, never the
    # NaN lanes beside it. Every path gives the reference's numbers.
    tma = force_kv_path(monkeypatch, path)
    seen = record_tma(monkeypatch)
    qo, kv = ([37], [50]) if kind == "single" else BATCH
    c = make_padded_case(kind, qo, kv, 4, 2, 112, seed=41)
    check(c, params(head_dim=112))
    assert seen == [tma]


@pytest.mark.parametrize("kind", ["single", "ragged", "paged", "split"])
def test_head_dim_512(kind):
    qo, kv = ([9], [40]) if kind == "single" else ([9, 0, 3], [40, 7, 70])
    c = make_padded_case("ragged" if kind == "split" else kind, qo, kv, 2, 1, 512,
                         page_size=16, seed=5)
    if kind == "split":
        c.work, c.merge = build_split_work(qo, kv, 2, c.block_m, 1, num_sms=16,
                                           min_keys_per_chunk=32)
        assert c.merge is not None
    check(c, params(head_dim=512))


def test_pod_head_dim_80():
    # POD's prefill and decode parts at a padded dim, in one launch; each part checked against
    # its reference (the launch runs inside the prefill part's check, after its poisoning).
    pre = make_padded_case("paged", [19, 0, 40], [30, 6, 40], 4, 2, 80, page_size=5, seed=21)
    dec = make_padded_case("paged", [1] * 4, [9, 1, 33, 17], 4, 2, 80, page_size=16,
                           seed=22)
    check_pod(pre, dec, params(head_dim=80), params(mask_mode=ops.MASK_NONE, sm_scale=0.3))


@pytest.mark.parametrize("dqk,dvo,bad", [(36, 36, "D_qk = 36"), (64, 520, "D_vo = 520"),
                                          (8, 8, "D_qk = 8"), (264, 264, "D_qk = 264")])
def test_unsupported_head_dim_names_the_set(dqk, dvo, bad):
    c = make_case("ragged", [3], [5], hq=1, hkv=1, dqk=dqk, dvo=dvo, seed=1)
    with pytest.raises(ValueError, match=rf"{bad} has no kernel.*multiple of 8 from 16 to 256, "
                                         r"or 512"):
        run(c, params(head_dim=dqk))
    assert contracts._use_kernel(c.q)  # the kernel, not the reference, refused


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)


def _bhsd(d, seed, hq=4, hkv=2, s=20):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, hq, s, d, generator=g), torch.randn(2, hkv, s, d, generator=g),
            torch.randn(2, hkv, s, d, generator=g))


def test_fx_rewrite_takes_padded_dims_and_skips_others():
    # The FX rewrite replaces SDPA at D 80 with the op (here the kernel, interpreted), and
    # leaves a site at D 36, which no kernel runs, as written (counted with its reason).
    import compiled_attn
    from compiled_attn import fx_passes

    for d, rewritten in ((80, True), (36, False)):
        args = _bhsd(d, seed=d)
        with torch.no_grad():
            want = _Sdpa()(*args)
            fx_passes.counters.clear()
            ep = compiled_attn.export(_Sdpa().eval(), args)
            got = ep.module()(*args)
        c = dict(fx_passes.counters)
        ops_in = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        has_op = torch.ops.compiled_attn.single_prefill.default in ops_in
        assert has_op == rewritten and c.get("rewritten", 0) == int(rewritten), c
        if not rewritten:
            assert c.get(f"skipped:head dims ({d}, {d}) have no kernel on cpu") == 1, c
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_hf_attention_takes_padded_dims_and_names_the_set_otherwise():
    # The transformers attention function at D 96 (Phi-3-mini's) runs the kernel; at D 36 it
    # raises naming the supported set and the way out.
    from compiled_attn import hf

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = _bhsd(96, seed=5)
    out, _ = hf.attention_forward(Module(), q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=2e-5, atol=2e-5)
    q, k, v = _bhsd(36, seed=6)
    with pytest.raises(ValueError, match=r"head dim \(query.shape\[-1\]\) = 36 has no kernel.*"
                                         r"multiple of 8 from 16 to 256, or 512.*sdpa"):
        hf.attention_forward(Module(), q, k, v, None)


def test_wrapper_plan_names_the_set():
    # Under the interpreter the wrappers run the kernel on CPU: plan() refuses its head dims
    # as it does on CUDA.
    import compiled_attn as fi

    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    indptr = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"head_dim_qk = 100 has no kernel"):
        w.plan(indptr, indptr, 2, 2, 100)
    w.plan(indptr, indptr, 2, 2, 80, causal=True)
    q, k, v = (torch.randn(4, 2, 80, dtype=torch.float16) for _ in range(3))
    torch.full((4, 2, 80), float("nan"), dtype=torch.float16)  # poison freed memory
    out = w.run(q, k, v)

    def sdpa(dt):
        t = [x.transpose(0, 1).to(dt) for x in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True) \
            .transpose(0, 1).double()

    want = sdpa(torch.float64)
    err, torch_err = ((x - want).abs().max().item() for x in (out.double(), sdpa(torch.float16)))
    assert err <= 2 * torch_err + torch.finfo(torch.float16).eps * want.abs().max().item(), \
        (err, torch_err)
