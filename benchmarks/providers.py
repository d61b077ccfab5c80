"""The timed implementations. Each provider turns a Case and its inputs into a Runner: one
zero-argument callable per input copy (the harness rotates copies when a case's inputs would sit
in L2), a function giving the output in canonical [tokens, Hq, Dvo] layout from what the callable
returned (for the correctness check, untimed), and a context entered around check and timing
(SDPA's backend selection). A provider that cannot run a case raises Unavailable with the reason;
the harness records it as an 'unavailable' row, never drops it.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .cases import Case

DEFAULT_PROVIDERS = ("compiled_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex",
                     "flashinfer_fa2", "flashinfer_fa3")
# compiled_attn_twin: our op a second time, timed as a peer (an A/A control: its ratio to
# compiled_attn is the harness's own spread, position in the interleaved order included).
OPT_IN_PROVIDERS = ("flashinfer_single_fa2", "flashinfer_single_fa3", "compiled_attn_twin")
ALL_PROVIDERS = DEFAULT_PROVIDERS + OPT_IN_PROVIDERS


class Unavailable(Exception):
    """This provider does not run this case (a refusal or a deliberate skip, with its reason)."""


@dataclass
class Inputs:
    q: torch.Tensor  # [N, Hq, D]
    k: torch.Tensor  # [Nk, Hkv, D]
    v: torch.Tensor
    qo_indptr: torch.Tensor  # int32 [B+1] on device
    kv_indptr: torch.Tensor
    q4: torch.Tensor | None = None  # [B, S, Hq, D] views when every request has the same length
    k4: torch.Tensor | None = None
    v4: torch.Tensor | None = None
    k_cache: torch.Tensor | None = None  # paged: [P, page, Hkv, D]
    v_cache: torch.Tensor | None = None
    page_indptr: torch.Tensor | None = None
    page_indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None

    def nbytes(self) -> int:
        ts = [self.q, self.k, self.v, self.k_cache, self.v_cache]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class Runner:
    fns: list[Callable[[], Any]]
    canon: Callable[[Any], torch.Tensor]
    context: Callable[[], Any] = contextlib.nullcontext
    note: str = ""
    extra: dict = field(default_factory=dict)


def _indptr(lens, device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


def make_inputs(case: Case, device, dtype, seed: int = 0) -> Inputs:
    """Random q/k/v (standard normal) for the case; paged cases also get the same K/V scattered
    into a page cache through a shuffled page table, so paged and ragged compute the same thing."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # on the GPU: 1 GB tensors in ms
    gcpu = torch.Generator(device="cpu").manual_seed(seed)
    hq, hkv, d = case.num_qo_heads, case.num_kv_heads, case.head_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    inp = Inputs(q=rnd(case.tokens, hq, d), k=rnd(case.kv_tokens, hkv, d),
                 v=rnd(case.kv_tokens, hkv, d), qo_indptr=_indptr(case.qo_lens, device),
                 kv_indptr=_indptr(case.kv_lens, device))
    if case.uniform and case.batch:
        b, s = case.batch, case.seq_len
        inp.q4, inp.k4, inp.v4 = (inp.q.view(b, s, hq, d), inp.k.view(b, s, hkv, d),
                                  inp.v.view(b, s, hkv, d))
    if case.layout == "paged":
        (inp.k_cache, inp.v_cache, inp.page_indptr, inp.page_indices,
         inp.last_page_len) = scatter_pages(inp.k, inp.v, case.kv_lens, case.page_size, gcpu)
    return inp


