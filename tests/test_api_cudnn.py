"""compiled_attn.cudnn_batch_prefill_with_kv_cache against a dense float64 oracle (CPU).

Paged (block_tables [B, max_pages] over [P, Hkv, page, D] caches, shuffled pages, unused table
entries poisoned with -1) and ragged K/V (batch offsets in element and token units), causal and
not, GQA, the padded LSE [B, max_token_per_sequence, Hq] in base 2, the CUDA-graph-compatible
mode (no host reads), fp8 K/V with scales, output dtypes, and bad inputs with the messages that
say how to fix them. Output buffers are poisoned with NaN before each call.
"""

from __future__ import annotations

import math

import pytest
import torch

import compiled_attn
from tests.helpers import assert_lse, dense_request, shuffled_block_table

fn = compiled_attn.cudnn_batch_prefill_with_kv_cache
WS = torch.empty(16, dtype=torch.uint8)


def _seqs(qo_lens, kv_lens, hq, hkv, dqk, dvo, dtype=torch.float64):
    qs = [torch.randn(n, hq, dqk, dtype=torch.float64).to(dtype) for n in qo_lens]
    ks = [torch.randn(n, hkv, dqk, dtype=torch.float64).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, hkv, dvo, dtype=torch.float64).to(dtype) for n in kv_lens]
    return qs, ks, vs


