"""The launch policy's settings: one object the launch decision (ops.choose) reads.

The kernels' launchers (prefill_kernel, prefill_gluon), compiled_attn's plan() and the traced
dispatch (compiled_attn.ops.dispatch) decide from a call's shapes, strides, dtypes and options
which kernel, tile, K/V path and grid run it; the switches and thresholds those decisions take
live here, on ``POLICY``, rather than as module globals. Tests and benchmark variants change
them for a scope with ``override(...)`` (or pytest's monkeypatch.setattr on POLICY). Every
change bumps ``version()``, which the bound-launch cache (launch.py) keys on, so no launch
decided under one setting is replayed under another.
"""

from __future__ import annotations

import contextlib
import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class Policy:
    """The settings (attributes); setting one bumps the version."""

    _version = 0

    def __init__(self):
        # The Gluon Hopper kernel for the launches in its scope (choose._gluon_scope).
        self.use_gluon = True
        # Tensor descriptors for contiguous K/V in the Triton kernel (per program or on the host).
        self.use_tma = True
        # Host-built descriptors (TMA 2 and the Gluon kernel) for eager launches.
        self.host_tma = True
        # Eager launches below this many FLOPs skip whole-tensor descriptors: their host cost
        # outlasts the kernel there. With bound launches the two paths cost the host alike, and
        # launches of 19-34 GFLOP ran 1.33-1.40x faster with descriptors; at 0.5-17 GFLOP the
        # paths were within this run's noise (benchmarks/NOTES.md, 2026-11-28). The interpreter
        # has no such cost: CI runs the descriptor paths at any size.
        self.host_tma_min_flop = 0 if INTERPRET else 1e10
        # Per-program descriptors only for mean key lengths above this (shorter ranges do not
        # amortise them).
        self.tma_min_kv = 0 if INTERPRET else 1024
        # Tile heights whose whole-tensor descriptors may take the persistent grid (TMA 3).
        self.persist_tma = frozenset({64})
        # POD launches whose parts are in its scope run on the Gluon kernel's persistent work
        # list (choose.pod_gluon); off: the Triton kernel's POD launch.
        self.pod_gluon = True
        # ...that Gluon launch also where the decodes' pages are gathered (pages of 1-7 keys:
        # both parts' K / V then gathered, a one-page prefill cache as one page); off: such
        # POD calls run their parts apart (choose.pod_apart_any_size).
        self.pod_gather = True
        # POD calls whose decodes would take less than this share of the prefill's time run
        # as two launches, each part on its own path (choose.pod_apart), where the prefill
        # alone reads the pages the fused launch reads (BatchPOD). 0: always fused.
        self.pod_apart_balance = 0.05
        # ...times this where the prefill alone reads contiguous k / v on its own tiles (POD):
        # the fused launch's 64-row paged tiles ran a p8192 prefill ~1.2x slower, so the
        # decodes must take about its time to repay fusing (page 16, fused over apart, at
        # decode bytes over the prefill's counted as bytes: 0.07-0.59 -> 0.83-0.95x,
        # 1.17 -> 1.02-1.03x, 2.3-9.4 -> 1.04-1.14x; benchmarks/NOTES.md, 2026-11-29).
        self.pod_dense_apart_factor = 20.0
        # ...or this where that prefill computes under pod_dense_apart_min_flops: smaller ones
        # lose less on the fused launch's tiles. GQA 64/8 p2048 (6.9e10 FLOPs) beside 16 x 4k
        # decodes (their bytes 0.58 of its counted as bytes) ran fused 1.04-1.12x faster than
        # apart in two runs, beside 16 x 1k (0.15) 0.98-1.05x (H200, benchmarks/NOTES.md,
        # 2026-11-30); p8192 (5.5e11 and up) keeps the factor above.
        self.pod_dense_small_apart_factor = 5.0
        self.pod_dense_apart_min_flops = 2e11
        # ...times this instead where the fused launch also gathers both parts (decodes on
        # pages of 1-7 keys): it reads the prefill by cp.async rows, ~1.4x its own launch
        # (page 1, fused over apart at the ratio: 0.15 -> 0.74x, 1.17 -> 0.84x and 0.90x,
        # p2048 at 2.35 -> 1.04-1.06x, 4.7 -> 1.13x and 1.06x, 9.4 -> 1.06x; benchmarks/NOTES.md,
        # 2026-11-29) ...
        self.pod_gather_apart_factor = 34.0
        # ...and apart whatever the ratio where that gathered prefill computes more than this
        # many FLOPs: the gathered read costs more the larger the prefill (every fused p8192
        # page-1 row, 5.5e11 FLOPs and up, lost at ratios 4.7-9.4: 0.955-0.994x; the p2048
        # rows, up to 6.9e10, won). 0: no such limit.
        self.pod_gather_max_prefill_flops = 2e11
        # ...and apart where the decodes alone would take the few-programs ring
        # (few_programs_stages, below; the fused launch's decode items do not) and the prefill
        # counted as bytes is under this share of the decodes' bytes (page 16, POD over apart,
        # graph: p256 + 16 x 32k at shares 0.0017 / 0.0033 (GQA 32/8 / 64/8) 0.975x / 0.96x;
        # p256 + 16 x 4k at 0.013 / 0.027 1.02x / 0.98x; p2048 + 16 x 32k at 0.11 1.02x;
        # benchmarks/NOTES.md, 2026-11-29). 0: no such rule.
        self.pod_ring_apart_share = 0.006
        # ...and, where a CUDA graph captures the call (a second launch costs its replays no
        # host time), apart where the decodes alone would take that ring, the fused launch's
        # items (before any decode key chunks) exceed one wave of resident programs, and the
        # prefill counted as bytes is under this share of the decodes' bytes, whatever the
        # sizes and pages (graph, POD over apart: GQA 64/8 p256 + 16 x 4k at 0.027, 384 items
        # on 264 programs, 0.956-0.968x on page 16 and 1 in four runs; GQA 32/8 at 0.013, 256
        # items, 1.01-1.02x; GQA 64/8 p256 + 16 x 1k at 0.108 1.04-1.11x; benchmarks/NOTES.md,
        # 2026-11-29). 0: no such rule.
        self.pod_ring_graph_apart_share = 0.05
        # ...and only where the two parts compute at least this many bytes' worth (about 100 us
        # at 4 TB/s), so that the second launch's host cost stays hidden.
        self.pod_apart_min_bytes = 4e8
        # ...but this where a CUDA graph captures the call (its replays pay no host time for a
        # second launch) and the fused launch would gather both parts (page 1: its prefill
        # ~1.4x its own launch): p2048 + 16 x 1k replayed in 120.5 us fused against 110.0 us
        # apart (GQA 32/8; eager, fused won 1.09x). Captured launches on boxes keep the floor:
        # there p2048 + 16 x 1k ran 2.6% faster fused (benchmarks/NOTES.md, 2026-11-29).
        self.pod_gather_graph_min_bytes = 0.0
        # The prefill's FLOPs per decode byte in equal time: Hopper's attained D128 attention
        # rate over its copy bandwidth (~600 TFLOP/s / ~4 TB/s).
        self.pod_flop_per_byte = 150.0
        # Traced calls that the Gluon kernel would take stay opaque (ops.dispatch).
        self.graph_gluon = True
        # CUDA-graph plans whose first plan is decode rows take the 64-row tile (choose.tile's
        # decode rows) and keep it for every re-plan: 128 x 4k decodes replay in 495 us
        # instead of 560 (H200, benchmarks/NOTES.md, 2026-11-28).
        self.graph_decode_tile = True
        # Paged plans of decode rows that a split plan would split (few requests, long keys)
        # cut each request's pages into chunk requests on the Gluon kernel, then merge
        # (choose.decode_chunk_sms; CUDA-graph plans as their first plan): "gluon" where that
        # kernel reads them, "always" on any device the kernels run (tests: the interpreter
        # runs them on the Triton kernel), "off". 1 x 32k decodes replay in 47 us instead of
        # 76 (H200, benchmarks/NOTES.md, 2026-11-28).
        self.decode_chunks = "gluon"
        # ...each chunk at least this many keys of the longest request.
        self.decode_chunk_min_keys = 512
        # ...where the batch's programs (a request and KV head each) fill at most this much of
        # one wave of resident 64-row programs (two a SM): 0.25, at most half the SMs.
        self.decode_chunk_fill = 0.25
        # Gluon launches of paged K/V on the 64-row D 128 tile whose requests take a tile each
        # (decode rows), in at most one program a SM (few requests), ring their K / V slots
        # this many deep instead of the tile's two (0: the tile's own): 16 x 4k decodes
        # replayed in 70.5 us instead of 74.0 (page 16), 73.5 instead of 75.3 (page 1); four
        # deep 72.0, 128-key slots 71.0; 128 x 1k (two programs a SM) lost 1% three deep
        # (H200, benchmarks/NOTES.md, 2026-11-29).
        self.few_programs_stages = 3
        # Those launches, and POD's decodes side by side (one program a SM too), run the swapped
        # products instead (prefill_gluon.SWAP_TILE: the keys as the wgmma's M, a request's
        # query rows as its N, 128-key slots two deep) where the launch's rows average at most
        # SWAP_ROWS a request (choose._swap_rows): a program read 64 GB/s against the 64-row
        # tile's 52 four deep, 16 x 1k decodes replayed in 23.8 us instead of 26.4 (page 16,
        # H200, benchmarks/NOTES.md, 2026-11-30). False: the deeper rings above.
        self.decode_swap = True
        # POD's decodes, where few requests leave most of the fused launch's resident slots to
        # the prefill, cut into key chunks (one-row chunk requests, then a merge) so that their
        # items even out the prefill's tail (choose.pod_chunk_sms, choose.pod_cut): "gluon"
        # where the fused launch is the Gluon kernel's, "always" on any device the kernels run
        # (tests: the interpreter runs the Triton POD launch), "off". p2048 + 16 x 32k replayed
        # in 547 us instead of 636, p2048 + 16 x 4k in 134 instead of 151 (H200,
        # benchmarks/NOTES.md, 2026-11-29).
        self.pod_chunks = "gluon"
        # The fused Gluon POD launch runs its decodes' items on the swapped products too
        # (prefill_gluon.PodConfig.SWAP_D, choose.pod_swap_decodes: the 64-row tile at D 128,
        # the rows as _swap_rows allows), the prefill's tiles on the tile's own: a decode item
        # then computes SWAP_ROWS rows instead of the tile's 64, leaving the SM's tensor cores
        # and exponentials to a prefill tile beside it: 1.00-1.06x on page-16 grid cases
        # (p256 + 16 x 4k 1.05x, p2048 + 16 x 4k 1.03-1.04x, p2048 + 256 x 1k GQA 64/8 1.04x;
        # never below 0.998x; H200, benchmarks/NOTES.md, 2026-11-30). Not on gathered pages
        # (page 1: 0.96x). False: every item on the tile's own.
        self.pod_decode_swap = True
        # ...where the decodes' programs (a request and KV head each) fill at most this much of
        # one wave of resident 64-row programs (two a SM): 0.5, at most one a SM; into chunks
        # for two such waves, each at least pod_chunk_min_keys keys of the longest request, and
        # only where that makes pod_chunk_min_chunks chunks or more: two did not repay the
        # gather and merge (p2048 + 16 x 2k: 115 us against 110 uncut; BatchPOD + 16 x 4k 3-6%
        # slower in two chunks than in four)...
        self.pod_chunk_fill = 0.5
        self.pod_chunk_min_keys = 1024
        self.pod_chunk_min_chunks = 4
        # ...and only where the prefill's tiles fill a wave of resident programs or more (the
        # decodes then start late), or the longest decode has at least this many keys: beside
        # a smaller prefill, short decodes lost more to the gather and merge launches than the
        # chunks gained (p256 + 16 x 4k: 82 against 78 us, with the gather the row map has
        # since replaced; not re-measured).
        self.pod_chunk_long_keys = 16384
        # ...there, chunks of at most this many keys (0: the waves alone decide): beside p2048,
        # 16 x 32k in 8 chunks ran 1.5-3.6% faster than in the waves' 4 (four grid cases; p256
        # + 16 x 32k on page 1 0.7% slower; benchmarks/NOTES.md, 2026-11-29).
        self.pod_chunk_long_size = 4096
        # POD calls whose prefill, counted as bytes (pod_flop_per_byte), is at least this
        # share of the decodes' bytes run their parts side by side (choose.pod_side): two
        # launches on two streams, the decodes' first on a high-priority stream with their
        # grid capped at pod_side_sms of the SMs, one program a SM, so that the prefill's tiles
        # take the other SMs at once. Over the better of the fused launch and apart, graph /
        # eager, the ten p8192 grid cases this rule takes on page 16 (shares 0.86-6.8): 0.99-1.09x
        # / 0.98-1.09x, median 1.02x / 1.03x (H200, benchmarks/NOTES.md, 2026-11-30, with the
        # dev probes' larger gains on other machines); p4096 / p2048 + 128 x 4k (0.43 / 0.11),
        # p8192 + 128 x 32k (0.21) lost 0.76-0.83x. Page 1 (gathered decodes) alike: the ten
        # p8192 cases 1.02-1.16x graph, 0.96-1.20x eager (two earlier runs: GQA 64/8 0.98-1.08x,
        # + 128 x 1k 0.95-1.04x). 0: never.
        self.pod_side_share = 0.75
        # ...only where the decodes read at least this many bytes (about 100 us at 4 TB/s)...
        self.pod_side_min_bytes = 4e8
        # ...and the prefill counts at least this many (about 500 us): GQA 64/8 p2048 + 128 x 1k
        # (4.6e8 and 5.4e8 bytes) lost 0.84x / 0.87x to its fused launch...
        self.pod_side_min_prefill_bytes = 2e9
        # ...with their grid capped at this share of the SMs (66 of 132: 1.02-1.03x of 96 in
        # two of the three cases above) ...
        self.pod_side_sms = 0.5
        # ...and their K / V ring this deep (0: the tile's own; 64-key slots on the 64-row tile:
        # four deep reads ~45-50 GB/s a program, two deep ~35).
        self.pod_side_stages = 4
        # Decode-heavy calls, whose prefill counts under pod_side_share but at least this share
        # of the decodes' bytes, run side by side too, the decodes on their share of both
        # parts' bytes, at most pod_side_sms_max of the SMs: p8192 + 128 / 256 x 32k (shares
        # 0.11-0.43) replayed 1.04-1.19x faster than the better of fused and apart at the
        # share this gives (0.70 or 0.8), 0.84-1.06x at half the SMs (H200,
        # benchmarks/NOTES.md, 2026-11-30). 0: never.
        self.pod_side_heavy_share = 0.1
        self.pod_side_sms_max = 0.8
        # A POD call whose fused launch would gather both parts' K / V (pages of 1-7 keys:
        # choose.pod_fused_gathers) reads its contiguous prefill k / v by TMA boxes on the
        # prefill's own launch side by side, so there it pays under the floors above too: where
        # the prefill counted as bytes is at least pod_side_share of the decodes' bytes and at
        # least pod_side_gather_min_prefill_bytes, and the decodes read at least
        # pod_side_gather_min_bytes, the decodes on their share of both parts' bytes, at least
        # pod_side_gather_sms_min of the SMs. Page 1, over the better of fused and apart,
        # graph / eager: p2048 + 16 x 1k / 16 x 4k 1.06-1.12x / 1.02-1.14x at the best of the
        # shares 0.25, 0.5, 0.75 (0.25 / 0.5 GQA 32/8, 0.25 GQA 64/8), GQA 64/8 p2048 + 128 x 1k
        # 1.03x / 1.02x at half the SMs; p256 + 16 x 4k (share 0.01-0.03) 0.87-0.91x graph, and
        # GQA 32/8 p2048 + 128 x 1k (0.43) 0.97x (H200, benchmarks/NOTES.md, 2026-12-01).
        self.pod_side_gather_min_prefill_bytes = 2e8
        self.pod_side_gather_min_bytes = 6e7
        self.pod_side_gather_sms_min = 0.25
        # Plain eager calls skip torch's dispatcher (compiled_attn.op_call).
        self.direct = True
        # Plain eager calls replay their bound launches (launch.py).
        self.bound_launches = True

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        Policy._version += 1

    def settings(self) -> dict:
        return dict(vars(self))


