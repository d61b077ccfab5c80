"""A curated grid of launches and what the launchers decide for each, on CPU tensors standing in
for an sm_90 GPU's (an H100 description: 132 SMs).

``observe(case)`` runs the eager launcher (prefill_kernel.launch_single / launch_ragged /
launch_paged) with every kernel launch intercepted, and returns the decision it took: the
kernel, the tile, the K/V path, stages and warps, the grid and split-KV, plus the plan's tile
heights (ops.choose.tile, with and without the longest key length) and the torch.compile
dispatch's answer (ops.dispatch.eager_gluon). tests/data/launch_decisions.json holds these
decisions as recorded from the launchers before the decision moved into ops.choose; run this
module (``python -m tests.launch_cases``) to write it again after a deliberate change.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from unittest import mock

import torch

from compiled_attn.ops import MASK_CAUSAL, MASK_CUSTOM, MASK_NONE
from compiled_attn.ops import choose, dispatch, launch
from compiled_attn.ops import prefill_kernel as pk
from compiled_attn.ops.policy import override

DATA = pathlib.Path(__file__).parent / "data" / "launch_decisions.json"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MASKS = {"none": MASK_NONE, "causal": MASK_CAUSAL, "custom": MASK_CUSTOM}
# (query tokens, key tokens) of each of the two requests
LENGTHS = {"short": (64, 96), "long": (4096, 8192)}
HKV = 4

# launch-policy overrides: single settings, and each forced K/V path
POLICIES = {
    "use_gluon=False": dict(use_gluon=False), "use_tma=False": dict(use_tma=False),
    "host_tma=False": dict(host_tma=False), "host_tma_min_flop=0": dict(host_tma_min_flop=0),
    "tma_min_kv=0": dict(tma_min_kv=0), "persist_tma=64,128": dict(persist_tma=frozenset({64, 128})),
    **{f"path={name}": settings for name, (_, settings) in choose.KV_PATHS.items()},
}

BASE = dict(kind="ragged", page=0, d=128, mask="causal", gqa=4, dtype="bf16", kv="long",
            split=False, policy=None)


def cases() -> list[dict]:
    """Each kind (dense, ragged, paged with pages of 1 / 4 / 16 keys) at short and long keys,
    alone and with one property changed."""
    changes = ([dict(d=d) for d in (64, 256, 96, 512)]
               + [dict(mask=m) for m in ("none", "custom")]
               + [dict(gqa=g) for g in (1, 7)]
               + [dict(dtype=t) for t in ("fp16", "fp32")]
               + [dict(split=True)]
               + [dict(policy=p) for p in POLICIES]
               + [dict(mask="none", d=64), dict(d=256, mask="none")])
    out = []
    for kind, page in (("dense", 0), ("ragged", 0), ("paged", 1), ("paged", 4), ("paged", 16)):
        for kv in LENGTHS:
            for change in [{}] + changes:
                if kind == "dense" and change.get("split"):
                    continue  # single_prefill has no split plan
                out.append({**BASE, "kind": kind, "page": page, "kv": kv, **change})
    return out


def case_id(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items() if BASE.get(k) != v or k == "kind")


def _args(case: dict):
    """The op's arguments (its own order) and its name, on empty CPU tensors."""
    dt = DTYPES[case["dtype"]]
    d, hq = case["d"], HKV * case["gqa"]
    qo, kv = LENGTHS[case["kv"]]
    lens_q, lens_kv = [qo, qo // 2], [kv, kv // 2]
    nq, nk = sum(lens_q), sum(lens_kv)
    mask = MASKS[case["mask"]]
    params = (mask, -1, 0, d ** -0.5, 0.0, 0, 1.0, 1e4, 1.0, None)
    indptr_q = torch.tensor([0, lens_q[0], nq], dtype=torch.int32)
    mask_bits = torch.zeros(8, dtype=torch.uint8) if mask == MASK_CUSTOM else None
    if case["kind"] == "dense":
        q = torch.empty(1, qo, hq, d, dtype=dt)
        k, v = (torch.empty(1, kv, HKV, d, dtype=dt) for _ in range(2))
        return "single_prefill", (q, k, v, mask_bits, None, None, *params), None
    q = torch.empty(nq, hq, d, dtype=dt)
    block_m = choose.tile(d, d, case["gqa"], max(lens_kv), mask != MASK_NONE,
                          case["kind"] == "paged", page_size=case["page"], qo_lens=lens_q,
                          kv_dtype=dt)
    tiles = [-(-n * case["gqa"] // block_m) for n in lens_q]
    if case["split"]:
        work = torch.zeros(sum(tiles) * 2, 4, dtype=torch.int32)
        merge = torch.zeros(sum(tiles), 4, dtype=torch.int32)
    else:
        work, merge = torch.zeros(sum(tiles), 2, dtype=torch.int32), None
    mask_indptr = torch.zeros(3, dtype=torch.int32) if mask_bits is not None else None
    tail = (work, mask_bits, mask_indptr, None, None, block_m, *params, merge)
    if case["kind"] == "ragged":
        k, v = (torch.empty(nk, HKV, d, dtype=dt) for _ in range(2))
        return "batch_ragged_prefill", (q, k, v, indptr_q, indptr_q * 2, *tail), block_m
    page = case["page"]
    pages = [-(-n // page) for n in lens_kv]
    kc, vc = (torch.empty(sum(pages), page, HKV, d, dtype=dt) for _ in range(2))
    page_indptr = torch.tensor([0, pages[0], sum(pages)], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens_kv, pages)], dtype=torch.int32)
    indices = torch.arange(sum(pages), dtype=torch.int32)
    return "batch_paged_prefill", (q, kc, vc, indptr_q, page_indptr, indices, last,
                                   *tail), block_m


@contextlib.contextmanager
def hopper(device=choose.H100):
    """CPU tensors stand in for an sm_90 GPU's (``device``), eager and not capturing; every
    kernel launch is intercepted (yields the list of (kernel name, grid, arguments by name))."""
    seen = []

    def intercept(fn, grid, *args, **kwargs):
        named = dict(zip(fn.arg_names, args))
        named.update(kwargs)
        seen.append((fn.fn.__name__, tuple(grid), named))

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(choose, "device_of", lambda dev: device))
        stack.enter_context(mock.patch.object(choose, "eager_launch", lambda: True))
        stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing",
                                              lambda: False))
        stack.enter_context(mock.patch.object(launch, "run", intercept))
        stack.enter_context(mock.patch.object(launch, "run_direct", intercept))
        stack.enter_context(mock.patch.object(pk, "_ensure_allocator", lambda: None))
        yield seen