def _paged(ks, vs, page, max_pages, seed):
    """[P, Hkv, page, D] caches and a shuffled block table [B, max_pages] (-1 where unused)."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(ks)
    hkv, dqk, dvo = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2]
    total = bsz * max_pages + 2
    kc = torch.randn(total, hkv, page, dqk, dtype=torch.float64).to(ks[0].dtype)
    vc = torch.randn(total, hkv, page, dvo, dtype=torch.float64).to(vs[0].dtype)
    table = shuffled_block_table([k.shape[0] for k in ks], page, max_pages, total, g)
    for b, (k, v) in enumerate(zip(ks, vs)):
        for t in range(k.shape[0]):
            pg = int(table[b, t // page])
            kc[pg, :, t % page] = k[t]
            vc[pg, :, t % page] = v[t]
    return kc, vc, table


def _oracle(qs, ks, vs, scale, causal, v_scale=1.0):
    outs, lses = [], []
    for q, k, v in zip(qs, ks, vs):
        o, l = dense_request(q, k, v, sm_scale=scale, causal=causal, v_scale=v_scale)
        outs.append(o)
        lses.append(l)
    return outs, lses


def _check(out, lse, outs, lses, qo_lens, max_tok, tol_out=dict(rtol=1e-9, atol=1e-9),
           tol_lse=dict(rtol=1e-6, atol=1e-6)):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[: sum(qo_lens)].double(), torch.cat(outs), **tol_out)
    if lse is not None:
        assert lse.shape == (len(qo_lens), max_tok, out.shape[1])
        for b, n in enumerate(qo_lens):
            assert_lse(lse[b, :n], lses[b], tol_lse)
            assert torch.isneginf(lse[b, n:]).all()


def _lens(x, shape4=True):
    t = torch.tensor(x, dtype=torch.int32)
    return t.view(-1, 1, 1, 1) if shape4 else t


@pytest.mark.parametrize("page", [1, 5, 16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("graph", [False, True])
def test_paged(page, causal, graph):
    torch.manual_seed(page * 7 + causal * 3 + graph)
    qo_lens, kv_lens, hq, hkv, d = [5, 0, 3, 7], [9, 4, 17, 7], 4, 2, 16
    max_tok, max_kv = 8, 20
    max_pages = -(-max_kv // page)
    qs, ks, vs = _seqs(qo_lens, kv_lens, hq, hkv, d, d)
    kc, vc, table = _paged(ks, vs, page, max_pages, seed=page)
    q = torch.cat(qs)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=q.dtype)
    lse = torch.full((4, max_tok, hq), float("nan"))
    scale = 0.9 / math.sqrt(d)
    o, l = fn(q, kc, vc, scale, WS, max_token_per_sequence=max_tok, max_sequence_kv=max_kv,
              actual_seq_lens_q=_lens(qo_lens), actual_seq_lens_kv=_lens(kv_lens),
              block_tables=table, causal=causal, return_lse=True, out=out, lse=lse,
              is_cuda_graph_compatible=graph)
    assert o is out and l is lse
    _check(o, l, *_oracle(qs, ks, vs, scale, causal), qo_lens, max_tok)


@pytest.mark.parametrize("units", ["elements", "tokens"])
@pytest.mark.parametrize("graph", [False, True])
def test_ragged_with_offsets(units, graph):
    torch.manual_seed(11 + graph)
    qo_lens, kv_lens, hq, hkv, dqk, dvo = [4, 6, 1], [10, 6, 3], 6, 2, 24, 16
    qs, ks, vs = _seqs(qo_lens, kv_lens, hq, hkv, dqk, dvo)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    qi = torch.tensor([0, 4, 10, 11], dtype=torch.int32)
    ki = torch.tensor([0, 10, 16, 19], dtype=torch.int32)
    if units == "elements":
        offs = dict(batch_offsets_q=qi * hq * dqk, batch_offsets_o=qi * hq * dvo,
                    batch_offsets_k=ki * hkv * dqk, batch_offsets_v=ki * hkv * dvo)
    else:
        offs = dict(batch_offsets_q=qi, batch_offsets_k=ki)
    o, l = fn(q, k, v, 0.3, WS, max_token_per_sequence=6, max_sequence_kv=10,
              actual_seq_lens_q=_lens(qo_lens, False), actual_seq_lens_kv=_lens(kv_lens),
              causal=True, return_lse=True, batch_offsets_units=units,
              is_cuda_graph_compatible=graph, **offs)
    _check(o, l, *_oracle(qs, ks, vs, 0.3, True), qo_lens, 6)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_without_kv_offsets_reads_padded_rows(causal, graph):
    """Ragged K / V without batch_offsets_k / _v: request b's keys and values from row
    b * max_sequence_kv, as FlashInfer's cuDNN graph declares them ([B, Hkv, max_sequence_kv,
    D]); an empty request and a short one between full ones; rows between the requests hold
    NaN, which no request may read. (They were read packed: the later requests attended the
    wrong keys.)"""
    torch.manual_seed(13 + graph)
    qo_lens, kv_lens, hq, hkv, dqk, dvo, m = [3, 2, 4, 1], [5, 0, 12, 7], 6, 2, 16, 8, 12
    qs, ks, vs = _seqs(qo_lens, kv_lens, hq, hkv, dqk, dvo)
    k = torch.full((len(kv_lens) * m + 3, hkv, dqk), float("nan"), dtype=torch.float64)
    v = torch.full((len(kv_lens) * m + 3, hkv, dvo), float("nan"), dtype=torch.float64)
    for b, (kb, vb) in enumerate(zip(ks, vs)):
        k[b * m: b * m + kb.shape[0]], v[b * m: b * m + vb.shape[0]] = kb, vb
    qi = torch.tensor([0, 3, 5, 9, 10], dtype=torch.int32)
    o, l = fn(torch.cat(qs), k, v, 0.4, WS, max_token_per_sequence=4, max_sequence_kv=m,
              actual_seq_lens_q=_lens(qo_lens), actual_seq_lens_kv=_lens(kv_lens),
              causal=causal, return_lse=True, batch_offsets_q=qi * hq * dqk,
              batch_offsets_o=qi * hq * dvo, is_cuda_graph_compatible=graph)
    _check(o, l, *_oracle(qs, ks, vs, 0.4, causal), qo_lens, 4)


@pytest.mark.parametrize("over,exc,match", [
    (dict(k_cache=torch.randn(11, 2, 8, dtype=torch.float64)), ValueError,
     r"k_cache has 11 rows; without batch_offsets_k / batch_offsets_v request b's keys are "
     r"read from row b \* max_sequence_kv .* 2 requests need 12"),
    (dict(batch_offsets_k=torch.tensor([0, 6 * 16, 10 * 16])), NotImplementedError,
     "batch_offsets_k / batch_offsets_v given one without the other"),
    (dict(batch_offsets_v=torch.tensor([0, 6 * 16, 10 * 16])), NotImplementedError,
     "batch_offsets_k / batch_offsets_v given one without the other"),
])
def test_ragged_padded_rows_bad_inputs(over, exc, match):
    """Padded ragged K / V need B * max_sequence_kv rows; one of the two K / V offsets alone
    (K packed and V padded) is not implemented."""
    k = torch.randn(12, 2, 8, dtype=torch.float64)
    args = _base(block_tables=None, k_cache=k, v_cache=k.clone())
    args.update(over)
    args["v_cache"] = args["v_cache"][: args["k_cache"].shape[0]]
    with pytest.raises(exc, match=match):
        fn(**args)


def test_ragged_lengths_from_token_offsets_and_stats_offsets():
    """actual_seq_lens_* omitted (token indptrs give them); batch_offsets_stats puts the LSE
    packed by token: request b row i head h at offset[b] + i * Hq + h."""
    torch.manual_seed(12)
    qo_lens, kv_lens, hq, hkv, d = [3, 5], [3, 8], 2, 1, 8
    qs, ks, vs = _seqs(qo_lens, kv_lens, hq, hkv, d, d)
    qi, ki = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 11], dtype=torch.int32)
    o, l = fn(torch.cat(qs), torch.cat(ks), torch.cat(vs), 0.5, WS, max_token_per_sequence=5,
              max_sequence_kv=8, causal=False, return_lse=True, batch_offsets_q=qi,
              batch_offsets_k=ki, batch_offsets_stats=qi, batch_offsets_units="tokens")
    outs, lses = _oracle(qs, ks, vs, 0.5, False)
    torch.testing.assert_close(o.double(), torch.cat(outs))
    flat = l.reshape(-1)
    packed = flat[: 8 * hq].reshape(8, hq)
    assert_lse(packed, torch.cat(lses))
    assert torch.isneginf(flat[8 * hq:]).all()


def test_rows_past_the_requests_and_qo_gt_kv():
    """q holds more tokens than the requests use (out's rows there keep the caller's values,
    as FlashInfer writes only the requests' rows); a request with qo_len > kv_len under causal
    has rows that see nothing: output 0, LSE -inf."""
    torch.manual_seed(13)
    qo_lens, kv_lens, hq, hkv, d = [6, 2], [3, 5], 2, 2, 8
    qs, ks, vs = _seqs(qo_lens, kv_lens, hq, hkv, d, d)
    q = torch.cat(qs + [torch.randn(3, hq, d, dtype=torch.float64)])
    kc, vc, table = _paged(ks, vs, 4, 2, seed=3)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=torch.float64)
    out[8:] = 7.0
    o, l = fn(q, kc, vc, 0.4, WS, max_token_per_sequence=6, max_sequence_kv=5,
              actual_seq_lens_q=_lens(qo_lens), actual_seq_lens_kv=_lens(kv_lens),
              block_tables=table, causal=True, return_lse=True, out=out)
    outs, lses = _oracle(qs, ks, vs, 0.4, True)
    assert o is out
    _check(o, l, outs, lses, qo_lens, 6)
    assert (o[8:] == 7.0).all()
    assert torch.equal(o[:3], torch.zeros_like(o[:3])) and torch.isneginf(l[0, :3]).all()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_with_scales(fp8):
    torch.manual_seed(14)
    qo_lens, kv_lens, hq, hkv, d = [4, 3], [7, 9], 4, 2, 16
    qs, ks, vs = _seqs(qo_lens, kv_lens, hq, hkv, d, d)
    ks8, vs8 = [k.to(fp8) for k in ks], [v.to(fp8) for v in vs]
    kc, vc, table = _paged(ks8, vs8, 4, 3, seed=5)
    q = torch.cat(qs).half()
    ksc, vsc = torch.tensor([[[[0.7]]]]), torch.tensor([[[[1.6]]]])
    o, l = fn(q, kc, vc, d ** -0.5, WS, max_token_per_sequence=4, max_sequence_kv=9,
              actual_seq_lens_q=_lens(qo_lens), actual_seq_lens_kv=_lens(kv_lens),
              block_tables=table, causal=True, return_lse=True, k_scale=ksc, v_scale=vsc)
    assert o.dtype == torch.float16
    outs, lses = _oracle([x.half() for x in qs], [k.double() * 0.7 for k in ks8], vs8,
                         d ** -0.5, True, v_scale=1.6)
    _check(o, l, outs, lses, qo_lens, 4, tol_out=dict(rtol=1e-2, atol=1e-2),
           tol_lse=dict(rtol=1e-4, atol=1e-4))


def test_o_data_type_and_fp16():
    torch.manual_seed(15)
    qo_lens, kv_lens = [5, 2], [5, 6]
    qs, ks, vs = _seqs(qo_lens, kv_lens, 4, 4, 16, 16, dtype=torch.float16)
    kc, vc, table = _paged(ks, vs, 16, 1, seed=6)
    o, l = fn(torch.cat(qs), kc, vc, 0.25, WS, max_token_per_sequence=5, max_sequence_kv=6,
              actual_seq_lens_q=_lens(qo_lens), actual_seq_lens_kv=_lens(kv_lens),
              block_tables=table, causal=True, return_lse=False, o_data_type=torch.float32)
    assert l is None and o.dtype == torch.float32
    outs, _ = _oracle(qs, ks, vs, 0.25, True)
    torch.testing.assert_close(o.double(), torch.cat(outs), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------
def _base(**over):
    torch.manual_seed(16)
    q = torch.randn(5, 4, 8, dtype=torch.float64)
    kc = torch.randn(4, 2, 4, 8, dtype=torch.float64)
    args = dict(q=q, k_cache=kc, v_cache=kc.clone(), scale=0.3, workspace_buffer=WS,
                max_token_per_sequence=3, max_sequence_kv=6,
                actual_seq_lens_q=_lens([3, 2]), actual_seq_lens_kv=_lens([6, 4]),
                block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), causal=True,
                return_lse=True)
    args.update(over)
    return args


def test_base_case_runs():
    o, l = fn(**_base())
    assert not torch.isnan(o).any() and l.shape == (2, 3, 4)


@pytest.mark.parametrize("graph", [False, True])
def test_lse_base_ln(graph):
    """lse_base="ln": cuDNN's natural-log stats, the base-2 LSE times ln 2; the padding past a
    request's rows stays -inf."""
    o2, l2 = fn(**_base(is_cuda_graph_compatible=graph))
    on, ln = fn(**_base(is_cuda_graph_compatible=graph, lse_base="ln"))
    assert torch.equal(o2, on) and torch.isneginf(l2).any()
    torch.testing.assert_close(ln, l2 * math.log(2.0), rtol=1e-6, atol=0)
    assert torch.equal(torch.isneginf(ln), torch.isneginf(l2))


@pytest.mark.parametrize("over,exc,match", [
    (dict(max_token_per_sequence=2), ValueError, "max_token_per_sequence.*longest query"),
    (dict(max_sequence_kv=5), ValueError, "max_sequence_kv.*longest KV"),
    (dict(block_tables=torch.tensor([[0], [2]], dtype=torch.int32)), ValueError,
     "block_tables.*widen"),
    (dict(block_tables=torch.tensor([[0, 9], [2, -1]], dtype=torch.int32)), ValueError,
     "block_tables.*outside"),
    (dict(lse=torch.empty(2, 5, 4)), ValueError, r"lse.*\[2, 3, 4\]"),
    (dict(return_lse=False, lse=torch.empty(2, 3, 4)), ValueError, "return_lse=True"),
    (dict(backend="flash"), ValueError, "backend"),
    (dict(lse_base="e"), ValueError, "lse_base: got 'e'"),
    (dict(batch_offsets_units="bytes"), ValueError, "batch_offsets_units"),
    (dict(q=torch.randn(5, 3, 8, dtype=torch.float64)), ValueError, "not a multiple"),
    (dict(q=torch.randn(5, 4, 4, dtype=torch.float64)), ValueError, "head dim"),
    (dict(batch_offsets_q=torch.tensor([0, 4 * 8 * 4, 5 * 4 * 8], dtype=torch.int32)),
     NotImplementedError, "batch_offsets_q.*back to back"),
    (dict(batch_offsets_q=torch.tensor([0, 3], dtype=torch.int32), batch_offsets_units="tokens"),
     ValueError, "batch_offsets_q.*batch_size \\+ 1"),
    (dict(actual_seq_lens_q=None), ValueError, "actual_seq_lens_q.*missing"),
    (dict(out=torch.empty(5, 4, 7, dtype=torch.float64)), ValueError, "out.*pass a"),
    (dict(scale=torch.tensor(0.3)), ValueError, "scale.*float"),
    (dict(is_cuda_graph_compatible=True, k_scale=torch.tensor(0.5)), NotImplementedError,
     "k_scale.*host read"),
    (dict(actual_seq_lens_q=_lens([4, 2])), ValueError, "max_token_per_sequence"),
    # (an audit: a stats offset past the lse buffer gave that request an LSE of -inf; an lse
    # buffer on another device, and lengths or scales on the meta device, reached a copy)
    (dict(batch_offsets_stats=torch.tensor([0, 20, 32], dtype=torch.int32)), ValueError,
     r"batch_offsets_stats entry 1 \(20 elements\) puts request 1's 8 LSE values outside "
     "the lse buffer's 24 elements"),
    (dict(batch_offsets_stats=torch.tensor([-4, 12, 20], dtype=torch.int32)), ValueError,
     "batch_offsets_stats entry 0"),
    (dict(lse=torch.empty(2, 3, 4, device="meta")), ValueError, "lse is .* on meta"),
    (dict(actual_seq_lens_q=_lens([3, 2]).to("meta")), ValueError,
     "actual_seq_lens_q: is on the meta device"),
    (dict(actual_seq_lens_kv=_lens([6, 4]).to("meta")), ValueError,
     "actual_seq_lens_kv: is on the meta device"),
    (dict(q_scale=torch.tensor([1.0], device="meta")), ValueError,
     "q_scale: is on the meta device"),
    (dict(block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device="meta")),
     ValueError, "block_tables: is on the meta device"),
    (dict(batch_offsets_stats=torch.tensor([0, 12, 20], device="meta")), ValueError,
     "batch_offsets_stats: is on the meta device"),
    (dict(scale=1e39), ValueError, "scale: got 1e[+]?39, beyond float32's range"),
])
def test_bad_inputs(over, exc, match):
    with pytest.raises(exc, match=match):
        fn(**_base(**over))


