"""A small subset of kernel cases for compute-sanitizer (run on the GPU machine):

    compute-sanitizer --tool memcheck python3 -m dev.gpu_memcheck [--only pod,head_dims]

Covers every KV addressing mode (dense, ragged, paged with page 1/5/16 and both page-table read
paths, small pages on 256-row tiles and gathered by the Gluon kernel's producer warp group), K/V
through tensor descriptors (dense and ragged, 64- and 128-row tiles; the Gluon Hopper kernel),
custom masks, padded work items, empty requests and split-KV with its merge kernel (padded as
CUDA-graph plans pad both lists), head dims 80 / 112 / 160 / 512, and POD (the Gluon POD launch
on a one-page and a paged prefill, with pages read by boxes and gathered; the Triton POD launch
on the one-page cache's fixed page-size constexpr and on page-1 decodes), at small sizes; each
result is also checked against the float64 reference. Section ``wrappers`` runs the GPU tests
of the paths that live in the wrappers' run() (POD's decode key chunks, eager and in CUDA-graph
mode; decode rows of few requests), in this process.
Exits non-zero on a mismatch."""

import sys

import pytest
import torch

from compiled_attn.ops import choose
from compiled_attn import ops
from compiled_attn.ops import prefill_kernel as K
from compiled_attn.ops.schedule import build_split_work, build_work
from compiled_attn.ops.policy import override
from tests.kernel_cases import check as _check, check_pod as _check_pod
from tests.kernel_cases import (force_kv_path, make_case, one_page_prefill, params, pod_decodes,
                                retile)

_DONE = [0]


def _reported(fn):
    """fn, printing a line after each case (a run cut short by a time limit shows how far it
    got: the subset compiles ~100 kernels, slowly under compute-sanitizer)."""
    def run(*args, **kwargs):
        fn(*args, **kwargs)
        _DONE[0] += 1
        print(f"case {_DONE[0]} checked", flush=True)
    return run


check, check_pod = _reported(_check), _reported(_check_pod)

# An empty request, a request with no keys, odd lengths, one request longer than a tile.
QO, KV = [37, 0, 150, 3], [80, 9, 150, 0]


def _pad():
    """Padded work rows: request -1, and a first row past the request's rows."""
    return torch.tensor([[-1, 0], [1, 4096]], dtype=torch.int32, device="cuda")


def addressing():
    """Every KV addressing mode, custom masks, a 64-row paged tile, small pages (256-row Triton
    tiles and the Gluon producer's gather)."""
    pad = _pad()
    for kind in ("ragged", "paged"):
        for page in (1, 5, 16):
            for mode in ("causal", "custom"):
                c = make_case(kind, QO, KV, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                              device="cuda", page_size=page, custom_mask=mode == "custom",
                              seed=page)
                c.work = torch.cat([c.work, pad])
                p = params(mask_mode=ops.MASK_CUSTOM if mode == "custom" else ops.MASK_CAUSAL,
                           head_dim=128)
                check(c, p)
            if kind == "ragged":
                break
    s = make_case("single", [100], [260], hq=4, hkv=1, dqk=64, dtype=torch.float16,
                  device="cuda", layout="HND")
    check(s, params())
    # The tile height the misaligned-address report came from (BLOCK_M 64, paged).
    orig, orig_cfg = choose.tile, choose.config
    choose.tile = lambda *a, **kw: 64
    choose.config = lambda *a: dict(BLOCK_N=64, num_warps=4, num_stages=2, TMA=False)
    try:
        c = make_case("paged", [64, 300], [128, 300], hq=16, hkv=16, dqk=128,
                      dtype=torch.bfloat16, device="cuda", page_size=16)
        c.block_m = 64
        c.work = build_work([64, 300], 1, 64, "cuda")
        check(c, params(head_dim=128))
    finally:
        choose.tile, choose.config = orig, orig_cfg
    # Small pages on 256-row tiles of 16 warps (per-key gather and whole pages), padded rows.
    for page in (1, 4, 5):
        qo, kv = [300, 0, 37], [700, 9, 80]
        c = make_case("paged", qo, kv, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                      device="cuda", page_size=page, seed=40 + page)
        c.block_m = K.SMALL_PAGE_BLOCK_M
        c.work = torch.cat([build_work(qo, 4, c.block_m, "cuda", kv_lens=kv), pad])
        check(c, params(head_dim=128))
    # Small pages gathered by the Gluon kernel's producer warp group (pages 1 and 3, both tile
    # heights; 128 rows on short requests the short tile, prefill_gluon.GATHER_SHORT_TILE): slots
    # past kv_len hold copies of the last key's row, no key past kv_len is read.
    for page in (1, 3):
        for bm, kv in ((64, [700, 9, 80]), (128, [700, 9, 80]), (128, [2700, 9, 1500])):
            qo = [300, 0, 37]
            c = make_case("paged", qo, kv, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                          device="cuda", page_size=page, seed=50 + page)
            c.block_m = bm
            c.work = build_work(qo, 4, bm, "cuda", kv_lens=kv)
            check(c, params(head_dim=128))