def _observed(seen) -> dict:
    """The decision fields of the first (prefill) launch, and the launches' kernels."""
    kernels = [name for name, _, _ in seen]
    if not seen:
        return dict(kernels=kernels)
    name, grid, a = seen[0]
    if name == "_gluon_fwd":  # (its named bundles: prefill_gluon.Source, Shape, ...)
        src, shape, sched = a["SOURCE"], a["SHAPE"], a["SCHEDULE"]
        return dict(kernels=kernels, grid=list(grid), BLOCK_M=shape.BLOCK_M,
                    BLOCK_N=shape.BLOCK_N, stages=shape.STAGES, warps=a["num_warps"],
                    persistent=bool(sched.PERSISTENT), paged=int(src.PAGED), ws=bool(sched.WS),
                    pingpong=bool(sched.PINGPONG), p_smem=bool(sched.P_SMEM),
                    boxes=int(src.BOXES), group=int(a["work_sizes"].dense_group))
    return dict(kernels=kernels, grid=list(grid), BLOCK_M=a["BLOCK_M"], BLOCK_N=a["BLOCK_N"],
                stages=a["num_stages"], warps=a["num_warps"], tma=int(a["TMA"]),
                split=bool(a["SPLIT"]), group=int(a["dense_group"]),
                host_descriptors=not isinstance(a["k_ptr"], torch.Tensor))


def observe(case: dict) -> dict:
    """The launcher's decision for ``case`` (module docstring), on an H100 description."""
    with override(**(POLICIES[case["policy"]] if case["policy"] else {})), hopper() as seen:
        name, args, block_m = _args(case)
        impl = {"single_prefill": pk.launch_single, "batch_ragged_prefill": pk.launch_ragged,
                "batch_paged_prefill": pk.launch_paged}[name]
        a, params = dispatch.bind(name, args)
        traced_opaque = dispatch.eager_gluon(name, args)
        kw = {k: a[k] for k in list(a)[:list(a).index("block_m") + 1]} if block_m else \
            {k: a[k] for k in ("q", "k", "v", "packed_mask", "alibi_slopes", "sinks")}
        if block_m:
            kw["merge"] = a["merge"]
        impl(*kw.values(), out_dtype=a["out_dtype"] or a["q"].dtype, **params)
        result = _observed(seen)
        if block_m:
            qo, kv = LENGTHS[case["kv"]]
            result["plan_block_m"] = block_m
            # as a CUDA-graph plan asks (its rows only with the policy's graph_decode_tile)
            result["graph_block_m"] = choose.tile(
                case["d"], case["d"], case["gqa"], None, case["mask"] != "none",
                case["kind"] == "paged", page_size=case["page"],
                qo_lens=[qo, qo // 2] if choose.POLICY.graph_decode_tile else None,
                kv_dtype=DTYPES[case["dtype"]])
        result["eager_gluon"] = traced_opaque
        return result


def record() -> dict:
    return {case_id(c): observe(c) for c in cases()}


if __name__ == "__main__":
    DATA.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}")