@pytest.mark.parametrize("over,match", [
    (dict(block_tables=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
     r"block_tables holds page indices outside the cache's pages"),
    (dict(block_tables=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32),
          actual_seq_lens_kv=_lens([6, 5])), r"block_tables holds page indices outside"),
    (dict(block_tables=torch.tensor([[0], [2]], dtype=torch.int32)), "too few columns"),
    (dict(actual_seq_lens_kv=_lens([7, 4])), r"actual_seq_lens_kv must be in \[0, max_seq"),
    (dict(actual_seq_lens_kv=_lens([-1, 4])), r"actual_seq_lens_kv must be in"),
    (dict(actual_seq_lens_q=_lens([4, 1])), r"actual_seq_lens_q must be in \[0, max_token"),
    (dict(q=torch.randn(4, 4, 8, dtype=torch.float64)), "q has fewer tokens"),
    (dict(k_cache=torch.randn(7, 2, 8, dtype=torch.float64),
          v_cache=torch.randn(7, 2, 8, dtype=torch.float64), block_tables=None,
          batch_offsets_k=torch.tensor([0, 6, 10]), batch_offsets_units="tokens",
          batch_offsets_q=torch.tensor([0, 3, 5])),
     "k_cache has fewer tokens than sum"),
    (dict(batch_offsets_stats=torch.tensor([0, 20, 32], dtype=torch.int32)),
     r"batch_offsets_stats puts a request's LSE rows outside the lse buffer \(B \* "),
])
def test_graph_mode_checks_values_on_device(over, match):
    """is_cuda_graph_compatible reads no value on the host: what the eager call checks there
    (page indices, lengths against their bounds and the tensors) is asserted on the device."""
    with pytest.raises(ValueError):  # the eager call checks these on the host ...
        fn(**_base(**over))
    fn(**_base(is_cuda_graph_compatible=True))
    with pytest.raises(RuntimeError, match=match):  # ... the capturable one on the device
        fn(**_base(**over, is_cuda_graph_compatible=True))


