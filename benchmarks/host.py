"""The host suite: what one eager call of each entry point costs the host, beside FlashInfer and
SDPA in the same process.

Inputs are tiny (4 requests x 64 tokens, Hq 32 / Hkv 8, D 128, bf16, page 16: a few
microseconds of GPU work); the *_layers cases (paged and POD run()) take LAYERS layers' tensors
in turn, each layer its own K / V cache, as a model's layers call one plan. Each timing queues CALLS calls behind a sleeping GPU
(torch.cuda._sleep), so the host never waits on the device: the time per call is the host's
alone. Providers are timed in interleaved rounds; each row keeps the median over rounds. The
torch.compile'd forms (fullgraph) are timed the same way. Rows: suite "host", case = the entry
point, provider, "host_us" (median), "host_us_best" (the best round), "host_us_rounds", and on
ours "ratio_vs_<peer>" = the peer's host time over ours (above 1: we are cheaper; medians) and
"best_ratio_vs_<peer>" (the best rounds'), and "recordings_per_call": how many calls ours
recorded (the whole path under the recorder, launch.recordings) per timed call, over every
round (0 where every call replays). The host's CPU model is recorded in the header.

Run on the GPU machine: ``python -m benchmarks.host --out benchmarks/results/host_<gpu>.json``
(FlashInfer from .whl/, dev/gpu_setup.sh; --no-flashinfer without it; --no-fi-pod leaves out
FlashInfer's POD; a module missing from FlashInfer's JIT cache builds for minutes on first use).
The row "single_prefill_torch_ops" is the op called as a serving engine may call it,
``torch.ops.compiled_attn.single_prefill`` (through torch's dispatcher), beside SDPA's aten op.
The *_plan cases time plan() (ragged, paged, POD, and our BatchPOD) as a serving step calls it
before its layers' run() calls, on the same sizes, alternating two page orders; a plan reads its
index arrays on the host, so these are wall times with the GPU idle, not queued calls. The
*_step cases (paged, POD) time a serving step: plan(), then each of the LAYERS layers' run() on
it (wall times too). The decode_step case is a decode step as a serving engine's comes:
DECODE_REQ one-row requests whose keys grow by one a step, a request taking the next page of a
shuffled pool when its last page fills (the page tables built ahead, DECODE_STEPS of them in
turn), plan() then each layer's run() (a wall time too). The chunk_step (POD) and mixed_step
(the paged wrapper, one batch) cases add to those decodes one prompt's chunked prefill, CHUNK
rows a step whose keys grow by CHUNK a step: a step whose prefill changes every step, so that
its first run() meets new sizes, as a serving engine's do; batch_pod_step (ours) serves the same
step through BatchPOD, the chunk's request on its pages as the prefill part. The cut_step case
is chunk_step on CUT_REQ decodes of about CUT_KV0 keys, which a POD plan cuts into key chunks.
FlashInfer's wrappers run its fa2 backend; its single prefill runs the backend
--fi-single-backend names (default "auto", FlashInfer's own default: fa3 on Hopper), recorded in
the header. A plot goes beside the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch

from benchmarks.results import environment

NREQ, LEN, HQ, HKV, D, PAGE = 4, 64, 32, 8, 128, 16
DT = torch.bfloat16
# the *_layers cases: a model's layers take turns, each call on the next layer's own K / V cache
# (and its own q, k, v), as a serving step issues them; the other cases call on one set of
# tensors, so any per-pointer host work (descriptors) is paid once there
LAYERS = 8


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _inputs(dev):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dev, DT)

    n = NREQ * LEN
    pages = NREQ * LEN // PAGE
    perm = torch.randperm(pages, generator=g).to(torch.int32)
    return dict(
        q1=rnd(LEN, HQ, D), k1=rnd(LEN, HKV, D), v1=rnd(LEN, HKV, D),
        q=rnd(n, HQ, D), k=rnd(n, HKV, D), v=rnd(n, HKV, D),
        cache=rnd(pages, 2, PAGE, HKV, D),
        qo=torch.arange(NREQ + 1, dtype=torch.int32, device=dev) * LEN,
        kvi=torch.arange(NREQ + 1, dtype=torch.int32, device=dev) * (LEN // PAGE),
        idx=perm.to(dev), last=torch.full((NREQ,), PAGE, dtype=torch.int32, device=dev),
        # a second page order: plan cases alternate the two, as a serving step's tables change
        idx2=torch.randperm(pages, generator=g).to(torch.int32).to(dev),
        # ...and a second split of the ragged keys (the same total), for the ragged plan case
        kvo2=torch.tensor([0] + [LEN * i + 16 for i in range(1, NREQ)] + [NREQ * LEN],
                          dtype=torch.int32, device=dev),
        qd=rnd(NREQ, HQ, D), qo_d=torch.arange(NREQ + 1, dtype=torch.int32, device=dev),
        layers=[dict(q=rnd(n, HQ, D), cache=rnd(pages, 2, PAGE, HKV, D), q1=rnd(LEN, HQ, D),
                     k1=rnd(LEN, HKV, D), v1=rnd(LEN, HKV, D), qd=rnd(NREQ, HQ, D))
                for _ in range(LAYERS)],
    )


def _turns(call, layers):
    """A zero-argument call of call(layer) that takes the layers in turn."""
    state = [0]

    def step():
        i = state[0]
        state[0] = (i + 1) % len(layers)
        return call(layers[i])
    return step


def _wrappers(mod, x, dev, name, single_backend="auto"):
    """Zero-argument calls of module ``mod``'s (compiled_attn or flashinfer) entry points."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    calls = {}
    kw = {"backend": "fa2"} if name == "flashinfer" else {}
    single_kw = {"backend": single_backend} if name == "flashinfer" else {}
    calls["single_prefill"] = lambda: mod.single_prefill_with_kv_cache(
        x["q1"], x["k1"], x["v1"], causal=True, **single_kw)
    rw = mod.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", **kw)
    rw.plan(x["qo"], x["qo"], HQ, HKV, D, causal=True, q_data_type=DT)
    calls["ragged_run"] = lambda: rw.run(x["q"], x["k"], x["v"])
    pw = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)
    pw.plan(x["qo"], x["kvi"], x["idx"], x["last"], HQ, HKV, D, PAGE, causal=True,
            q_data_type=DT)
    calls["paged_run"] = lambda: pw.run(x["q"], x["cache"])
    calls["paged_run_layers"] = _turns(lambda t: pw.run(t["q"], t["cache"]), x["layers"])
    return calls