def descriptors():
    """K/V through tensor descriptors on every path, split plans."""
    pad = _pad()
    # Tensor descriptors at small sizes, built on the host, once per persistent program, and
    # per work item (the short-KV rule would pick pointer loads for the last): ragged with both
    # tile heights, windows and padded items, a dense batch, and a split plan. "gluon": the
    # Gluon kernel takes the causal ragged cases (both tiles, a partial last key tile and the
    # padded items) and the dense batch; windows and split plans stay on Triton's host path.
    for path in ("gluon", "host", "persistent", "device"):
        with pytest.MonkeyPatch.context() as m:
            force_kv_path(m, path)
            for bm in (64, 128):
                for mode in ("causal", "window"):
                    c = make_case("ragged", QO, KV, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                                  device="cuda", seed=bm)
                    c.block_m = bm
                    c.work = torch.cat([build_work(QO, 4, bm, "cuda", kv_lens=KV), pad])
                    check(c, params(head_dim=128, **({"window_left": 40} if mode == "window"
                                                     else {})))
            if path == "gluon":
                # pages of whole key tiles and of 8 and 16 keys (a box each, warp-specialized),
                # both tile heights (the ragged cases above: 64-row tiles warp-specialized)
                for bm in (64, 128):
                    for page in (8, 16, 64):
                        c = make_case("paged", QO, KV, hq=8, hkv=2, dqk=128,
                                      dtype=torch.bfloat16, device="cuda", page_size=page,
                                      seed=bm + page)
                        c.block_m = bm
                        c.work = build_work(QO, 4, bm, "cuda", kv_lens=KV)
                        check(c, params(head_dim=128))
                # D 64 and D 256 on their own 128-row tiles (TILES by head dim): ragged with
                # padded items, and whole-tile pages
                for d in (64, 256):
                    for kind in ("ragged", "paged"):
                        c = make_case(kind, QO, KV, hq=8, hkv=2, dqk=d, dtype=torch.bfloat16,
                                      device="cuda", page_size=128, seed=d)
                        c.block_m = 128
                        c.work = torch.cat([build_work(QO, 4, 128, "cuda", kv_lens=KV), pad])
                        check(c, params(head_dim=d))
            s = make_case("single", [100], [260], hq=4, hkv=2, dqk=128, dtype=torch.bfloat16,
                          device="cuda")
            check(s, params(head_dim=128))
            qo, kv = [3, 1, 40, 0, 2], [3000, 970, 2600, 5, 1]
            for kind in ("ragged", "paged"):
                c = make_case(kind, qo, kv, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                              device="cuda", page_size=16, seed=31)
                c.work, c.merge = build_split_work(qo, kv, 4, c.block_m, 2, num_sms=132,
                                                   min_keys_per_chunk=256)
                assert int(c.merge[:, 3].max()) > 2
                # a CUDA-graph plan's padding: work rows (request -1, chunk 0 of 1) and merge
                # rows of request -1 (the merge kernel returns before any read)
                c.work = torch.cat([c.work, torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)])
                c.merge = torch.cat([c.merge, torch.tensor([[-1, 0, 0, 0]] * 2,
                                                           dtype=torch.int32)])
                c.work, c.merge = c.work.cuda(), c.merge.cuda()
                check(c, params(head_dim=128))


def head_dims():
    """Head dims 80 / 112 / 160 / 512 on every K/V path."""
    pad = _pad()
    # Head dims between powers of two (tiles padded, every load and store masked on the dim)
    # and 512, in tensors whose rows are exactly d wide (a read past the dim of the last row
    # leaves the allocation): every K/V path of ragged batches (descriptors whose box is wider
    # than the dim), pages of 1 and 16 keys, RoPE's half loads, and split-KV with its merge.
    qo, kv = [3, 1, 40, 0, 2], [3000, 970, 2600, 5, 1]
    for d in (80, 112, 160, 512):
        for path in ("host", "persistent", "device", "pointers"):
            if d > 128 and path != "pointers":
                continue  # no descriptors past D 128: every path is the pointer loads
            with pytest.MonkeyPatch.context() as m:
                force_kv_path(m, path)
                c = make_case("ragged", QO, KV, hq=8, hkv=2, dqk=d, dtype=torch.bfloat16,
                              device="cuda", seed=d)
                c.work = torch.cat([c.work, pad])
                check(c, params(head_dim=d))
        for page in (1, 16):
            c = make_case("paged", QO, KV, hq=8, hkv=2, dqk=d, dtype=torch.bfloat16,
                          device="cuda", page_size=page, seed=d + page)
            check(c, params(head_dim=d, pos_encoding_mode=ops.POS_ROPE_LLAMA if page == 16
                            else ops.POS_NONE))
        c = make_case("ragged", qo, kv, hq=8, hkv=2, dqk=d, dtype=torch.bfloat16,
                      device="cuda", seed=d + 2)
        c.work, c.merge = build_split_work(qo, kv, 4, c.block_m, 2, num_sms=132,
                                           min_keys_per_chunk=256)
        c.work, c.merge = c.work.cuda(), c.merge.cuda()
        check(c, params(head_dim=d))