def test_mixed_dtypes_raise():
    with pytest.raises(TypeError, match="k_cache: dtype torch.float64 differs from q's "
                                        "torch.float32"):
        fn(**_base(q=torch.randn(5, 4, 8)))
    kc = torch.randn(4, 2, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="k_cache / v_cache: dtypes torch.float64 and "
                                        "torch.float32 differ"):
        fn(**_base(k_cache=kc, v_cache=kc.float()))


@pytest.mark.parametrize("graph", [False, True])
def test_block_tables_wider_than_needed(graph):
    """Columns past a request's pages are never read, whatever they hold: -1, a page past the
    cache, int32 max (tables sized for the longest request an engine serves)."""
    o, l = fn(**_base(is_cuda_graph_compatible=graph))
    wide = torch.tensor([[0, 1, -1, 4, 2 ** 31 - 1], [2, 2 ** 31 - 1, 4, -1, -1]],
                        dtype=torch.int32)
    o2, l2 = fn(**_base(block_tables=wide, is_cuda_graph_compatible=graph))
    assert torch.equal(o2, o) and torch.equal(l2, l)


def test_stats_offsets_may_leave_gaps_inside_the_buffer():
    """Offsets inside the buffer are taken as given (request 1's rows after a gap), the
    unwritten entries stay -inf."""
    _, ref = fn(**_base())
    _, l = fn(**_base(batch_offsets_stats=torch.tensor([0, 16, 24], dtype=torch.int32)))
    flat, want = l.reshape(-1), ref.reshape(-1)
    assert torch.equal(flat[:12], want[:12]) and torch.equal(flat[16:24], want[12:20])
    assert torch.isneginf(flat[12:16]).all()


