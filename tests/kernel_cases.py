"""Shared case builders and the error bound for the kernel tests (interpreter and GPU tiers).

A case is a batch of requests with given query and key lengths, laid out ragged or paged (page
size, NHD/HND, 5-D or tuple cache, shuffled pages). ``run`` calls the op under test,
``check`` compares it with the float64 reference and bounds the error by PyTorch's own error in
the same dtype (the reference with low-precision matrix products, as eager attention computes),
twice that plus a rounding term. NaN never passes; outputs are poisoned before each run by the
caller passing ``poison=True``.

A builder module, like tests/helpers.py (which holds the API tests' oracle and inputs): test
modules and dev/gpu_memcheck.py import from here; no test module imports another.
"""

from __future__ import annotations

import dataclasses

import torch

from compiled_attn.ops import choose
from compiled_attn import ops
from compiled_attn.ops import reference
from compiled_attn.ops.schedule import block_m_for, build_work


@dataclasses.dataclass
class Case:
    kind: str  # "single" | "ragged" | "paged"
    q: torch.Tensor
    k: torch.Tensor  # single [1, Skv, Hkv, D] / ragged [Nk, Hkv, D] / paged cache [P, page, Hkv, D]
    v: torch.Tensor
    qo_indptr: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None  # ragged: tokens; paged: pages
    page_indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None
    work: torch.Tensor | None = None
    block_m: int = 0
    packed_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    alibi: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    merge: torch.Tensor | None = None  # split-KV merge rows (work then has 4 columns)