POLICY = Policy()

# Settings that fix a POD call's launch whatever its sizes, for tests, probes and benchmark
# variants (``override(**POD_FUSED)``): one fused launch, the two parts apart, or side by side
# (where the decodes' own launch is the one choose.pod_side caps; else as the sizes say).
POD_FUSED = {"pod_apart_balance": 0.0}
POD_APART = {"pod_apart_balance": float("inf"), "pod_apart_min_bytes": 0.0,
             "pod_side_share": 0.0}
POD_SIDE = {"pod_side_share": 1e-30, "pod_side_min_bytes": 0.0, "pod_side_min_prefill_bytes": 0.0}


def version() -> int:
    """Bumped by every change of a setting."""
    return Policy._version


def touch() -> None:
    """Bump the version (forget every bound launch): after a change the settings cannot see,
    such as a test replacing a launcher function."""
    Policy._version += 1


@contextlib.contextmanager
def override(**settings):
    """Change settings for a scope; unknown names raise AttributeError."""
    saved = {}
    for name, value in settings.items():
        if not hasattr(POLICY, name):
            raise AttributeError(f"the launch policy has no setting {name!r}; settings: "
                                 f"{sorted(POLICY.settings())}")
        saved[name] = getattr(POLICY, name)
    try:
        for name, value in settings.items():
            setattr(POLICY, name, value)
        yield POLICY
    finally:
        for name, value in saved.items():
            setattr(POLICY, name, value)