def test_graph_mode_checks_offsets_on_device():
    bad = torch.tensor([0, 2, 5], dtype=torch.int32)  # lengths are [3, 2]: cumsum [0, 3, 5]
    with pytest.raises(RuntimeError, match="batch_offsets_q"):
        fn(**_base(batch_offsets_q=bad, batch_offsets_units="tokens",
                   is_cuda_graph_compatible=True))


def test_compiled_default_call_takes_the_host_read_free_path():
    """torch.compile(fullgraph=True) of a call with is_cuda_graph_compatible=False (the
    default): traced, it takes the path without host reads (the lengths' host reads were
    data-dependent guards: the compile failed) and gives the eager numbers."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(8, 4, 16, generator=g, dtype=torch.float64)
    # (no K / V offsets: request b's keys from row b * max_sequence_kv, padded)
    k, v = (torch.randn(32, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    lq, lk = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([7, 9], dtype=torch.int32)

    def attend(q, k, v, lq, lk):
        return fn(q, k, v, 0.25, WS, max_token_per_sequence=8, max_sequence_kv=16,
                  actual_seq_lens_q=lq, actual_seq_lens_kv=lk, causal=True, return_lse=True)

    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True, backend="eager")(q, k, v, lq, lk)
    for a, b in zip(got, attend(q, k, v, lq, lk)):  # (every row of q is a request's)
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("form", ["padded", "paged_stats"])
def test_compiled_call_keeps_one_graph_over_batch_sizes(form):
    """torch.compile(dynamic=True, fullgraph=True) over batch sizes 3..5: one graph (the
    device checks' messages named the padded cache's page count and the stats buffer's size,
    each a guard: a graph per batch size), the eager numbers at each size; a tensor fp8 scale
    raises naming torch.compile (the advice named is_cuda_graph_compatible)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(22)
    pages = torch.randn(40, 2, 2, 4, 16, generator=g, dtype=torch.float64)  # [P, K|V, Hkv, page, D]

    def attend(q, k, v, lq, lk, so, bt):
        return fn(q, k, v, 0.25, WS, max_token_per_sequence=8, max_sequence_kv=16,
                  actual_seq_lens_q=lq, actual_seq_lens_kv=lk, causal=True, return_lse=True,
                  batch_offsets_stats=so, block_tables=bt)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="eager")
    # (no duck sizing: sizes that happen to be equal at the first trace are not tied)
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        _batches(compiled, attend, form, pages, g)
    assert counters["stats"]["unique_graphs"] == 1
    lq, lk = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([7, 9], dtype=torch.int32)
    q, bt = torch.randn(8, 4, 16, dtype=torch.float64), torch.arange(8).reshape(2, 4).int()
    scaled = torch.compile(lambda q, k, v, s: fn(
        q, k, v, 0.25, WS, max_token_per_sequence=8, max_sequence_kv=16, actual_seq_lens_q=lq,
        actual_seq_lens_kv=lk, causal=True, return_lse=False, k_scale=s, block_tables=bt),
        backend="eager")
    with pytest.raises(NotImplementedError, match="k_scale is a tensor.*torch.compile"):
        scaled(q, pages[:, 0], pages[:, 1], torch.tensor([0.5], dtype=torch.float64))


def _batches(compiled, attend, form, pages, g):
    """compiled against attend at batch sizes 3, 4, 5."""
    for b in (3, 4, 5):
        ql, kl = [3, 5, 2, 4, 1][:b], [7, 9, 4, 6, 2][:b]
        lq, lk = (torch.tensor(x, dtype=torch.int32) for x in (ql, kl))
        q = torch.randn(sum(ql), 4, 16, generator=g, dtype=torch.float64)
        if form == "padded":
            k, v = (torch.randn(16 * b, 2, 16, generator=g, dtype=torch.float64)
                    for _ in range(2))
            so = bt = None
        else:
            k, v, so = pages[:, 0], pages[:, 1], torch.tensor([0, *(lq.cumsum(0) * 4)],
                                                               dtype=torch.int32)
            bt = torch.randperm(40, generator=g)[:4 * b].reshape(b, 4).to(torch.int32)
        got, want = compiled(q, k, v, lq, lk, so, bt), attend(q, k, v, lq, lk, so, bt)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