def _indptr(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """Little-endian packbits of a flat bool tensor (independent of the API's packbits)."""
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.to(torch.uint8)
    weights = (2 ** torch.arange(8, device=bits.device)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(1).to(torch.uint8)


def make_case(kind, qo_lens, kv_lens, hq, hkv, dqk, dvo=None, *, dtype=torch.float16,
              kv_dtype=None, device="cpu", page_size=16, layout="NHD", tuple_cache=False,
              custom_mask=False, alibi=False, sinks=False, seed=0) -> Case:
    """Fresh random inputs (never zeros) for a batch of requests."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dvo = dvo or dqk
    kv_dtype = kv_dtype or dtype

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    nq = sum(qo_lens)
    c = Case(kind, q=rnd(nq, hq, dqk), k=None, v=None)
    if kind == "single":
        (sq,), (skv,) = qo_lens, kv_lens
        c.q = c.q.reshape(1, sq, hq, dqk)
        if layout == "HND":
            c.k = rnd(1, hkv, skv, dqk, dt=kv_dtype).transpose(1, 2)
            c.v = rnd(1, hkv, skv, dvo, dt=kv_dtype).transpose(1, 2)
        else:
            c.k, c.v = rnd(1, skv, hkv, dqk, dt=kv_dtype), rnd(1, skv, hkv, dvo, dt=kv_dtype)
    else:
        c.qo_indptr = _indptr(qo_lens, device)
        group = hq // hkv
        c.block_m = block_m_for(dqk, dvo, group)
        c.work = build_work(qo_lens, group, c.block_m, device, kv_lens=kv_lens)
    if kind == "ragged":
        nk = sum(kv_lens)
        c.kv_indptr = _indptr(kv_lens, device)
        if layout == "HND":
            c.k = rnd(hkv, nk, dqk, dt=kv_dtype).transpose(0, 1)
            c.v = rnd(hkv, nk, dvo, dt=kv_dtype).transpose(0, 1)
        else:
            c.k, c.v = rnd(nk, hkv, dqk, dt=kv_dtype), rnd(nk, hkv, dvo, dt=kv_dtype)
    elif kind == "paged":
        npages = [(n + page_size - 1) // page_size for n in kv_lens]
        c.kv_indptr = _indptr(npages, device)
        c.last_page_len = torch.tensor([(n - 1) % page_size + 1 if n else 1 for n in kv_lens],
                                       dtype=torch.int32, device=device)
        total = sum(npages) + 3  # a few unused pages
        c.page_indices = torch.randperm(total, generator=g)[: sum(npages)].to(torch.int32).to(device)
        assert dvo == dqk or tuple_cache, "a 5-D cache needs D_qk == D_vo"
        if tuple_cache:
            shape_k = (total, hkv, page_size, dqk) if layout == "HND" else (total, page_size, hkv, dqk)
            shape_v = shape_k[:-1] + (dvo,)
            kc, vc = rnd(*shape_k, dt=kv_dtype), rnd(*shape_v, dt=kv_dtype)
        else:
            shape = (total, 2, hkv, page_size, dqk) if layout == "HND" else (total, 2, page_size, hkv, dqk)
            cache = rnd(*shape, dt=kv_dtype)
            kc, vc = cache[:, 0], cache[:, 1]
        if layout == "HND":
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        c.k, c.v = kc, vc
    if custom_mask:
        segs = [_pack(torch.rand(a * b, generator=g) < 0.7) for a, b in zip(qo_lens, kv_lens)]
        if kind == "single":
            c.packed_mask = segs[0].to(device)
        else:
            c.mask_indptr = _indptr([s.numel() for s in segs], device)
            c.packed_mask = torch.cat(segs).to(device)
    if alibi:
        c.alibi = (torch.rand(hq, generator=g) * 0.5 + 0.05).to(device)
    if sinks:
        c.sinks = torch.randn(hq, generator=g).to(device)
    return c


def nan_padded(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose last dim is followed by NaN lanes in memory (row stride the
    next power of two, or twice the dim for a power of two): a kernel that reads or writes past
    the head dim shows up."""
    d = t.shape[-1]
    wide = 1 << (d - 1).bit_length()
    wide = wide if wide > d else 2 * d
    buf = torch.full((*t.shape[:-1], wide), float("nan"), dtype=t.dtype, device=t.device)
    buf[..., :d] = t
    return buf[..., :d]


def make_padded_case(kind, qo_lens, kv_lens, hq, hkv, dqk, dvo=None, **kw) -> Case:
    """make_case with q, k and v (paged: the 5-D cache) NaN-padded past their head dims."""
    c = make_case(kind, qo_lens, kv_lens, hq, hkv, dqk, dvo, **kw)
    if kind == "paged" and not kw.get("tuple_cache"):
        both = nan_padded(torch.stack([c.k, c.v], 1))  # one [P, 2, ...] buffer, as the cache
        c.k, c.v = both[:, 0], both[:, 1]
    else:
        c.k, c.v = nan_padded(c.k), nan_padded(c.v)
    c.q = nan_padded(c.q)
    return c


def move_past_2_31(c: Case) -> None:
    """Move paged case c's pages to the end of a combined [P, 2, page, Hkv, D] cache of more
    than 2^31 elements (so every key offset is past 2^31), the slots no request owns NaN; c's
    k / v views and page table then point into it (about 8.6 GB at bf16: the gpu_solo tests)."""
    page, hkv, d = c.k.shape[1:]
    pages = 2 ** 31 // (page * hkv * d) + 64
    cache = torch.full((pages, 2, page, hkv, d), float("nan"), dtype=c.k.dtype, device=c.k.device)
    used = c.page_indices.long()
    idx = torch.arange(pages - used.numel(), pages, device=c.k.device).flip(0)
    cache[idx, 0], cache[idx, 1] = c.k[used], c.v[used]
    c.k, c.v, c.page_indices = cache[:, 0], cache[:, 1], idx.to(torch.int32)
    assert c.k.shape[0] * c.k.stride(0) >= 2 ** 31  # the K view's span (launch()'s WIDE)


def params(mask_mode=ops.MASK_CAUSAL, window_left=-1, chunk_size=0, sm_scale=None,
           logits_soft_cap=0.0, pos_encoding_mode=ops.POS_NONE, rope_scale=1.0,
           rope_theta=1e4, v_scale=1.0, head_dim=64):
    return dict(mask_mode=mask_mode, window_left=window_left, chunk_size=chunk_size,
                sm_scale=sm_scale if sm_scale is not None else head_dim ** -0.5,
                logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                rope_scale=rope_scale, rope_theta=rope_theta, v_scale=v_scale)


def run(c: Case, p: dict, out_dtype=None):
    """The op under test (torch.ops.compiled_attn.*)."""
    args = (p["mask_mode"], p["window_left"], p["chunk_size"], p["sm_scale"],
            p["logits_soft_cap"], p["pos_encoding_mode"], p["rope_scale"], p["rope_theta"],
            p["v_scale"], out_dtype)
    if c.kind == "single":
        return ops.single_prefill(c.q, c.k, c.v, c.packed_mask, c.alibi, c.sinks, *args)
    if c.kind == "ragged":
        return ops.batch_ragged_prefill(c.q, c.k, c.v, c.qo_indptr, c.kv_indptr, c.work,
                                        c.packed_mask, c.mask_indptr, c.alibi, c.sinks,
                                        c.block_m, *args, merge=c.merge)
    return ops.batch_paged_prefill(c.q, c.k, c.v, c.qo_indptr, c.kv_indptr, c.page_indices,
                                   c.last_page_len, c.work, c.packed_mask, c.mask_indptr,
                                   c.alibi, c.sinks, c.block_m, *args, merge=c.merge)


def split_requests(c: Case) -> list[Case]:
    """One single-request case per request of a batch case (host reads: tests only), so that
    the dense reference never builds a (all rows x all keys) score matrix for big batches."""
    qi = c.qo_indptr.tolist()
    ki = c.kv_indptr.tolist()
    mi = c.mask_indptr.tolist() if c.mask_indptr is not None else None
    dev = c.q.device
    subs = []
    for b in range(len(qi) - 1):
        s = dataclasses.replace(c, q=c.q[qi[b]:qi[b + 1]],
                                qo_indptr=torch.tensor([0, qi[b + 1] - qi[b]], dtype=torch.int32,
                                                       device=dev))
        nk = torch.tensor([0, ki[b + 1] - ki[b]], dtype=torch.int32, device=dev)
        if c.kind == "ragged":
            s.k, s.v, s.kv_indptr = c.k[ki[b]:ki[b + 1]], c.v[ki[b]:ki[b + 1]], nk
        else:
            s.kv_indptr, s.page_indices = nk, c.page_indices[ki[b]:ki[b + 1]]
            s.last_page_len = c.last_page_len[b:b + 1]
        if mi is not None:
            s.packed_mask = c.packed_mask[mi[b]:mi[b + 1]]
            s.mask_indptr = torch.tensor([0, mi[b + 1] - mi[b]], dtype=torch.int32, device=dev)
        subs.append(s)
    return subs


def ref(c: Case, p: dict, compute=torch.float64, matmul_dtype=None):
    """The reference on the same inputs, upcast to ``compute`` (float64 oracle, or float32 with
    low-precision matrix products for PyTorch's own error)."""
    nk = c.k.shape[0] * (c.k.shape[1] if c.kind == "paged" else 1)
    if c.kind != "single" and c.q.shape[0] * nk > 4_000_000 and c.qo_indptr.numel() > 2:
        parts = [ref(s, p, compute, matmul_dtype) for s in split_requests(c)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    up = lambda t: None if t is None else t.to(compute)  # noqa: E731
    kw = dict(out_dtype=compute, matmul_dtype=matmul_dtype, **p)
    if c.kind == "single":
        return reference.single_prefill(up(c.q), up(c.k), up(c.v), c.packed_mask, c.alibi,
                                        c.sinks, **kw)
    if c.kind == "ragged":
        return reference.batch_ragged_prefill(up(c.q), up(c.k), up(c.v), c.qo_indptr,
                                              c.kv_indptr, c.packed_mask, c.mask_indptr,
                                              c.alibi, c.sinks, **kw)
    return reference.batch_paged_prefill(up(c.q), up(c.k), up(c.v), c.qo_indptr, c.kv_indptr,
                                         c.page_indices, c.last_page_len, c.packed_mask,
                                         c.mask_indptr, c.alibi, c.sinks, **kw)


def poison(c: Case, out_dtype=None):
    """Fill (and free) blocks of the output sizes with NaN so that the caching allocator hands
    the op poisoned memory: an element the kernel forgets to write shows up as NaN."""
    nq = c.q.shape[0] * (c.q.shape[1] if c.kind == "single" else 1)
    for _ in range(2):
        torch.full((nq, c.q.shape[-2], c.v.shape[-1]), float("nan"),
                   dtype=out_dtype or c.q.dtype, device=c.q.device)
        torch.full((nq, c.q.shape[-2]), float("nan"), device=c.q.device)


def check(c: Case, p: dict, out_dtype=None, runner=None) -> dict:
    """Run the op (or ``runner(c, p, out_dtype)``, another launcher of the same contract) and
    assert its error is within the bound. Returns the measured errors. A runner may return
    lse None (an API call without return_lse): then only the output is checked."""
    poison(c, out_dtype)
    out, lse = (runner or run)(c, p, out_dtype)
    r_out, r_lse = ref(c, p)
    dt = c.q.dtype
    lowp = dt if dt in (torch.float16, torch.bfloat16) else None
    t_out, t_lse = ref(c, p, compute=torch.float32, matmul_dtype=lowp)
    t_out = t_out.to(out.dtype)
    assert out.shape == r_out.shape, (out.shape, r_out.shape)
    assert not torch.isnan(out).any(), "NaN in the output"
    fin = torch.isfinite(r_lse)
    if lse is not None:
        assert lse.shape == r_lse.shape, (lse.shape, r_lse.shape)
        assert not torch.isnan(lse).any(), "NaN in the LSE"
        assert torch.equal(torch.isfinite(lse), fin), "rows that see no key differ from the ref"
        assert torch.all(lse[~fin] == float("-inf"))
    assert torch.all(out[~fin] == 0), "a row that sees no key must be exactly 0"
    o64, t64 = out.to(torch.float64), t_out.to(torch.float64)
    err = (o64 - r_out).abs().max().item() if out.numel() else 0.0
    terr = (t64 - r_out).abs().max().item() if out.numel() else 0.0
    eps = torch.finfo(out.dtype).eps
    scale = r_out.abs().max().item() if out.numel() else 0.0
    bound = 2 * terr + eps * scale + 1e-6
    has_lse = lse is not None and bool(fin.any())
    lerr = (lse[fin].double() - r_lse[fin]).abs().max().item() if has_lse else 0.0
    lterr = (t_lse[fin].double() - r_lse[fin]).abs().max().item() if fin.any() else 0.0
    lbound = 2 * lterr + 1e-4 * max(1.0, r_lse[fin].abs().max().item() if fin.any() else 1.0)
    assert err <= bound, f"output error {err:.3g} > bound {bound:.3g} (torch's own {terr:.3g})"
    assert lerr <= lbound, f"LSE error {lerr:.3g} > bound {lbound:.3g} (torch's own {lterr:.3g})"
    return dict(err=err, torch_err=terr, ratio=err / max(terr, 1e-12), lse_err=lerr)


def check_parts(pre: Case, dec: Case, p_pre: dict, p_dec: dict, launch) -> None:
    """Check one launch that computes two cases, pre (the prefill part) and dec (the decode
    part): launch() returns (out_pre, lse_pre, out_dec, lse_dec) (an lse None where not asked
    for), each part checked against its reference as ``check`` does with params p_pre / p_dec
    (the launch runs inside the prefill part's check, after its poisoning)."""
    outs = []

    def both(c, p, out_dtype):
        outs.extend(launch())
        return outs[0], outs[1]

    check(pre, p_pre, runner=both)
    check(dec, p_dec, runner=lambda c, p, out_dtype: (outs[2], outs[3]))


def one_page_prefill(qo_len, kv_len, hq, hkv, dqk=128, *, dtype=torch.bfloat16, device="cuda",
                     seed=0) -> Case:
    """A paged case holding one request whose keys are one page of kv_len keys: the contiguous
    k_p / v_p [kv_len, Hkv, D] that PODWithPagedKVCacheWrapper passes as a one-page cache."""
    c = make_case("ragged", [qo_len], [kv_len], hq, hkv, dqk, dtype=dtype, device=device,
                  seed=seed)
    c.kind = "paged"
    c.k, c.v = c.k.unsqueeze(0), c.v.unsqueeze(0)
    dev = c.q.device
    c.kv_indptr = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    c.page_indices = torch.zeros(1, dtype=torch.int32, device=dev)
    c.last_page_len = torch.tensor([kv_len], dtype=torch.int32, device=dev)
    return c


def retile(c: Case, block_m: int, qo_lens, kv_lens, group: int) -> Case:
    """c with its work list rebuilt for tiles of block_m packed rows (the lengths it was made
    with); returns c."""
    c.block_m = block_m
    c.work = build_work(qo_lens, group, block_m, c.q.device, kv_lens=kv_lens)
    return c


def pod_decodes(kv_lens, hq, hkv, page, dqk=128, *, dtype=torch.bfloat16, device="cuda",
                seed=0) -> Case:
    """A paged batch of one-row requests (POD's decode part) with kv_lens keys each."""
    return make_case("paged", [1] * len(kv_lens), kv_lens, hq, hkv, dqk, dtype=dtype,
                     device=device, page_size=page, seed=seed)


def check_pod(pre: Case, dec: Case, p_pre: dict, p_dec: dict) -> None:
    """Run paged cases pre (the prefill part; its custom mask if it has one) and dec (the
    decode part; same heads, head dim and tile height) through pod_prefill_decode in one
    launch, with params p_pre / p_dec (mask mode, window, scale and soft cap each; no position
    encoding), and check each part (check_parts)."""
    dev = pre.q.device
    work = torch.cat([torch.cat([torch.full((c.work.shape[0], 1), part, dtype=torch.int32,
                                            device=dev), c.work], 1)
                      for part, c in ((0, pre), (1, dec))])
    assert p_pre["pos_encoding_mode"] == p_dec["pos_encoding_mode"] == ops.POS_NONE
    part_opts = [(p["mask_mode"], p["window_left"], p["sm_scale"], p["logits_soft_cap"])
                 for p in (p_pre, p_dec)]
    check_parts(pre, dec, p_pre, p_dec, lambda: ops.pod_prefill_decode(
        pre.q, pre.k, pre.v, pre.qo_indptr, pre.kv_indptr, pre.page_indices,
        pre.last_page_len, dec.q, dec.k, dec.v, dec.qo_indptr, dec.kv_indptr,
        dec.page_indices, dec.last_page_len, work, pre.packed_mask, pre.mask_indptr, None,
        pre.block_m, *part_opts[0], *part_opts[1], ops.POS_NONE, 1.0, 1e4, 1.0, None))


def capture_graph(fn):
    """fn() captured in a CUDA graph, after a warm-up call on a side stream (compiles and
    allocates outside the capture); returns (graph, fn's result inside the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def record_tma(monkeypatch) -> list:
    """The TMA constexpr of every prefill launch from here on, in order (0 pointer loads, 1
    descriptors built per work item, 2 descriptors built on the host, 3 descriptors built once
    per persistent program), through a monkeypatched launcher."""
    from compiled_attn.ops import prefill_kernel

    seen = []
    orig = prefill_kernel._launch_prefill

    def spy(grid, work, tiles, out, lse, args, *a, **kw):
        seen.append(args.consts["TMA"])
        return orig(grid, work, tiles, out, lse, args, *a, **kw)

    monkeypatch.setattr(prefill_kernel, "_launch_prefill", spy)
    return seen


def force_kv_path(monkeypatch, path: str) -> int:
    """Force the K/V load path of dense and ragged launches (choose.KV_PATHS: "host",
    "persistent", "device" or "pointers") and return its TMA constexpr."""
    from compiled_attn.ops.policy import POLICY

    tma, settings = choose.KV_PATHS[path]
    for name, value in settings.items():
        monkeypatch.setattr(POLICY, name, value)
    return tma