def pod():
    """Both POD launches."""
    # POD: both launches, each part against the float64 reference. The one-page prefill cache
    # (rows read past kv_len would leave the allocation), a paged prefill with a request
    # without rows, decodes without keys; gathered pages (1 and 3 keys: both parts gathered in
    # the Gluon POD launch, the one-page prefill cache as one page), and page-1 decodes on the
    # Triton POD launch (pod_gather off).
    dec_kv = [900, 1, 0, 17, 2049]

    def tiled(c, qo_lens, kv_lens, block_m):  # the case's work list on another tile height
        return retile(c, block_m, qo_lens, kv_lens, 4)

    for gluon, bm in ((True, 128), (True, 64), (False, 128)):
        with override(pod_gluon=gluon):
            p = params(ops.MASK_CAUSAL, head_dim=128)
            check_pod(tiled(one_page_prefill(300, 701, 8, 2, seed=60), [300], [701], bm),
                      tiled(pod_decodes(dec_kv, 8, 2, 16, seed=61), [1] * 5, dec_kv, bm), p,
                      dict(p, sm_scale=0.07))
            check_pod(tiled(make_case("paged", [300, 0, 129], [700, 6, 129], 8, 2, 128,
                                      dtype=torch.bfloat16, device="cuda", page_size=16,
                                      seed=62), [300, 0, 129], [700, 6, 129], bm),
                      tiled(pod_decodes(dec_kv, 8, 2, 16, seed=63), [1] * 5, dec_kv, bm), p, p)
    p = params(ops.MASK_CAUSAL, head_dim=128)
    for page in (1, 3):
        check_pod(tiled(one_page_prefill(300, 701, 8, 2, seed=66), [300], [701], 64),
                  tiled(pod_decodes(dec_kv, 8, 2, page, seed=67), [1] * 5, dec_kv, 64), p, p)
        check_pod(tiled(make_case("paged", [300, 0, 129], [700, 6, 129], 8, 2, 128,
                                  dtype=torch.bfloat16, device="cuda", page_size=page, seed=68),
                        [300, 0, 129], [700, 6, 129], 64),
                  tiled(pod_decodes(dec_kv, 8, 2, page, seed=69), [1] * 5, dec_kv, 64), p, p)
    with override(pod_gather=False):
        check_pod(one_page_prefill(77, 200, 8, 2, seed=64),
                  pod_decodes(dec_kv, 8, 2, 1, seed=65), p, p)


# The GPU tests whose paths live in the wrappers' run() rather than in one kernel launch:
# POD's decode key chunks (the chunked launch through its row map and the merge; fused, uncut and
# apart, page 16 and 1; CUDA-graph replays of eager plans and of a use_cuda_graph=True plan
# re-planned), decode rows on the 64-row tile (few requests: the three-slot K/V ring), and
# captured persistent launches on a counter slot zeroed once (replayed on new inputs).
WRAPPER_TESTS = ["tests/test_launch_gpu.py::test_captured_persistent_launch_needs_no_zeroing",
                 "tests/test_pod_gluon_gpu.py::test_pod_wrapper_matches_reference",
                 "tests/test_pod_gluon_gpu.py::test_pod_decode_chunks_replay_exactly",
                 "tests/test_pod_gluon_gpu.py::test_pod_decode_chunks_in_cuda_graph_mode",
                 "tests/test_prefill_kernel_gpu.py::test_decode_rows_64_row_tiles"]


def wrappers():
    """WRAPPER_TESTS through pytest, in this process (so under compute-sanitizer when it runs
    this script); a failing test fails the section."""
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", *WRAPPER_TESTS])
    if rc != 0:
        raise SystemExit(f"section wrappers: pytest exited {rc}")
    _DONE[0] += 1


SECTIONS = {"addressing": addressing, "descriptors": descriptors, "head_dims": head_dims,
            "pod": pod, "wrappers": wrappers}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    names = ap.parse_args(argv).only.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; pick from {list(SECTIONS)}")
    for name in names:
        print(f"section {name}", flush=True)
        SECTIONS[name]()
    torch.cuda.synchronize()
    print(f"memcheck subset: {_DONE[0]} cases checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