def _plans(mod, x, dev, name):
    """Zero-argument plan() calls of module ``mod``'s wrappers (each its own wrapper, so that
    no run() case's plan changes), alternating two page orders (ragged: two splits of its
    keys), so that each plan writes new index arrays."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    kw = {"backend": "fa2"} if name == "flashinfer" else {}
    rw = mod.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", **kw)
    pw = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)
    dw = mod.PODWithPagedKVCacheWrapper(ws, "NHD")
    calls = {
        # (ragged: two splits of the same keys in turn, as the others' two page orders)
        "ragged_plan": lambda idx: rw.plan(x["qo"], x["qo"] if idx is x["idx"] else x["kvo2"],
                                           HQ, HKV, D, causal=True, q_data_type=DT),
        "paged_plan": lambda idx: pw.plan(x["qo"], x["kvi"], idx, x["last"], HQ, HKV, D, PAGE,
                                          causal=True, q_data_type=DT),
        "pod_plan": lambda idx: dw.plan(x["kvi"], idx, x["last"], HQ, HKV, D, PAGE,
                                        q_data_type=DT, kv_data_type=DT)}
    if name == "compiled_attn":
        bw = mod.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
        calls["batch_pod_plan"] = lambda idx: bw.plan(
            x["qo"], x["kvi"], idx, x["last"], x["qo_d"], x["kvi"], idx, x["last"], HQ, HKV, D,
            PAGE, q_data_type=DT, kv_data_type=DT)
    return {case: _turns(call, [x["idx"], x["idx2"]]) for case, call in calls.items()}


def _steps(mod, x, dev, name, pod: bool = True):
    """Zero-argument serving steps of module ``mod``'s wrappers: plan() (alternating two page
    orders, as the *_plan cases), then each of the LAYERS layers' run() on that plan, paged
    ("paged_step") and POD ("pod_step"; pod: with it). A step's first run() is the one that
    pays whatever a new plan costs run() (ours: the bound call recorded again for the new
    plan's tensors), which neither the *_plan nor the *_layers cases include."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    kw = {"backend": "fa2"} if name == "flashinfer" else {}
    pw = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)

    def paged(idx):
        pw.plan(x["qo"], x["kvi"], idx, x["last"], HQ, HKV, D, PAGE, causal=True,
                q_data_type=DT)
        for t in x["layers"]:
            pw.run(t["q"], t["cache"])

    orders = [x["idx"], x["idx2"]]
    calls = {"paged_step": _turns(paged, orders)}
    if pod:
        dw = mod.PODWithPagedKVCacheWrapper(ws, "NHD")

        def pod_step(idx):
            dw.plan(x["kvi"], idx, x["last"], HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
            for t in x["layers"]:
                dw.run(t["q1"], t["k1"], t["v1"], t["qd"], t["cache"], causal_p=True)
        calls["pod_step"] = _turns(pod_step, orders)
    return calls


# the decode_step case: one-row requests, their first key counts, the steps built ahead
DECODE_REQ, DECODE_KV0, DECODE_STEPS = 32, 500, 64


def _decode_tables(dev, requests: int = DECODE_REQ, steps: int = DECODE_STEPS,
                   kv0: int = DECODE_KV0):
    """The page tables of ``steps`` decode steps of ``requests`` one-row requests (keys
    kv0 + 37 i mod 300 at first, one more each step; a request whose last page is full
    takes the next page of a shuffled pool): a list of (paged_kv_indptr, paged_kv_indices,
    paged_kv_last_page_len) int32 tensors on dev, and the pool's page count."""
    g = torch.Generator().manual_seed(1)
    lens = [kv0 + 37 * i % 300 for i in range(requests)]
    n_pages = sum(-(-(n + steps) // PAGE) for n in lens)
    pool = torch.randperm(n_pages, generator=g).tolist()
    owned = [[pool.pop() for _ in range(-(-n // PAGE))] for n in lens]
    out = []
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        for pages, n in zip(owned, lens):
            if len(pages) * PAGE < n:
                pages.append(pool.pop())
        counts = [0]
        for pages in owned:
            counts.append(counts[-1] + len(pages))
        out.append(tuple(torch.tensor(a, dtype=torch.int32, device=dev) for a in (
            counts, [i for pages in owned for i in pages], [(n - 1) % PAGE + 1 for n in lens])))
    return out, n_pages


def _decode_step(mod, dev, name):
    """The decode_step case's call: plan() on the next step's page table, then each of the
    LAYERS layers' run() on its own query rows and cache."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    kw = {"backend": "fa2"} if name == "flashinfer" else {}
    w = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)
    tables, n_pages = _decode_tables(dev)
    qo = torch.arange(DECODE_REQ + 1, dtype=torch.int32, device=dev)
    layers = [(torch.randn(DECODE_REQ, HQ, D, device=dev, dtype=DT),
               torch.randn(n_pages, 2, PAGE, HKV, D, device=dev, dtype=DT))
              for _ in range(LAYERS)]

    def step(table):
        w.plan(qo, *table, HQ, HKV, D, PAGE, q_data_type=DT)
        for q, cache in layers:
            w.run(q, cache)
    return _turns(step, tables)


# the chunk_step / mixed_step cases: the decode_step case's decodes beside one prompt's
# chunked prefill, CHUNK new rows a step whose keys grow by CHUNK a step
CHUNK = 64


def _chunk_tables(dev, requests: int = DECODE_REQ, steps: int = DECODE_STEPS,
                  kv0: int = DECODE_KV0):
    """The decode_step case's page tables (_decode_tables) and, each step, the prefill chunk's
    key count (CHUNK times the step's number) and the mixed batch's table: the chunk's request
    first (its pages after the decodes' pool, shuffled), then the decodes. A list of dicts
    (dec: the decodes' (indptr, indices, last_page_len); kv: the chunk's keys; mixed: the
    batch's (qo_indptr, indptr, indices, last_page_len); batch: BatchPOD's plan() arrays, the
    chunk's request as the prefill part's (qo_indptr, indptr, indices, last_page_len) then the
    decodes' with their qo_indptr), and the pages of both."""
    tables, n_pages = _decode_tables(dev, requests, steps, kv0)
    g = torch.Generator().manual_seed(2)
    pre = (n_pages + torch.randperm(-(-CHUNK * steps // PAGE), generator=g)).tolist()
    qo = torch.tensor([0, CHUNK] + [CHUNK + i + 1 for i in range(requests)], dtype=torch.int32,
                      device=dev)
    qo_d = torch.arange(requests + 1, dtype=torch.int32, device=dev)
    out = []
    for s, (kvi, idx, last) in enumerate(tables):
        kv = CHUNK * (s + 1)
        own = -(-kv // PAGE)
        mixed = (qo, torch.cat([kvi.new_zeros(1), kvi + own]),
                 torch.cat([torch.tensor(pre[:own], dtype=torch.int32, device=dev), idx]),
                 torch.cat([last.new_full((1,), (kv - 1) % PAGE + 1), last]))
        batch = (qo[:2], mixed[1][:2], mixed[2][:own], mixed[3][:1], qo_d, kvi, idx, last)
        out.append(dict(dec=(kvi, idx, last), kv=kv, mixed=mixed, batch=batch))
    return out, n_pages + len(pre)


def _chunk_steps(mod, dev, name, pod: bool = True, requests: int = DECODE_REQ,
                 steps: int = DECODE_STEPS, batch_pod: bool = False, kv0: int = DECODE_KV0):
    """The chunk_step (POD: plan() on the decodes' table, then each layer's run() with the
    step's prefill chunk, its keys contiguous) and mixed_step (the same work as one batch of
    the paged wrapper: plan() with the chunk's request and the decodes, then each layer's run())
    cases' calls: a serving step whose prefill part changes every step, as a chunked prefill's
    does, so that the step's first run() meets a call of new sizes. batch_pod: also
    batch_pod_step (BatchPOD: plan() with the chunk's request as its prefill part, on its
    pages, and the decodes, then each layer's run()). kv0: the decodes' first key counts
    (_decode_tables)."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    kw = {"backend": "fa2"} if name == "flashinfer" else {}
    steps, n_pages = _chunk_tables(dev, requests, steps, kv0)
    most = CHUNK * len(steps)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, dtype=DT)

    layers = [dict(qd=rnd(requests, HQ, D), cache=rnd(n_pages, 2, PAGE, HKV, D),
                   qp=rnd(CHUNK, HQ, D), kp=rnd(most, HKV, D), vp=rnd(most, HKV, D),
                   qm=rnd(CHUNK + requests, HQ, D)) for _ in range(LAYERS)]
    pw = mod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **kw)

    def mixed(st):
        pw.plan(*st["mixed"], HQ, HKV, D, PAGE, causal=True, q_data_type=DT)
        for t in layers:
            pw.run(t["qm"], t["cache"])

    calls = {"mixed_step": _turns(mixed, steps)}
    if pod:
        dw = mod.PODWithPagedKVCacheWrapper(ws, "NHD")

        def chunk(st):
            dw.plan(*st["dec"], HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
            kv = st["kv"]
            for t in layers:
                dw.run(t["qp"], t["kp"][:kv], t["vp"][:kv], t["qd"], t["cache"], causal_p=True)
        calls["chunk_step"] = _turns(chunk, steps)
    if batch_pod:
        bw = mod.BatchPODWithPagedKVCacheWrapper(ws, "NHD")

        def batch(st):
            bw.plan(*st["batch"], HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
            for t in layers:
                bw.run(t["qp"], t["cache"], t["qd"], t["cache"], causal_p=True)
        calls["batch_pod_step"] = _turns(batch, steps)
    return calls


# the cut_step case: the chunk_step case with fewer, longer decodes, which a POD plan for a
# Hopper GPU cuts into key chunks (schedule.planned_chunk_count: 16 x 8 programs, 4100+ keys)
CUT_REQ, CUT_KV0 = 16, 4100


def _cut_step(mod, dev, name):
    """The cut_step case's call: chunk_step (_chunk_steps) on CUT_REQ decodes of CUT_KV0 +
    37 i mod 300 keys, one more each step, whose POD plan holds decode key chunks (a re-plan
    keeps the last plan's calls where the chunks launch as its)."""
    return _chunk_steps(mod, dev, name, requests=CUT_REQ, kv0=CUT_KV0)["chunk_step"]


def _pod(mod, x, dev, layers: bool = False):
    """POD run() on x's tensors, or (layers) on x's layers' in turn."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = mod.PODWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(x["kvi"], x["idx"], x["last"], HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)

    def run(t):
        return w.run(t["q1"], t["k1"], t["v1"], t["qd"], t["cache"], causal_p=True)
    return _turns(run, x["layers"]) if layers else lambda: run(x)


def _batch_pod(mod, x, dev):
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = mod.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(x["qo"], x["kvi"], x["idx"], x["last"], x["qo_d"], x["kvi"], x["idx"], x["last"],
           HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
    return lambda: w.run(x["q"], x["cache"], x["qd"], x["cache"], causal_p=True)


def providers(args) -> dict:
    """(case, provider) -> zero-argument call; a provider that cannot be set up maps to the
    error text."""
    import compiled_attn as ca

    dev = torch.device("cuda")
    x = _inputs(dev)
    out: dict = {}

    def add(case, prov, make):
        try:
            out[case, prov] = make()
        except Exception as e:  # noqa: BLE001  (recorded as the row's error)
            out[case, prov] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    for case, fn in _wrappers(ca, x, dev, "compiled_attn").items():
        add(case, "compiled_attn", lambda fn=fn: fn)
    for case, fn in _plans(ca, x, dev, "compiled_attn").items():
        add(case, "compiled_attn", lambda fn=fn: fn)
    for case, fn in _steps(ca, x, dev, "compiled_attn").items():
        add(case, "compiled_attn", lambda fn=fn: fn)
    add("decode_step", "compiled_attn", lambda: _decode_step(ca, dev, "compiled_attn"))
    chunked = functools.cache(lambda: _chunk_steps(ca, dev, "compiled_attn",
                                                   batch_pod=True))  # (one set of layers)
    for case in ("chunk_step", "mixed_step", "batch_pod_step"):
        add(case, "compiled_attn", lambda case=case: chunked()[case])
    add("cut_step", "compiled_attn", lambda: _cut_step(ca, dev, "compiled_attn"))
    add("pod_run", "compiled_attn", lambda: _pod(ca, x, dev))
    add("pod_run_layers", "compiled_attn", lambda: _pod(ca, x, dev, layers=True))
    add("batch_pod_run", "compiled_attn", lambda: _batch_pod(ca, x, dev))
    if not args.no_flashinfer:
        try:
            import flashinfer

            for case, fn in _wrappers(flashinfer, x, dev, "flashinfer",
                                      args.fi_single_backend).items():
                add(case, "flashinfer", lambda fn=fn: fn)
            for case, fn in _plans(flashinfer, x, dev, "flashinfer").items():
                if case != "pod_plan" or not args.no_fi_pod:
                    add(case, "flashinfer", lambda fn=fn: fn)
            for case, fn in _steps(flashinfer, x, dev, "flashinfer",
                                   pod=not args.no_fi_pod).items():
                add(case, "flashinfer", lambda fn=fn: fn)
            add("decode_step", "flashinfer", lambda: _decode_step(flashinfer, dev, "flashinfer"))
            for case, fn in _chunk_steps(flashinfer, dev, "flashinfer",
                                         pod=not args.no_fi_pod).items():
                add(case, "flashinfer", lambda fn=fn: fn)
            if not args.no_fi_pod:
                add("cut_step", "flashinfer", lambda: _cut_step(flashinfer, dev, "flashinfer"))
            if not args.no_fi_pod:
                add("pod_run", "flashinfer", lambda: _pod(flashinfer, x, dev))
                add("pod_run_layers", "flashinfer",
                    lambda: _pod(flashinfer, x, dev, layers=True))
        except Exception as e:  # noqa: BLE001
            for case in ("single_prefill", "ragged_run", "paged_run", "paged_run_layers",
                         "ragged_plan", "paged_plan", "pod_plan", "paged_step", "pod_step",
                         "decode_step", "chunk_step", "mixed_step", "cut_step"):
                out.setdefault((case, "flashinfer"), f"{type(e).__name__}: {e}")
    # SDPA on the single request, GQA expanded outside the timed call
    f = torch.nn.functional.scaled_dot_product_attention
    qs = x["q1"].transpose(0, 1).unsqueeze(0)
    ks = x["k1"].repeat_interleave(HQ // HKV, 1).transpose(0, 1).unsqueeze(0)
    vs = x["v1"].repeat_interleave(HQ // HKV, 1).transpose(0, 1).unsqueeze(0)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    add("single_prefill", "sdpa", lambda: lambda: f(qs, ks, vs, is_causal=True))
    for prov, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def make(be=be):
            def call():
                with sdpa_kernel(be):
                    return f(qs, ks, vs, is_causal=True)
            return call
        add("single_prefill", prov, make)
    # the ops called through torch's dispatcher (a serving engine's direct call)
    from compiled_attn.ops import MASK_CAUSAL, POS_NONE

    q4, k4, v4 = (t.unsqueeze(0) for t in (x["q1"], x["k1"], x["v1"]))
    add("single_prefill_torch_ops", "compiled_attn", lambda: lambda: (
        torch.ops.compiled_attn.single_prefill(q4, k4, v4, None, None, None, MASK_CAUSAL, -1,
                                               0, D ** -0.5, 0.0, POS_NONE, 1.0, 1e4, 1.0,
                                               None)))
    add("single_prefill_torch_ops", "sdpa", lambda: lambda: (
        torch.ops.aten.scaled_dot_product_attention.default(qs, ks, vs, is_causal=True)))
    # torch.compile'd forms
    add("compiled_single_prefill", "compiled_attn", lambda: _compiled(
        lambda q, k, v: ca.single_prefill_with_kv_cache(q, k, v, causal=True),
        x["q1"], x["k1"], x["v1"]))
    add("compiled_single_prefill", "sdpa", lambda: _compiled(
        lambda q, k, v: f(q, k, v, is_causal=True), qs, ks, vs))
    return out


def _compiled(fn, *a):
    c = torch.compile(fn, fullgraph=True)
    c(*a)
    return lambda: c(*a)


# GPU cycles the run() cases' calls queue behind (~0.8 s: longer than the calls take to issue)
SLEEP = 1_500_000_000
# cases timed as wall time with the GPU idle: a plan() reads its index arrays on the host (a
# copy that waits for the GPU), so it cannot queue behind a sleeping GPU; a step's time then
# holds its previous step's kernels too (a few microseconds each at these sizes, for every
# provider alike)
PLAN_CASES = frozenset({"ragged_plan", "paged_plan", "pod_plan", "batch_pod_plan",
                        "paged_step", "pod_step", "decode_step", "chunk_step",
                        "mixed_step", "batch_pod_step", "cut_step"})


def host_us(fn, calls: int, sleep: int = SLEEP) -> float:
    """Host microseconds per call of fn, calls queued behind a GPU sleeping sleep cycles (0:
    no sleep, so the wall time of calls that wait for the GPU themselves)."""
    torch.cuda.synchronize()
    if sleep:
        torch.cuda._sleep(sleep)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results JSON to write")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median kept)")
    ap.add_argument("--calls", type=int, default=200, help="calls queued per timing")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's rows")
    ap.add_argument("--no-fi-pod", action="store_true",
                    help="leave out FlashInfer's POD (its JIT build takes minutes where it is "
                         "not cached)")
    ap.add_argument("--fi-single-backend", default="auto",
                    help="FlashInfer single prefill's backend (auto: its default, fa3 on Hopper)")
    ap.add_argument("--profile", action="store_true",
                    help="also print a cProfile of our calls (where the host time goes)")
    args = ap.parse_args(argv)
    provs = providers(args)
    if args.profile:
        _profile(provs)
    times: dict = {k: [] for k, v in provs.items() if callable(v)}
    for k in list(times):  # warm: compiles, first-call recording
        try:
            for _ in range(5):
                provs[k]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            provs[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()
            del times[k]
    from compiled_attn.ops.launch import recordings

    recs = dict.fromkeys(times, 0)
    for r in range(args.rounds):
        for k in times:
            before = recordings()
            times[k].append(host_us(provs[k], args.calls, 0 if k[0] in PLAN_CASES else SLEEP))
            recs[k] += recordings() - before
    rows = assemble(provs, times, {k: n / (args.rounds * args.calls) for k, n in recs.items()})
    doc = dict(environment(), cpu=_cpu_model(), rows=rows,
               fi_single_backend=None if args.no_flashinfer else args.fi_single_backend)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    _plot(doc, args.out.with_suffix(".png"))
    print(table(rows))


def assemble(provs: dict, times: dict, recordings: dict | None = None) -> list[dict]:
    """The rows: provs maps (case, provider) to its call, or to the reason it has none (text);
    times maps the timed ones to their per-round host us; recordings the timed ones to ours'
    recordings per call (kept on ours' rows). On ours, ratio_vs_<peer> compares medians and
    best_ratio_vs_<peer> the best rounds (a busy host slows whole rounds of every provider;
    the best round is the least disturbed)."""
    rows = []
    for (case, prov), v in provs.items():
        row = dict(suite="host", case=case, provider=prov, median_ms=None, tflops=None)
        if (case, prov) in times:
            t = times[case, prov]
            row.update(host_us=statistics.median(t), host_us_best=min(t), host_us_rounds=t,
                       status="ok")
            if prov == "compiled_attn" and recordings is not None:
                row["recordings_per_call"] = recordings[case, prov]
        else:
            row.update(status="failed" if "Error" in v else "unavailable", error=v)
        rows.append(row)
    for row in rows:
        if row["provider"] == "compiled_attn" and row.get("host_us"):
            for peer in rows:
                if peer["case"] == row["case"] and peer is not row and peer.get("host_us"):
                    row[f"ratio_vs_{peer['provider']}"] = peer["host_us"] / row["host_us"]
                    row[f"best_ratio_vs_{peer['provider']}"] = (peer["host_us_best"]
                                                                / row["host_us_best"])
    return rows


def table(rows: list[dict]) -> str:
    """The printed summary: host us (median, best round) and ours' ratios (peer / ours,
    medians; the best rounds' in brackets)."""
    lines = [f"{'case':26} {'provider':14} {'host us':>8} {'best':>7}  ratios (peer / ours)"]
    for row in rows:
        ratios = " ".join(f"{k[9:]}={v:.2f} ({row['best_' + k]:.2f})" for k, v in row.items()
                          if k.startswith("ratio_vs_"))
        us = (f"{row['host_us']:8.1f} {row['host_us_best']:7.1f}" if row.get("host_us")
              else "       -       -")
        rec = (f" recorded/call={row['recordings_per_call']:.2f}"
               if "recordings_per_call" in row else "")
        lines.append(f"{row['case']:26} {row['provider']:14} {us}  "
                     f"{ratios or row.get('error', '')}{rec}")
    return "\n".join(lines)


def _profile(provs):
    import cProfile
    import pstats

    for (case, prov), fn in provs.items():
        if prov != "compiled_attn" or not callable(fn):
            continue
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_500_000_000)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"=== {case}")
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)


def _plot(doc, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in doc["rows"] if r.get("host_us")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.8 / len(provs)
    for i, p in enumerate(provs):
        xs, ys = [], []
        for j, c in enumerate(cases):
            r = next((r for r in rows if r["case"] == c and r["provider"] == p), None)
            if r:
                xs.append(j + i * w)
                ys.append(r["host_us"])
        ax.bar(xs, ys, w, label=p)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))], cases, rotation=20, ha="right")
    ax.set_ylabel("host us per eager call (lower is better)")
    ax.set_title(f"host time per call, {doc['gpu']}, {doc['cpu']}, {doc['date'][:10]}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