def scatter_pages(k: torch.Tensor, v: torch.Tensor, kv_lens, page_size: int,
                  generator: torch.Generator | None = None):
    """Ragged k, v [sum(kv_lens), Hkv, D] scattered into page caches through a shuffled page
    table (the permutation drawn on the CPU from ``generator``): (k_cache, v_cache [P,
    page_size, Hkv, D], page_indptr [B + 1], page_indices [P] int32, last_page_len [B])."""
    p, device = page_size, k.device
    npages = [-(-int(n) // p) for n in kv_lens]
    total = sum(npages)
    perm = torch.randperm(total, generator=generator)
    k_cache = torch.zeros(total, p, *k.shape[1:], device=device, dtype=k.dtype)
    v_cache = torch.zeros(total, p, *v.shape[1:], device=device, dtype=v.dtype)
    start_page, start_tok = 0, 0
    for n, np_ in zip(kv_lens, npages):
        pad = np_ * p - n
        kk = torch.nn.functional.pad(k[start_tok:start_tok + n], (0, 0, 0, 0, 0, pad))
        vv = torch.nn.functional.pad(v[start_tok:start_tok + n], (0, 0, 0, 0, 0, pad))
        idx = perm[start_page:start_page + np_].to(device)
        k_cache[idx] = kk.view(np_, p, *k.shape[1:])
        v_cache[idx] = vv.view(np_, p, *v.shape[1:])
        start_page += np_
        start_tok += n
    last = torch.tensor([n - (np_ - 1) * p for n, np_ in zip(kv_lens, npages)],
                        dtype=torch.int32, device=device)
    return (k_cache, v_cache, _indptr(npages, device),
            perm.to(device=device, dtype=torch.int32), last)


def _bottom_right_mask(qo: int, kv: int, device) -> torch.Tensor:
    i = torch.arange(qo, device=device)[:, None]
    j = torch.arange(kv, device=device)[None, :]
    return j <= i + (kv - qo)


def reference(case: Case, inp: Inputs) -> torch.Tensor:
    """SDPA (PyTorch's default backend choice) on the whole batch when the lengths are uniform,
    else one SDPA call per request. Canonical [N, Hq, D]."""
    import torch.nn.functional as F

    sm = case.head_dim ** -0.5
    gqa = case.group > 1
    if case.uniform and case.batch and case.qo_lens[0] == case.kv_lens[0]:
        o = F.scaled_dot_product_attention(inp.q4.transpose(1, 2), inp.k4.transpose(1, 2),
                                           inp.v4.transpose(1, 2), is_causal=case.causal,
                                           scale=sm, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(case.tokens, case.num_qo_heads, -1)
    out = torch.empty(case.tokens, case.num_qo_heads, case.head_dim, device=inp.q.device,
                      dtype=inp.q.dtype)
    qs = ks = 0
    for qo, kv in zip(case.qo_lens, case.kv_lens):
        q = inp.q[qs:qs + qo].transpose(0, 1)[None]
        k = inp.k[ks:ks + kv].transpose(0, 1)[None]
        v = inp.v[ks:ks + kv].transpose(0, 1)[None]
        mask = _bottom_right_mask(qo, kv, q.device) if (case.causal and qo != kv) else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=case.causal and qo == kv, scale=sm,
                                           enable_gqa=gqa)
        out[qs:qs + qo] = o[0].transpose(0, 1)
        qs += qo
        ks += kv
    return out


# ------------------------------------------------------------------------------------------
# compiled_attn: the ops directly (not the public wrappers)
# ------------------------------------------------------------------------------------------
def op_call(case: Case, inp: Inputs):
    """(op name, its tensor arguments, full, extra) for the call of our op on these inputs:
    full(*tensors) is the op's whole argument tuple (the tile plan() would choose and its work
    list, BatchPrefillWithPagedKVCacheWrapper.plan's; the tensors apart so that a caller can
    trace them); extra: block_m and the work items (batch ops only)."""
    import compiled_attn.ops as cops
    from compiled_attn.ops.schedule import block_m_for, build_work

    mask = cops.MASK_CAUSAL if case.causal else cops.MASK_NONE
    tail = (mask, -1, 0, case.head_dim ** -0.5, 0.0, cops.POS_NONE, 1.0, 1e4, 1.0, None)
    if case.layout == "dense":
        return "single_prefill", (inp.q4, inp.k4, inp.v4), \
            lambda q, k, v: (q, k, v, None, None, None, *tail), {}
    block_m = block_m_for(case.head_dim, case.head_dim, case.group, max(case.kv_lens),
                          case.causal, case.layout == "paged", page_size=case.page_size,
                          qo_lens=case.qo_lens)
    work = build_work(case.qo_lens, case.group, block_m, inp.q.device, kv_lens=case.kv_lens)
    extra = {"block_m": block_m, "work_items": int(work.shape[0])}
    opts = (None, None, None, None, block_m, *tail)
    if case.layout == "ragged":
        return "batch_ragged_prefill", (inp.q, inp.k, inp.v, inp.qo_indptr, inp.kv_indptr,
                                        work), lambda *t: (*t, *opts), extra
    return "batch_paged_prefill", (inp.q, inp.k_cache, inp.v_cache, inp.qo_indptr,
                                   inp.page_indptr, inp.page_indices, inp.last_page_len,
                                   work), lambda *t: (*t, *opts), extra


def setup_compiled_attn(case: Case, inps: list[Inputs], opts) -> Runner:
    calls = [op_call(case, i) for i in inps]
    name, extra = calls[0][0], calls[0][3]
    op = getattr(torch.ops.compiled_attn, name)
    fns = [lambda t=t, full=full: op(*full(*t)) for _, t, full, _ in calls]
    if case.layout == "dense":
        n, hq = case.tokens, case.num_qo_heads
        return Runner(fns, lambda r: r[0].reshape(n, hq, -1), note="op single_prefill")
    return Runner(fns, lambda r: r[0], note=f"op {name}", extra=extra)


# ------------------------------------------------------------------------------------------
# PyTorch SDPA, one backend forced
# ------------------------------------------------------------------------------------------
_SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                  "sdpa_efficient": "EFFICIENT_ATTENTION"}


def _refusal(fn) -> str | None:
    """Run fn once; None if it ran, else the backend's reason (its warnings + the error)."""
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        try:
            fn()
            return None
        except RuntimeError as e:
            why = " | ".join(str(w.message).strip().splitlines()[0] for w in ws)
            return (why + " | " if why else "") + str(e).strip().splitlines()[0]


def setup_sdpa(name: str):
    def setup(case: Case, inps: list[Inputs], opts) -> Runner:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.layout == "paged":
            raise Unavailable("SDPA takes no page table (the same lengths, contiguous, are timed "
                              "in the flashinfer suite)")
        if case.causal and any(q != k for q, k in zip(case.qo_lens, case.kv_lens)):
            raise Unavailable("SDPA's is_causal is top-left aligned; causal qo != kv not timed")
        backend = getattr(SDPBackend, _SDPA_BACKENDS[name])
        ctx = lambda: sdpa_kernel([backend])  # noqa: E731
        sm = case.head_dim ** -0.5
        n, hq, g = case.tokens, case.num_qo_heads, case.group
        note = ""
        if case.uniform:
            args = [(i.q4.transpose(1, 2), i.k4.transpose(1, 2), i.v4.transpose(1, 2))
                    for i in inps]
            gqa = g > 1

            def mk(a, gqa):
                return lambda: F.scaled_dot_product_attention(*a, is_causal=case.causal,
                                                              scale=sm, enable_gqa=gqa)
            with ctx():
                why = _refusal(mk(args[0], gqa))
                if why is not None and gqa:
                    # The backend refuses enable_gqa: give it K/V expanded to Hq heads (the
                    # expansion is done here, untimed, which favours the peer).
                    args = [(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
                            for q, k, v in args]
                    gqa = False
                    why2 = _refusal(mk(args[0], gqa))
                    if why2 is not None:
                        raise Unavailable(f"refused enable_gqa ({why}); expanded K/V: {why2}")
                    note = f"K/V expanded to {hq} heads before timing (enable_gqa refused: {why})"
                elif why is not None:
                    raise Unavailable(why)
            return Runner([mk(a, gqa) for a in args],
                          lambda o: o.transpose(1, 2).reshape(n, hq, -1), ctx, note)
        # Variable lengths: nested jagged tensors, [B, H, j, D].
        if g > 1:
            raise Unavailable("nested-tensor SDPA with GQA not attempted")
        if case.causal:
            raise Unavailable("variable lengths need nested tensors, and nested-tensor SDPA "
                              "refuses is_causal=True (torch: 'Nested tensors for query / key "
                              "are not supported when is_causal=True')")

        def njt(t, indptr):
            return torch.nested.nested_tensor_from_jagged(t, offsets=indptr.long()).transpose(1, 2)

        args = [(njt(i.q, i.qo_indptr), njt(i.k, i.kv_indptr), njt(i.v, i.kv_indptr))
                for i in inps]
        fns = [lambda a=a: F.scaled_dot_product_attention(*a, is_causal=case.causal, scale=sm)
               for a in args]
        with ctx():
            why = _refusal(fns[0])
        if why is not None:
            raise Unavailable(f"nested (jagged) tensors: {why}")
        return Runner(fns, lambda o: o.transpose(1, 2).values().reshape(n, hq, -1), ctx,
                      "nested jagged tensors (varlen)")
    return setup


# ------------------------------------------------------------------------------------------
# FlexAttention (torch.compile'd), causal block mask / document mask
# ------------------------------------------------------------------------------------------
_FLEX = {}


def _compiled_flex(dynamic: bool):
    if dynamic not in _FLEX:
        import torch._dynamo.config as dc
        from torch.nn.attention.flex_attention import flex_attention

        # Static shapes recompile per case; stay under dynamo's limits (else: eager fallback).
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dc, name):
                setattr(dc, name, max(getattr(dc, name), 1024))
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def setup_flex(case: Case, inps: list[Inputs], opts) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask

    if case.layout == "paged":
        raise Unavailable("FlexAttention takes no page table here (the same lengths, contiguous, "
                          "are timed in the flashinfer suite)")
    if case.causal and any(q != k for q, k in zip(case.qo_lens, case.kv_lens)):
        raise Unavailable("causal qo != kv not set up for FlexAttention")
    if inps[0].q.device.type != "cuda" and not opts.flex_on_cpu:
        raise Unavailable("FlexAttention is timed on CUDA only")
    flex = _compiled_flex(opts.flex_dynamic)
    sm = case.head_dim ** -0.5
    n, hq, gqa = case.tokens, case.num_qo_heads, case.group > 1
    dev = inps[0].q.device

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if case.uniform:
        s = case.seq_len
        bm = create_block_mask(causal_mod, None, None, s, s, device=dev) if case.causal else None
        args = [(i.q4.transpose(1, 2), i.k4.transpose(1, 2), i.v4.transpose(1, 2)) for i in inps]
        canon = lambda o: o.transpose(1, 2).reshape(n, hq, -1)  # noqa: E731
        note = "causal block mask" if case.causal else "no mask"
    else:
        doc = torch.repeat_interleave(torch.arange(case.batch, device=dev),
                                      torch.tensor(case.qo_lens, device=dev))

        def doc_mod(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if case.causal else same

        bm = create_block_mask(doc_mod, None, None, n, n, device=dev)
        args = [(i.q[None].transpose(1, 2), i.k[None].transpose(1, 2), i.v[None].transpose(1, 2))
                for i in inps]
        canon = lambda o: o[0].transpose(0, 1)  # noqa: E731
        note = "document mask over the packed batch"
    fns = [lambda a=a: flex(*a, block_mask=bm, scale=sm, enable_gqa=gqa) for a in args]
    return Runner(fns, canon, note=note + (", dynamic=True" if opts.flex_dynamic else ""))


# ------------------------------------------------------------------------------------------
# FlashInfer (when importable): batch wrappers with backend fa2 / fa3, single prefill opt-in
# ------------------------------------------------------------------------------------------
_FI: dict = {}


def flashinfer_module():
    """flashinfer, or raise Unavailable with why it did not import."""
    if "mod" not in _FI:
        try:
            import flashinfer

            _FI["mod"] = flashinfer
        except Exception as e:  # noqa: BLE001  (any import failure: recorded in the rows)
            _FI["mod"] = None
            _FI["why"] = f"import flashinfer failed: {type(e).__name__}: {e}"
    if _FI["mod"] is None:
        raise Unavailable(_FI["why"])
    return _FI["mod"]


def _workspace(device):
    if "ws" not in _FI:
        _FI["ws"] = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    return _FI["ws"]


def setup_flashinfer(backend: str, single: bool = False):
    def setup(case: Case, inps: list[Inputs], opts) -> Runner:
        if opts.no_flashinfer:
            raise Unavailable("skipped: --no-flashinfer")
        if inps[0].q.device.type != "cuda":
            raise Unavailable("FlashInfer needs CUDA")
        if opts.flashinfer_dims is not None and case.head_dim not in opts.flashinfer_dims:
            raise Unavailable(f"skipped: head_dim {case.head_dim} not in --flashinfer-dims "
                              f"{sorted(opts.flashinfer_dims)} (each head dim is a separate JIT "
                              "build: fa2 ~25 s, fa3 ~100 s)")
        if backend == "fa3" and torch.cuda.get_device_capability(inps[0].q.device)[0] != 9:
            raise Unavailable("backend fa3 needs sm90 (Hopper)")
        fi = flashinfer_module()
        extra = {"version": getattr(fi, "__version__", "?")}
        sm = case.head_dim ** -0.5
        hq, hkv, d, dt = case.num_qo_heads, case.num_kv_heads, case.head_dim, inps[0].q.dtype
        if single:
            if case.batch != 1 or case.layout == "paged":
                raise Unavailable("single_prefill_with_kv_cache: one request, contiguous KV")
            fns = [lambda i=i: fi.single_prefill_with_kv_cache(
                i.q, i.k, i.v, causal=case.causal, sm_scale=sm, backend=backend) for i in inps]
            return Runner(fns, lambda o: o, note="single_prefill_with_kv_cache", extra=extra)
        ws = _workspace(inps[0].q.device)
        i0 = inps[0]
        if case.layout == "paged":
            # One plan per input copy: each copy has its own page table (make_inputs shuffles
            # pages per seed), which FlashInfer reads from the plan, not from run().
            fns = []
            for i in inps:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(i.qo_indptr, i.page_indptr, i.page_indices, i.last_page_len, hq, hkv, d,
                       case.page_size, causal=case.causal, sm_scale=sm, q_data_type=dt,
                       kv_data_type=dt)
                fns.append(lambda i=i, w=w: w.run(i.q, (i.k_cache, i.v_cache)))
            note = "BatchPrefillWithPagedKVCacheWrapper NHD"
        else:
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(i0.qo_indptr, i0.kv_indptr, hq, hkv, d, causal=case.causal, sm_scale=sm,
                   q_data_type=dt, kv_data_type=dt)
            fns = [lambda i=i: w.run(i.q, i.k, i.v) for i in inps]
            note = "BatchPrefillWithRaggedKVCacheWrapper NHD"
        return Runner(fns, lambda o: o, note=note, extra=extra)
    return setup


SETUPS = {
    "compiled_attn": setup_compiled_attn,
    "sdpa_flash": setup_sdpa("sdpa_flash"),
    "sdpa_cudnn": setup_sdpa("sdpa_cudnn"),
    "sdpa_efficient": setup_sdpa("sdpa_efficient"),
    "flex": setup_flex,
    "flashinfer_fa2": setup_flashinfer("fa2"),
    "flashinfer_fa3": setup_flashinfer("fa3"),
    "flashinfer_single_fa2": setup_flashinfer("fa2", single=True),
    "flashinfer_single_fa3": setup_flashinfer("fa3", single=True),
    "compiled_attn_twin": setup_compiled_attn,
}


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------
def gpu_state() -> dict:
    """The GPU's SM clock (MHz), power draw (W) and temperature (C) now, through NVML (None where
    torch cannot read them): sampled while the timed calls run, to tell a throttled run."""
    out = {}
    for key, fn in (("sm_clock_mhz", "clock_rate"), ("power_w", "power_draw"),
                    ("temp_c", "temperature")):
        try:
            v = getattr(torch.cuda, fn)()
            out[key] = round(v / 1000) if key == "power_w" else v  # power_draw: milliwatts
        except Exception:  # noqa: BLE001  (no pynvml, or an NVML error: not measured)
            out[key] = None
    return out


@dataclass
class Timing:
    """One runner's result from bench: median ms per call over ``iters`` timed calls and the
    GPU state (median of the samples) while they ran, or the error it raised. host_ms (CUDA):
    the host's time to issue one timed call (median over the slices of their first HOST_CALLS
    calls, issued on an empty launch queue, event records included); near median_ms, the GPU
    waited on the host and the row times the launch path, not the kernel."""
    median_ms: float | None = None
    iters: int = 0
    host_ms: float | None = None
    state: dict = field(default_factory=dict)
    error: BaseException | None = None


# Calls per slice whose issuing the host's time per call is read over: few enough that their
# launches and event records (a handful each) stay far below CUDA's launch queue depth (~1024),
# so the host never blocks on the GPU while it is timed.
HOST_CALLS = 32


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


class _Slot:
    """One runner under bench: its callables (one per input copy, called in rotation), its
    context, how many calls settle a slice and how many a slice times, and what it measured."""

    def __init__(self, fns: list[Callable[[], Any]], ctx: Callable[[], Any], cuda: bool):
        self.fns, self.ctx, self.cuda = fns, ctx, cuda
        self.turn = 0  # the next input copy
        self.settle = self.per_slice = 0
        self.times: list[float] = []
        self.states: list[dict] = []
        self.host: list[float] = []  # CUDA: host ms per call, one value per timed slice

    def call(self, count: int) -> None:
        for _ in range(count):
            self.fns[self.turn % len(self.fns)]()
            self.turn += 1

    def span_ms(self, count: int) -> float:
        """Milliseconds of ``count`` calls back to back (one event pair / one clock reading)."""
        if not self.cuda:
            t0 = time.perf_counter()
            self.call(count)
            return (time.perf_counter() - t0) * 1e3
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        self.call(count)
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    def time_each(self, count: int) -> None:
        """Time ``count`` calls one by one into self.times (CUDA: an event pair per call, with
        the GPU state sampled while they run). CUDA also reads the host's time to issue the
        slice's first HOST_CALLS calls into self.host: the settling calls' backlog is drained
        first, so that no call of these waits on a full launch queue (one that did would count
        the GPU's time as the host's; rows timed before the 2026-11-23 harness did)."""
        if not self.cuda:
            for _ in range(count):
                self.times.append(self.span_ms(1))
            return
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(count)]
        n_host = min(count, HOST_CALLS)
        torch.cuda.synchronize()  # (an idle gap of microseconds: the clock stays settled)
        t0 = time.perf_counter()
        for i, (s, e) in enumerate(ev):
            s.record()
            self.call(1)
            e.record()
            if i + 1 == n_host:
                self.host.append((time.perf_counter() - t0) * 1e3 / n_host)
        self.states.append(gpu_state())  # sampled while the slice runs
        torch.cuda.synchronize()
        self.times += [s.elapsed_time(e) for s, e in ev]


def bench(runners: list[tuple[list[Callable[[], Any]], Callable[[], Any]]], warmup_ms: float,
          rep_ms: float, cuda: bool, rounds: int = 3, max_iters: int = 2000) -> list[Timing]:
    """Time runners (each: its callables, one per input copy, and the context to call them in)
    interleaved: ``rounds`` rounds each time a slice of every runner's calls, in a different
    (seeded random) order each round, so that drift of the clock over a group's timing
    (temperature, power capping) is sampled alike for every runner. Each slice first settles:
    untimed calls for ``warmup_ms`` (at least 3), because the clock the previous runner left
    behind takes that long to become this runner's own (after 400 ms of SDPA cuDNN our kernel
    ran 452, 474, 495, 503, 508 TFLOP/s on its first five 20 ms calls; with one settling call
    per slice, the runner following the most power-hungry peer read 5-15% low). Then CUDA event
    pairs around each call, calls rotating over the input copies; CPU (smoke tests only):
    perf_counter. Timed calls per runner: at least 20 and ``rep_ms`` (at most ``max_iters``),
    estimated from 3 calls. A runner that raises is recorded in its Timing and left out of
    later slices."""
    slots = [_Slot(fns, ctx, cuda) for fns, ctx in runners]
    out = [Timing() for _ in runners]

    def attempt(i: int, work: Callable[[_Slot], None]) -> None:
        if out[i].error is None:
            try:
                with slots[i].ctx():
                    work(slots[i])
            except Exception as e:  # noqa: BLE001  (the caller records it in the runner's row)
                out[i].error = e

    def size(sl: _Slot) -> None:
        sl.call(1)
        if cuda:
            torch.cuda.synchronize()
        est = max(sl.span_ms(3) / 3, 1e-3)
        # CUDA: at least 3 settling and 20 timed calls, so a 20 ms case is not judged on a
        # clock still ramping up (B1 S32k moved 437 -> 508 TFLOP/s between two runs of 1 + 5)
        sl.settle = max(3 if cuda else 1, int(warmup_ms / est))
        n_rep = max(20 if cuda else 5, min(max_iters, int(rep_ms / est)))
        sl.per_slice = -(-n_rep // rounds)

    def time_slice(sl: _Slot) -> None:
        sl.call(sl.settle)  # untimed: the clock becomes this runner's
        sl.time_each(sl.per_slice)

    for i in range(len(slots)):
        attempt(i, size)
    for r in range(rounds):
        # a fresh order every round (seeded: reproducible), so no runner always follows the same
        # one (the clock it leaves behind is the next runner's start)
        for i in random.Random(r).sample(range(len(slots)), len(slots)):
            attempt(i, time_slice)
    for t, sl in zip(out, slots):
        if t.error is None:
            t.median_ms, t.iters = _median(sl.times), len(sl.times)
            if cuda:
                t.host_ms = _median(sl.host)
                for key in ("sm_clock_mhz", "power_w", "temp_c"):
                    vals = [st[key] for st in sl.states if st.get(key) is not None]
                    t.state[key] = round(_median(vals)) if vals else None
    return out


def medians_us(calls: dict, rounds: int = 5, warmup_ms: float = 25.0, rep_ms: float = 150.0,
               cuda: bool = True) -> dict:
    """name -> median microseconds per call of each zero-argument callable, timed interleaved
    through bench (the developer probes' comparisons of several calls); a failure raises."""
    names = list(calls)
    out = {}
    for name, t in zip(names, bench([([calls[n]], contextlib.nullcontext) for n in names],
                                    warmup_ms, rep_ms, cuda, rounds)):
        if t.error is not None:
            raise t.error
        out[name] = t.median_ms * 1e3
    return out


def time_ms(fn: Callable[[], Any], warmup_ms: float = 100.0, rep_ms: float = 400.0,
            cuda: bool = True) -> float:
    """Median milliseconds per call of one callable through bench (one round): the developer
    probes' timing, so every figure in the project comes from the same harness."""
    t = bench([([fn], contextlib.nullcontext)], warmup_ms, rep_ms, cuda, rounds=1)[0]
    if t.error is not None:
        raise t.error
    return t.median_ms
