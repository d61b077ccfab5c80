"""The launch decision: ``choose`` says how a prefill launch runs, from metadata alone.

One function answers, for a call's shapes, strides, dtypes, options and device (real, fake,
meta or traced tensors; the device as a ``Device`` description, so CPU tests pass an sm_90
one): which kernel (the Gluon Hopper kernel or the Triton kernel), the tile (BLOCK_M, BLOCK_N),
the K/V path, stages and warps, the grid (a program per work item and KV head, or a persistent
grid of so many programs) and split-KV (``Launch``). Its askers:
- plan() (compiled_attn/prefill.py, pod.py, cudnn.py, trtllm.py, cp.py through
  schedule.block_m_for): ``tile``, the tile height the work list is cut by;
- the launchers (prefill_kernel.launch_single / launch_ragged / launch_paged / launch_pod):
  ``choose``, whose answer they carry out (the Gluon kernel's tile included);
- the torch.compile dispatch (ops.dispatch.eager_gluon): ``choose(static=True)``, the same
  decision from what a trace can know (no pointer alignment, no CUDA-graph capture).

The thresholds and switches it reads live on ops.policy.POLICY; the tile bounds in tiles.py;
the Gluon kernel's tiles and page rules in prefill_gluon (TILES, page_read / page_gathered,
gather_short, persistent_default). A leaf below both launchers: prefill_kernel imports it, it
imports prefill_gluon (never the reverse at import time).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true

from . import device as _device
from . import launch as _launch
from .modes import INTERPRET, MASK_CAUSAL, MASK_CUSTOM, MASK_NONE
from .policy import POLICY
from .tiles import (DECODE_ROWS, GATHER_MIN_KV, GLUON_SHORT_KV, SHORT_KV, SMALL_PAGE_BLOCK_M,
                    SMALL_PAGE_MAX, SMALL_PAGE_PAD)

try:  # the Gluon Hopper kernel (Triton's Gluon dialect): None where this Triton lacks it
    from . import prefill_gluon as _gluon
except (ImportError, AttributeError):
    _gluon = None
try:  # whether wrap_triton traces (private): None where this torch lacks it
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:
    is_wrap_triton_enabled = None

__all__ = ["Device", "H100", "H200", "KV_PATHS", "Launch", "choose", "config", "device_of",
           "tile"]

KV_DENSE, KV_RAGGED, KV_PAGED = 0, 1, 2
_KV_KIND = {KV_DENSE: "dense", KV_RAGGED: "ragged", KV_PAGED: "paged"}

# ptxas of triton 3.6 crashes on 2-stage pipelines that load K/V through tensor descriptors or
# as whole-page 3D blocks (seen on the H100): config turns descriptors off for this stage
# count, and the kernel (prefill_kernel.CRASH_STAGES) whole-page loads.
CRASH_STAGES = 2


# ---------------------------------------------------------------------------------------------
# the device, as metadata
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Device:
    """What the decision reads of a device: its type, compute capability major and
    multiprocessor count (0 where not CUDA)."""

    type: str
    major: int = 0
    sm_count: int = 0

    @property
    def gluon(self) -> bool:
        """A Hopper GPU (the Gluon kernel's wgmma and TMA are sm_90's; not under the
        interpreter)."""
        return not INTERPRET and self.type == "cuda" and self.major == 9

    @property
    def tma(self) -> bool:
        """Device tensor descriptors exist: Hopper or newer (or the interpreter)."""
        return INTERPRET or (self.type == "cuda" and self.major >= 9)


H100 = Device("cuda", 9, 132)  # SXM5
H200 = Device("cuda", 9, 132)
_CPU = Device("cpu")


@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> Device:
    p = _device._device_properties(index)
    return Device("cuda", p.major, p.multi_processor_count)


def device_of(device: torch.device) -> Device:
    """The description of ``device`` (a CUDA device's from its cached properties)."""
    if device.type != "cuda":
        return _CPU if device.type == "cpu" else Device(device.type)
    return _cuda_device(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_present() -> bool:
    """torch.cuda.is_available(), asked once (a plan asks _plan_device several times)."""
    return torch.cuda.is_available()


_CUDA_DEVICE, _CPU_DEVICE = torch.device("cuda"), torch.device("cpu")


def _plan_device() -> Device:
    """The device plans are made for when none is named: the current CUDA device, if any."""
    return device_of(_CUDA_DEVICE if _cuda_present() else _CPU_DEVICE)


def eager_launch() -> bool:
    """Whether this launch runs the kernel directly (the interpreter, or triton_op's eager call
    on real tensors), not a wrap_triton trace: wrap_triton does not capture host descriptors
    while tracing ("TMA descriptor capturing not yet supported in non-dynamo tracing", torch
    2.11-2.13), so graphs traced by torch.compile / export build theirs per program."""
    if INTERPRET:
        return True
    return is_wrap_triton_enabled is not None and not is_wrap_triton_enabled()


def known(cond) -> bool:
    """A launch-time condition: plain ints compare to a bool directly (eager calls, no
    statically_known_true per check); symbolic ones must be known true."""
    return cond if type(cond) is bool else statically_known_true(cond)


# ---------------------------------------------------------------------------------------------
# the tile height (plan time)
# ---------------------------------------------------------------------------------------------
def tile(head_dim_qk: int, head_dim_vo: int, group_size: int, max_kv_len: int | None = None,
         causal: bool = True, paged: bool = False, *, page_size: int = 0,
         qo_lens: Sequence[int] | None = None, kv_dtype: torch.dtype | None = None,
         device: Device | None = None) -> int:
    """Tile height in packed rows for these head dims (plan() and the launch agree on it; the
    bounds and their reasons: tiles.py).
    max_kv_len: the longest request's KV length when the caller knows it (None: the tile for
    any length; CUDA-graph plans pass None so that one capture serves every re-plan).
    page_size: the paged cache's page size (0: unknown or not paged); qo_lens: each request's
    query rows as the work list tiles them (None: unknown); kv_dtype: the K/V dtype (None:
    fp16 / bf16; fp8 K/V never take the Gluon kernel, so their small pages keep 256-row
    tiles); device: the device planned for (None: the current CUDA device, if any). Decode
    rows (every request at most DECODE_ROWS packed rows) on pages the Gluon kernel reads on
    its 64-row tile (by boxes or gathers) take 64-row tiles whether max_kv_len is known or not."""
    if INTERPRET:
        return 64
    dev = _plan_device() if device is None else device
    d = max(head_dim_qk, head_dim_vo)
    gluon_pages = paged and _gluon_pages(page_size, head_dim_qk, head_dim_vo, kv_dtype, dev)
    if (paged and 0 < page_size <= SMALL_PAGE_MAX and 64 < d <= 128 and max_kv_len is not None
            and qo_lens is not None and _fills(qo_lens, group_size, SMALL_PAGE_BLOCK_M, 128)
            and not gluon_pages):
        return SMALL_PAGE_BLOCK_M
    if d > 256:
        return 64  # D 512: a 128-row tile's Q alone would take 128 KB of shared memory
    # decode rows: whatever the key lengths (known or not, as in a CUDA-graph plan)
    if (gluon_pages and qo_lens is not None and _decode_rows(qo_lens, group_size)
            and _pages_on_64_rows(page_size, d, kv_dtype, dev)):
        return 64
    if d > 128 or max_kv_len is None:
        return 128
    if (gluon_pages and d == 128
            and _gluon.page_gathered(page_size, _gluon.TILES[128, d].block_n, d)
            and max_kv_len > GATHER_MIN_KV // (1 if causal else 2)):
        return 128  # gathered pages (on short requests prefill_gluon.GATHER_SHORT_TILE)
    if max_kv_len <= POLICY.tma_min_kv:
        return 64
    if d <= 64 or (paged and not gluon_pages):
        return 128
    short = GLUON_SHORT_KV if _gluon_tiles(head_dim_qk, head_dim_vo, dev) else SHORT_KV
    return 64 if max_kv_len <= (short if causal else short // 2) else 128


def _chunk_mode(name: str) -> str:
    """The policy's key-chunk setting ``name`` (decode_chunks, pod_chunks), checked: "gluon",
    "always" or "off"."""
    mode = getattr(POLICY, name)
    if mode not in ("gluon", "always", "off"):
        raise ValueError(f"POLICY.{name}: got {mode!r}; one of 'gluon', 'always', 'off'")
    return mode


def decode_chunk_sms(page_size: int, dqk: int, dvo: int, block_m: int,
                     kv_dtype: torch.dtype | None, *, plain: bool,
                     device: Device | None = None) -> int:
    """The SM count a decode batch's key chunks are planned for (schedule.decode_chunk_count;
    0: no chunks), by POLICY.decode_chunks: "gluon" where the Gluon kernel reads the pages on
    its 64-row decode tile (the plan's block_m 64, head dims equal, fp16 / bf16 K/V), "always"
    on any device (an SM count of 132 where the device has none), "off" never. plain: the
    plan's options leave the chunks' launch exact and in the Gluon kernel's scope (no custom
    mask, window, position encoding, soft cap; q, K/V and output of one 16-bit dtype)."""
    mode = _chunk_mode("decode_chunks")
    if mode == "off" or not plain:
        return 0
    dev = _plan_device() if device is None else device
    if mode == "always":
        return dev.sm_count or H100.sm_count
    if dqk != dvo or block_m != 64 or not _pages_on_64_rows(page_size, dqk, kv_dtype, dev):
        return 0
    return dev.sm_count


def _gluon_tiles(dqk: int, dvo: int, dev: Device) -> bool:
    """Whether eager launches at these head dims go to the Gluon kernel on this device
    (use_gluon, a Hopper GPU, D 128), whose tiles ``tile`` then sizes (GLUON_SHORT_KV). Graphs
    that inline the op (AOTInductor; torch.compile keeps such calls opaque: ops.dispatch) run
    the Triton kernel on the same tiles (a plan serves both)."""
    return POLICY.use_gluon and _gluon is not None and dqk == dvo == 128 and dev.gluon


def _gluon_pages(page_size: int, dqk: int, dvo: int, kv_dtype: torch.dtype | None,
                 dev: Device) -> bool:
    """Whether eager paged launches of this page size, head dims and K/V dtype (None: fp16 /
    bf16) go to the Gluon kernel on this device (pages it reads on either tile height, by TMA
    boxes or gathers): they are then tiled as contiguous K/V are (pages 1-8 too, rather than
    the small pages' 256-row tiles), since on the Gluon kernel paged K/V prefer contiguous
    K/V's tile heights (benchmarks/NOTES.md, 2026-11-23). (Graphs that inline the op run the
    Triton kernel, which prefers 128-row tiles for paged K/V: they take these tiles too.)"""
    return (page_size > 0 and kv_dtype in (None, torch.float16, torch.bfloat16)
            and _gluon_tiles(dqk, dvo, dev)
            and all(_gluon.page_read(page_size, t[0], dqk)
                    for (_, d), t in _gluon.TILES.items() if d == dqk))


def _pages_on_64_rows(page_size: int, d: int, kv_dtype: torch.dtype | None,
                      dev: Device, *, gathered: bool = True) -> bool:
    """Whether eager launches read pages of this size at head dim d on the Gluon kernel's
    64-row tile at all: by TMA boxes or (gathered) pages too small for a box, by the producer
    warp group's gathers. Decode rows take that tile on either: two programs a SM, each with
    its own loads, where the 128-row ping-pong tile computed an empty half (benchmarks/NOTES.md,
    2026-11-28: page 1, 128 x 4k 486 us against 533)."""
    if not (d == 128 and _gluon_pages(page_size, d, d, kv_dtype, dev)):
        return False
    block_n = _gluon.TILES[64, d].block_n
    return _gluon.page_fits(page_size, block_n, d) or (
        gathered and _gluon.page_gathered(page_size, block_n, d))


def _decode_rows(qo_lens: Sequence[int], group_size: int) -> bool:
    """Whether every request has at most DECODE_ROWS packed rows (and one has any)."""
    longest = max((int(n) for n in qo_lens), default=0)
    return 0 < longest * group_size <= DECODE_ROWS


def _fills(qo_lens: Sequence[int], group_size: int, block_m: int, smaller: int) -> bool:
    """Whether tiles of block_m packed rows cover these requests with at most SMALL_PAGE_PAD
    times the rows (padding included) that tiles of ``smaller`` rows would."""
    def padded(m):
        return sum(-(-int(n) * group_size // m) * m for n in qo_lens)
    rows = padded(smaller)
    return rows > 0 and padded(block_m) <= SMALL_PAGE_PAD * rows


# ---------------------------------------------------------------------------------------------
# the Triton kernel's configuration
# ---------------------------------------------------------------------------------------------
def config(block_m: int, dqk: int, dvo: int, kv_mode: int = 0, mask_mode: int = 0) -> dict:
    """The Triton kernel's launch configuration (BLOCK_N, warps, stages, whether K/V may use
    tensor descriptors) for a tile height, head dims, KV addressing and mask mode."""
    if INTERPRET:
        return dict(BLOCK_N=32, num_warps=4, num_stages=1, TMA=True)
    # 64x64 tiles with 4 warps, 128x64 (D <= 64) and 128x128 with 8 (3 stages); D 256 needs
    # fewer stages to fit shared memory, and so does a custom mask (its bytes are pipelined
    # through shared memory with K and V). The Triton kernel's descriptors never with
    # CRASH_STAGES nor for 128-row D <= 64 tiles (slower there) nor D 256 (ptxas of triton
    # 3.6); the Gluon kernel, asked first, has its own tiles for those. D 512 (64-row tiles:
    # tile()) streams 32-key K / V tiles two deep: compiled for sm_90 by triton 3.6 on
    # 2026-11-27 it took 96-128 KB of shared memory (split-KV and custom masks the most),
    # 192 KB at most if Q and both stages of K and V were all held there.
    # Head dims between powers of two run their power of two's tiles.
    d = max(dqk, dvo)
    stages = 2 if mask_mode == MASK_CUSTOM else 3
    tma = stages != CRASH_STAGES
    if block_m == SMALL_PAGE_BLOCK_M and d <= 128:  # four warpgroups of 64 rows (small pages)
        return dict(BLOCK_N=64, num_warps=16, num_stages=stages, TMA=tma)
    if d <= 128 and block_m == 64:
        return dict(BLOCK_N=64, num_warps=4, num_stages=stages, TMA=tma)
    if d <= 64:
        return dict(BLOCK_N=64, num_warps=8, num_stages=stages, TMA=False)
    if d <= 128:
        return dict(BLOCK_N=128, num_warps=8, num_stages=stages, TMA=tma)
    if d <= 256:
        return dict(BLOCK_N=64, num_warps=8, num_stages=2, TMA=False)
    return dict(BLOCK_N=32, num_warps=8, num_stages=2, TMA=False)


# The settings that force each K/V load path of dense and ragged launches (tests and
# benchmarks compare them; the results are the same): name -> (TMA constexpr, settings).
# "host" even for small eager launches, "persistent" for both tile heights, "device" even for
# short keys; use_gluon is off in every entry but "gluon", so that forcing a path forces the
# Triton kernel on it. HOST_TMA descriptors are built once per launch on the host (3-10%
# faster at S <= 4k on the H100 than two per program built on the device, benchmarks/NOTES.md)
# in eager calls; PERSIST_TMA tile heights, where host descriptors cannot go (traced graphs,
# or host_tma off), run a persistent grid whose programs build theirs once (H100, kernel time:
# +3-16% over per-item descriptors or pointer loads at S <= 2k, even at 4k-8k; with 128-row
# tiles, which long keys get, 5% slower at S 16k).
KV_PATHS = {
    "gluon": (2, dict(use_gluon=True, use_tma=True, host_tma=True, host_tma_min_flop=0,
                      persist_tma=frozenset())),
    "host": (2, dict(use_gluon=False, use_tma=True, host_tma=True, host_tma_min_flop=0,
                     persist_tma=frozenset())),
    "persistent": (3, dict(use_gluon=False, use_tma=True, host_tma=False,
                           persist_tma=frozenset({64, 128}))),
    "device": (1, dict(use_gluon=False, use_tma=True, host_tma=False, persist_tma=frozenset(),
                       tma_min_kv=0)),
    "pointers": (0, dict(use_gluon=False, use_tma=False, host_tma=False,
                         persist_tma=frozenset())),
}
_TMA_PATH = {0: "pointers", 1: "device", 2: "host", 3: "persistent"}


# ---------------------------------------------------------------------------------------------
# the launch
# ---------------------------------------------------------------------------------------------
class Launch(NamedTuple):
    """How a launch runs (choose).

    kernel: "gluon" or "triton". block_m, block_n: the tile. kv_path: how K/V are read:
    "host" (descriptors over the whole K/V built on the host; the Gluon kernel's contiguous
    K/V), "persistent" (descriptors built once per persistent program), "device" (per program
    and work item), "pointers" (pointer loads; the Triton kernel's paged K/V go through the
    page table), "boxes" / "gather" (the Gluon kernel's pages: a TMA box per page or tile, or
    a producer warp group's gathers). tma: the Triton kernel's TMA constexpr (0-3; 2 for the
    Gluon kernel, which takes host descriptors). stages, warps: the pipeline depth and warps
    (the Gluon kernel's compute warps). persistent, programs: a persistent grid of so many
    programs taking items from a counter (programs None: a program per work item and KV
    head). split: a split-KV plan (chunk partials and a merge launch). group: the dense
    launch order's (batch entry, KV head) pairs per group. gluon_tile: the Gluon kernel's tile
    (prefill_gluon.launch's ``tile``), None for the Triton kernel.
    """

    kernel: str
    block_m: int
    block_n: int
    kv_path: str
    tma: int
    stages: int
    warps: int
    persistent: bool = False
    programs: object = None
    split: bool = False
    group: int = 1
    gluon_tile: tuple | None = None


def kv_strides(kv_mode: int, t) -> tuple:
    """K or V's strides as the kernels take them: (batch, token, page, head, dim)."""
    s = t.stride()
    if kv_mode == KV_DENSE:
        return (s[0], s[1], 0, s[2], s[3])
    if kv_mode == KV_RAGGED:
        return (0, s[0], 0, s[1], s[2])
    return (0, s[1], s[0], s[2], s[3])


def _mean(total, count):
    """total / count for plain ints (None when symbolic or count is 0)."""
    if isinstance(total, int) and isinstance(count, int) and count > 0:
        return total / count
    return None


def dense_tile(q, k, v, mask_mode: int, device: Device | None = None) -> int:
    """single_prefill's tile height (``tile``): q [B, Sq, Hq, Dqk], k / v [B, Skv, Hkv, D],
    real, fake or traced. Head dims and the head ratio are constexprs of either kernel, so a
    symbolic one is specialised (guard_int); a symbolic Skv counts as unknown."""
    skv = k.shape[1]
    return tile(guard_int(q.shape[-1]), guard_int(v.shape[-1]),
                guard_int(q.shape[-2]) // guard_int(k.shape[-2]),
                skv if isinstance(skv, int) else None, mask_mode != MASK_NONE, device=device)


def choose(kv_mode: int, q, k, v, consts: dict, scalars: dict, out_dtype: torch.dtype, *,
           block_m: int | None = None, requests=None, items=None, pages=None,
           split: bool = False, gluon: bool = True, pod: bool = False,
           device: Device | None = None, static: bool = False) -> Launch:
    """How a launch of these tensors and options runs (module docstring).

    kv_mode: KV_DENSE (q [B, Sq, Hq, Dqk], k / v [B, Skv, Hkv, D]), KV_RAGGED (q [Nq, Hq, Dqk],
    k / v [Nk, Hkv, D]) or KV_PAGED (k / v caches [P, page, Hkv, D]); real, fake, meta or
    traced tensors, read for their metadata (and a real tensor's pointer alignment).
    consts, scalars: prefill_kernel._flags of the call. block_m: the plan's tile height (None:
    the dense launch's own, dense_tile). requests: R of qo_indptr [R + 1]; items: work rows
    (dense: from the tiles); pages: page-table entries (a plan's table may be longer than its
    requests' pages: page_table_capacity). split: a split-KV plan; gluon: whether
    the launch may take the Gluon kernel (not split plans nor POD); pod: POD's halved pipeline.
    device: the device's description (None: q's, device_of). static: what a trace can know
    (ops.dispatch): no pointer alignment, no CUDA-graph capture, an eager launch assumed.
    """
    dev = device_of(q.device) if device is None else device
    mask_mode = consts["MASK_MODE"]
    dense = kv_mode == KV_DENSE
    # the tile height is a constexpr of either kernel: a symbolic one (a traced plan's int
    # input under dynamic shapes) is specialised here, where it is first compared and hashed
    block_m = dense_tile(q, k, v, mask_mode, dev) if block_m is None else guard_int(block_m)
    dqk, dvo = guard_int(q.shape[-1]), guard_int(v.shape[-1])
    hkv = k.shape[-2]
    if dense:
        tiles = (q.shape[1] * (q.shape[-2] // hkv) + block_m - 1) // block_m  # cdiv
        items = q.shape[0] * tiles
        mean_kv = k.shape[1]
    else:
        mean_kv = _mean(k.shape[0], requests) if kv_mode == KV_RAGGED else None
    group = (_dense_group(dev, tiles, q.shape[0] * hkv, block_m, mask_mode == MASK_CAUSAL)
             if dense else 1)
    cfg = config(block_m, dqk, dvo, kv_mode, mask_mode)
    block_n, warps, stages = cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
    if pod:
        # both parts' loops live in one kernel, each with its own shared memory: halve each
        # part's pipeline footprint (BLOCK_N and stages) so the sum fits. At D 512 the 64 x 512
        # float32 accumulator's layout changes take shared memory too: two 32-key stages per
        # part needed 320 KB as the GPU specializes the launch (sm_90, triton 3.6), one fits.
        d = max(dqk, dvo)
        return Launch("triton", block_m, 32 if d > 128 else 64, "pointers", 0,
                      1 if d > 256 else 2, warps, split=split)
    eager = True if static else eager_launch()
    # A launch whose host cost does not recur is never small: the faster kernel wins at any
    # size (asked last): eagerly, one being captured into a CUDA graph (on CUDA only); traced,
    # a graph compiled for CUDA-graph replay or ahead of time (AOTInductor's C++ launches).
    small = _small_launch(q, kv_mode, mean_kv, dvo, mask_mode) and (
        (static or not torch.cuda.is_current_stream_capturing()) if eager
        else not _graph_host_free())
    k_strides, v_strides = kv_strides(kv_mode, k), kv_strides(kv_mode, v)
    # The Gluon kernel first (its scope, layout and size rules); what it does not take runs the
    # Triton kernel, whose K/V go through tensor descriptors where its tile and the layout
    # allow: over the whole K/V, built once on the host (TMA 2: eager launches) or once per
    # program of a persistent grid (TMA 3: traced graphs, 64-row tiles); else per program and
    # work item on the device (TMA 1), which short key ranges do not amortise (pointer loads
    # then, TMA 0).
    if gluon and not split and POLICY.host_tma and eager and (
            kv_mode == KV_PAGED or (_kv_descriptors(consts, kv_mode) and not small)):
        layout = static or kv_mode == KV_PAGED or (
            dev.tma and _tma_ok(k, k_strides) and _tma_ok(v, v_strides)
            and _whole_tensor_ok(k) and _whole_tensor_ok(v))
        page = guard_int(k.shape[1]) if kv_mode == KV_PAGED else 0
        if layout and _gluon_scope(kv_mode, q, k, v, out_dtype, block_m, page, consts, scalars,
                                   dev, aligned=not static):
            # (q's packed rows: with a row map the launch's rows differ, but not their query
            # group, which _swap_rows bounds too)
            return _gluon_launch(kv_mode, dqk, block_m, page, items, hkv, requests, pages,
                                 mask_mode == MASK_CAUSAL, group, dev,
                                 rows=None if dense else (q.shape[0], q.shape[-2] // hkv))
    tma = 0
    if (cfg["TMA"] and _kv_descriptors(consts, kv_mode) and dev.tma
            and _tma_ok(k, k_strides) and _tma_ok(v, v_strides)):
        whole = _whole_tensor_ok(k) and _whole_tensor_ok(v)
        # A launch too small to outlast its own host-side cost takes neither whole-tensor path:
        # eagerly both cost more CPU per call than the pointer loads or per-item descriptors;
        # in a traced graph the persistent grid costs Inductor's wrapper a kernel zeroing its
        # counter, and its device descriptors a global scratch allocation per launch.
        small_tma = POLICY.host_tma and small
        if whole and POLICY.host_tma and eager and not small_tma:
            tma = 2
        elif whole and block_m in POLICY.persist_tma and not small_tma:
            tma = 3
        elif not (isinstance(mean_kv, (int, float)) and mean_kv <= POLICY.tma_min_kv):
            tma = 1
    programs = _persistent_programs(dev, items * hkv, block_m) if tma == 3 else None
    return Launch("triton", block_m, block_n, _TMA_PATH[tma], tma, stages, warps,
                  persistent=tma == 3, programs=programs, split=split, group=group)


def _one_a_sm_tile(block_m: int, d: int) -> bool:
    """Whether a Gluon launch's tile is the 64-row D 128 one, whose decode rows may run at most
    one program a SM (few_programs, or a grid capped by launch.programs_cap) on a deeper K/V
    ring or SWAP_TILE."""
    return block_m == 64 and d == 128


def few_programs(block_m: int, d: int, items, hkv: int, requests,
                 dev: Device | None = None) -> bool:
    """Whether a Gluon launch of paged K/V with these work rows (items, each times the hkv KV
    heads; requests: the launch's requests, or None where unknown) holds requests of one tile
    each (decode rows) on the 64-row D 128 tile, in at most one program a SM (the SM count of
    dev, default the plan's device; an H100's where it has none)."""
    dev = _plan_device() if dev is None else dev
    return (_one_a_sm_tile(block_m, d)
            and requests is not None and known(items <= requests)
            and known(items * hkv <= (dev.sm_count or H100.sm_count)))


def few_programs_ring(block_m: int, d: int, items, hkv: int, requests,
                      dev: Device | None = None) -> bool:
    """Whether such a launch (few_programs) reads its K / V faster than the tile's own: its
    slots POLICY.few_programs_stages deep, or the swapped products (POLICY.decode_swap, where
    the launch's rows allow: _swap_rows)."""
    return ((POLICY.few_programs_stages > 0 or POLICY.decode_swap)
            and few_programs(block_m, d, items, hkv, requests, dev))


def page_table_capacity(used: int, want: int, page: int, requests: int) -> int:
    """The entries, from ``used`` up to ``want``, that a plan may allocate its page table of
    ``used`` entries with (the tail past them never read), such that every launch decision
    reading the table's length (choose's ``pages``: gather_short alone, for either mask)
    decides as for ``used``: want, or less where that would cross gather_short's bound. A
    re-plan then writes into a table of the last plan's length (and keeps its bound calls)
    while the requests grow."""
    cap = max(want, used)
    for causal in (True, False) if _gluon is not None else ():
        if _gluon.gather_short(used, page, requests, causal):
            lo, hi = used, cap  # the longest table still short (gather_short is monotone)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _gluon.gather_short(mid, page, requests, causal):
                    lo = mid
                else:
                    hi = mid - 1
            cap = lo
    return cap


def _gluon_launch(kv_mode, d, block_m, page, items, hkv, requests, pages, causal, group,
                  dev: Device, rows=None) -> Launch:
    """The Gluon kernel's launch (prefill_gluon.launch carries it out with this tile): TILES
    for the tile height and head dim; gathered pages of short requests (gather_short) on
    GATHER_SHORT_TILE; a persistent grid where warp specialization runs one (persistent_default
    or the tile's own); decode rows in at most one program a SM on SWAP_TILE (_swap_rows; rows:
    (q's rows, its query group), None where unknown)."""
    g = _gluon
    t = g.TILES[block_m, d]
    paged = kv_mode == KV_PAGED
    if (paged and block_m == 128 and d == 128 and g.page_gathered(page, g.GATHER_SHORT_TILE[0], d)
            and g.gather_short(pages, page, requests, causal)):
        t = g.GATHER_SHORT_TILE
    t = g.Tile(*t)
    # Requests of one tile each (decode rows) in at most one program a SM: a deeper K/V ring,
    # or the swapped products (_swap_rows); so too a grid capped at one program a SM
    # (launch.programs_cap: POD's decodes side by side)
    cap = _launch.programs_cap_now()
    few = paged and few_programs(block_m, d, items, hkv, requests, dev)
    side = (paged and _one_a_sm_tile(block_m, d)
            and 0 < cap <= (dev.sm_count or H100.sm_count))
    if (few or side) and _swap_rows(page, d, rows, requests):
        t = g.SWAP_TILE
    elif few and POLICY.few_programs_stages > 0:
        t = t._replace(stages=POLICY.few_programs_stages)
    elif side and POLICY.pod_side_stages > 0:
        t = t._replace(stages=POLICY.pod_side_stages)
    block_n, warps, stages, p_smem, ws, pingpong = (t.block_n, t.warps, t.stages, t.p_smem,
                                                    t.ws, t.pingpong)
    gather = paged and g.page_gathered(page, block_n, d)
    boxes = block_n // page if 0 < page < block_n and not gather else 1
    ws_run = ws or boxes > 1 or pingpong or gather
    persistent = bool(ws_run and (t.persistent if t.persistent is not None
                                  else g.persistent_default(pingpong, boxes)))
    programs = None
    if persistent:  # as many programs as fit on the GPU at once, or the cap
        programs = g.persistent_programs(items * hkv, dev.sm_count, t, cap)
    kv_path = ("gather" if gather else "boxes") if paged else "host"
    return Launch("gluon", block_m, block_n, kv_path, 2, stages, warps, persistent=persistent,
                  programs=programs, group=group,
                  gluon_tile=(block_n, warps, stages, p_smem, ws, pingpong, persistent, t.swap))


def pod_swap_decodes(block_m: int, d: int, page: int, rows: int, group: int,
                     requests: int) -> bool:
    """Whether a fused Gluon POD launch runs its decodes' items on the swapped products
    (prefill_gluon.PodConfig.SWAP_D; POLICY.pod_decode_swap): on a tile of one compute group
    (not ping-pong: the 64-row tile) at D 128, the decodes' pages (page keys) read by TMA boxes
    (gathered pages read slower on them: p2048 + 128 x 1k GQA 64/8 page 1 4% slower, H200,
    benchmarks/NOTES.md, 2026-11-30), the query group at most SWAP_ROWS and the decodes' packed
    rows (rows times group) at most SWAP_ROWS a request on average, as _swap_rows asks of the
    decodes alone (a longer request takes a pass per SWAP_ROWS rows, re-reading its keys)."""
    g = _gluon
    tile = g.TILES.get((block_m, d))
    return bool(POLICY.pod_decode_swap and d == 128 and tile is not None and not tile.pingpong
                and not g.page_gathered(page, tile.block_n, d)
                and _swap_passes_fit(rows, group, requests))


def _swap_passes_fit(rows, group: int, requests) -> bool:
    """Whether decode rows suit the swapped products' passes: the query group at most
    SWAP_ROWS and the packed rows (rows times group) at most SWAP_ROWS a request on average
    (rows may be symbolic: known)."""
    s = _gluon.SWAP_ROWS.value
    return group <= s and known(rows * group <= s * requests)


def _swap_rows(page: int, d: int, rows, requests) -> bool:
    """Whether decode rows in at most one program a SM (few_programs, POD's decodes side by
    side) run prefill_gluon.SWAP_TILE, the swapped products (POLICY.decode_swap): rows = (q's
    rows, its query group; None: unknown), the group at most SWAP_ROWS and the packed rows
    (rows times group) at most SWAP_ROWS a request on average (a longer request takes a pass
    per SWAP_ROWS rows, re-reading its keys), at D 128 on pages its 128-key slots read. A
    program there read 64 GB/s against the 64-row tile's 52 (H200, benchmarks/NOTES.md,
    2026-11-30)."""
    g = _gluon
    if not (POLICY.decode_swap and d == 128 and rows is not None and requests is not None):
        return False
    n, group = rows
    return _swap_passes_fit(n, group, requests) and g.page_read(page, g.SWAP_TILE.block_n, d)


def _kv_descriptors(consts: dict, kv_mode: int) -> bool:
    """Whether these options let contiguous K/V (dense or ragged) be read through tensor
    descriptors, the tile (config's TMA: the Triton kernel's; the Gluon kernel's always) and
    the layout (_tma_ok) aside."""
    return POLICY.use_tma and kv_mode != KV_PAGED and not consts["ROPE"]


# Launches below POLICY.host_tma_min_flop skip the whole-tensor descriptors (and, eagerly, the
# Gluon kernel's contiguous K/V): where the kernel is shorter than an eager call's host time,
# the cheaper launch wins. Before bound launches a call with host descriptors cost the H100's
# host ~170-300 us against ~130 with pointer loads (the bound was 1e11 FLOP); a bound replay
# costs either path ~30 us, and the bound is 1e10 (benchmarks/NOTES.md, 2026-11-22 and
# 2026-11-28). A launch being captured into a CUDA graph is never small (replays skip the
# host, so the faster kernel wins at any size).
def launch_flop(rows: int, mean_kv: float, heads: int, dqk: int, dvo: int,
                causal: bool) -> float:
    """A launch's work as the small-launch rule counts it: query rows x mean keys x query
    heads x 2 (Dqk + Dvo), halved for causal."""
    return 2.0 * rows * mean_kv * heads * (dqk + dvo) * (0.5 if causal else 1.0)


def _small_launch(q, kv_mode, mean_kv, dvo, mask_mode) -> bool:
    """Whether a launch's work (launch_flop) is below host_tma_min_flop; False when a length
    is not a plain number."""
    rows = q.shape[0] * q.shape[1] if kv_mode == KV_DENSE else q.shape[0]
    if not isinstance(mean_kv, (int, float)) or type(rows) is not int:
        return False
    return launch_flop(rows, mean_kv, q.shape[-2], q.shape[-1], dvo,
                       mask_mode == MASK_CAUSAL) < POLICY.host_tma_min_flop


def ahead_of_time() -> bool:
    """Whether Inductor is compiling for AOTInductor or emitting C++ wrapper code (the package
    runs without Python)."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    return bool(V.aot_compilation) or bool(config.cpp_wrapper)


def _graph_host_free() -> bool:
    """Whether the graph being traced launches without Python's per-call cost: compiled for
    CUDA-graph replay (Inductor's triton.cudagraphs, which torch.compile's reduce-overhead mode
    sets for the whole compile) or ahead of time (ahead_of_time)."""
    from torch._inductor import config

    return bool(config.triton.cudagraphs) or ahead_of_time()


def _whole_tensor_ok(t) -> bool:
    """Whether K or V can be seen through one descriptor over the whole tensor (TMA 2 / 3):
    no empty dim and no zero stride (an expanded batch or head is not left to the tensor-map
    checks of the driver or the device); otherwise descriptors per work item (TMA 1)."""
    return all(known(x > 0) for x in t.shape) and all(known(x > 0) for x in t.stride())


def _real(t) -> bool:
    """A tensor with a real pointer (not fake, not meta)."""
    return not INTERPRET and t.device.type != "meta" and not (
        type(t) is not torch.Tensor and is_fake(t))


def _tma_ok(t, strides) -> bool:
    """Whether K or V (strides: batch, token, page, head, dim) is laid out for a device tensor
    descriptor: unit dim stride, and every other stride and the start 16-byte aligned (the
    storage itself is allocator-aligned; a real tensor's pointer is checked too)."""
    es = t.element_size()
    if not known(strides[4] == 1):
        return False
    for x in (strides[0], strides[1], strides[3], t.storage_offset()):
        if not known((x * es) % 16 == 0):
            return False
    return not _real(t) or t.data_ptr() % 16 == 0


def _gluon_scope(kv_mode, q, k, v, out_dtype, block_m, page_size, consts, scalars,
                 dev: Device, aligned: bool = True) -> bool:
    """Whether a launch is in the Gluon kernel's scope: use_gluon, a Hopper GPU, a tile for
    this height and head dim (TILES: D 64 and 128 on 64- and 128-row tiles, D 256 on 128-row
    ones), pages it reads (prefill_gluon.page_read: TMA boxes or a producer warp group's
    gathers), fp16 / bf16 throughout, V's head dim equal to Q's, unit stride, causal or no mask
    with a positive scale, none of window, chunks, soft cap, ALiBi, RoPE, sinks, a V scale, the
    row-max output or skip-softmax (the Gluon kernel writes neither), and K/V with packed
    heads and dims (prefill_gluon.kv_2d_layout; aligned: a real tensor's pointer 16-byte
    aligned too, as prefill_gluon.kv_2d views it)."""
    if not (POLICY.use_gluon and _gluon is not None):
        return False
    # (the head dim compared, not hashed: a traced q's is a SymInt)
    d = q.shape[-1]
    t = next((t for (bm, dd), t in _gluon.TILES.items() if bm == block_m and d == dd), None)
    if t is None or not dev.gluon:
        return False
    dt = q.dtype
    if dt not in (torch.float16, torch.bfloat16) or not (k.dtype == v.dtype == out_dtype == dt):
        return False
    if kv_mode == KV_PAGED and not _gluon.page_read(page_size, t[0], d):
        return False
    if v.shape[-1] != d or not known(q.stride(-1) == 1):
        return False
    if consts["MASK_MODE"] not in (MASK_NONE, MASK_CAUSAL) or not consts["FOLD"]:
        return False
    if any(consts.get(f) for f in ("HAS_WINDOW", "HAS_CHUNK", "SOFT_CAP", "ALIBI", "ROPE",
                                   "SINKS", "STATS", "SKIP")) or scalars["v_scale"] != 1.0:
        return False
    kind = _KV_KIND[kv_mode]
    for t in (k, v):
        if not _gluon.kv_2d_layout(t, kind, known):
            return False
        if aligned and _real(t) and t.data_ptr() % 16:
            return False
    return True


def one_page_cache(k, v, page_indices) -> bool:
    """Whether a paged cache (k / v [P, page, Hkv, D], page_indices [pages listed]) is one page
    that at most one request lists once (PODWithPagedKVCacheWrapper's contiguous k_p / v_p):
    every request then reads the first last_page_len rows of page 0, so the kernels may read
    it as rows, whatever its length. Shapes alone decide it (no device value is read); a page
    listed twice keeps the page arithmetic."""
    return k.shape[0] == 1 and v.shape[0] == 1 and page_indices.shape[0] <= 1


def pod_gluon(q_p, k_p, v_p, q_d, k_d, v_d, consts_p: dict, scalars_p: dict, consts_d: dict,
              scalars_d: dict, out_dtype: torch.dtype, block_m: int, *, one_page: bool,
              device: Device | None = None, static: bool = False) -> bool:
    """Whether a POD launch runs on the Gluon kernel's persistent work list
    (prefill_gluon.launch_pod) instead of the Triton kernel's POD launch: an eager launch
    (POLICY.pod_gluon), both parts in the Gluon kernel's scope (_gluon_scope) on its 64- or
    128-row D 128 tile (the plan's: pod_tile), both parts' pages read alike, by TMA boxes or
    gathered (pages of 1-7 keys: the launch's slots are filled one way), the prefill's cache
    possibly one page (PODWithPagedKVCacheWrapper's contiguous k_p / v_p: read as rows, or as
    one gathered page), one mask for both parts, and Q / O / LSE row strides that the launch
    specialises alike in both (a stride of 1 becomes a constexpr). q_x [N, Hq, D]; k_x / v_x
    caches [P, page, Hkv, D]; one_page: one_page_cache of the prefill's cache. static: what a
    trace can know (ops.dispatch: a traced call that an eager launch would send here stays
    opaque), as choose's: the launch itself not asked, pointers' alignment not read."""
    if (not (POLICY.pod_gluon and (static or eager_launch())) or INTERPRET
            or block_m not in (64, 128)):
        return False
    dev = device_of(q_p.device) if device is None else device
    d = q_p.shape[-1]
    if d != 128 or q_p.dtype != q_d.dtype or consts_p["MASK_MODE"] != consts_d["MASK_MODE"]:
        return False
    block_n = _gluon.TILES[block_m, 128].block_n
    paged = _gluon.pod_read(0 if one_page else k_p.shape[1], k_d.shape[1], block_n, d)
    gathered = paged == _gluon.PAGED_GATHER.value
    if paged is None or (gathered and not POLICY.pod_gather):
        return False
    for q, k, v, consts, scalars, prefill in ((q_p, k_p, v_p, consts_p, scalars_p, True),
                                              (q_d, k_d, v_d, consts_d, scalars_d, False)):
        page = k.shape[1]
        if prefill and one_page:  # (scope only: read as rows, or as one gathered page)
            page = k_d.shape[1] if gathered else block_n
        if not _gluon_scope(KV_PAGED, q, k, v, out_dtype, block_m, page, consts, scalars, dev,
                            aligned=not static):
            return False
    pairs = ((q_p.stride(0), q_d.stride(0)), (q_p.stride(1), q_d.stride(1)))
    return all((a == 1) == (b == 1) for a, b in pairs)


def pod_tile(head_dim: int, group_size: int, page_size: int,
             kv_dtype: torch.dtype | None = None, device: Device | None = None, *,
             plain: bool = True, fused_gluon: bool | None = None) -> int:
    """The tile height of a POD plan, which both parts share in the fused launch: 64 where the
    Gluon kernel's POD launch reads the decodes' pages (pod_fused_gluon; its 64-row tile runs two
    programs a SM: the decode items stream twice the K/V that the 128-row ping-pong tile's one
    program did, and the prefill's tiles fill in between; benchmarks/NOTES.md, 2026-11-28,
    POD on the 64-row tile), else ``tile``'s height for any length: the Triton POD launch's
    (which such calls take only exported, or with POLICY.pod_apart_balance 0: otherwise they
    run apart, pod_apart_any_size, their decodes on pod_decode_tile's height). kv_dtype None:
    fp16 / bf16; device None: the current CUDA device; plain:
    the plan's options leave the launch in the Gluon kernel's scope (no position encoding, no
    window); fused_gluon: pod_fused_gluon's answer where the caller has it (None: asked here)."""
    if INTERPRET:
        return 64
    dev = _plan_device() if device is None else device
    if fused_gluon is None:
        fused_gluon = pod_fused_gluon(head_dim, page_size, kv_dtype, dev, plain=plain)
    if fused_gluon:
        return 64
    return tile(head_dim, head_dim, group_size, device=dev)


def pod_decode_tile(head_dim: int, group_size: int, page_size: int, qo_lens: Sequence[int],
                    block_m: int, kv_dtype: torch.dtype | None = None,
                    device: Device | None = None) -> int:
    """The tile height of a POD plan's decode part when it runs as a launch of its own
    (pod_apart): decode rows (qo_lens: the part's query rows per request) take the 64-row tile
    that a paged call of them alone takes (``tile``: pages read by boxes or gathered), else the
    plan's tile, block_m (pod_tile's). Other arguments as pod_tile's."""
    if INTERPRET or not _decode_rows(qo_lens, group_size):
        return block_m
    rows = tile(head_dim, head_dim, group_size, None, False, True, page_size=page_size,
                qo_lens=qo_lens, kv_dtype=kv_dtype,
                device=_plan_device() if device is None else device)
    return 64 if rows == 64 else block_m


def pod_fused_gluon(head_dim: int, page_size: int, kv_dtype: torch.dtype | None = None,
                    device: Device | None = None, *, plain: bool = True) -> bool:
    """Whether a POD plan's fused launch is the Gluon kernel's (on pod_tile's 64-row tile, the
    decodes' pages read by TMA boxes or gathered; pod_gluon checks the call's tensors at
    launch), not the Triton kernel's POD launch. Arguments as pod_tile's. Never under the
    interpreter, which runs the Triton kernel."""
    if INTERPRET:
        return False
    dev = _plan_device() if device is None else device
    return (POLICY.pod_gluon and plain
            and _pages_on_64_rows(page_size, head_dim, kv_dtype, dev, gathered=POLICY.pod_gather))


def pod_apart(prefill_flops: float, decode_bytes: float, *, gluon: bool = True,
              dense_prefill: bool = False, fused_gathers: bool = False,
              decode_ring: bool = False, captured: bool = False, over_wave: bool = False
              ) -> bool:
    """Whether a POD call runs its prefill and decode parts as two launches (each on the path
    a call of that part alone takes) instead of one fused launch. The fused launch runs the
    prefill on its persistent programs, slower than the prefill's own launch, and wins that
    back by hiding the decodes' memory traffic under the prefill's matrix work: where the
    decodes are too small to repay it, two launches are faster. A small prefill rides along in
    a decode-heavy launch and stays fused. prefill_flops: the prefill part's attention FLOPs
    (4 Hq D per query-key pair it computes); decode_bytes: the K/V bytes the decode part
    reads. Apart when the decodes' bytes are under a balance times the prefill's FLOPs counted
    as bytes at POLICY.pod_flop_per_byte, and the two parts together at least
    POLICY.pod_apart_min_bytes of them (POLICY.pod_gather_graph_min_bytes for a gathered
    launch of POD's that a CUDA graph captures: captured, where a second launch costs its
    replays no host time). The balance is POLICY.pod_apart_balance where the
    prefill alone reads the pages the fused launch reads (BatchPOD); times
    POLICY.pod_dense_apart_factor where it alone reads contiguous k / v on its own tiles
    (dense_prefill: POD; POLICY.pod_dense_small_apart_factor where it computes under
    POLICY.pod_dense_apart_min_flops); times POLICY.pod_gather_apart_factor instead where that
    prefill's fused launch gathers both parts' K / V (fused_gathers: pod_fused_gathers;
    BatchPOD's prefill alone gathers the same pages), and always where that gathered prefill
    computes more than POLICY.pod_gather_max_prefill_flops. decode_ring: the decodes alone
    would take the few-programs K / V ring (few_programs_ring), which the fused launch's decode
    items do not: then a launch whose K / V the fused launch reads by boxes (not
    fused_gathers) goes apart where the prefill counted as bytes is under
    POLICY.pod_ring_apart_share of the decodes' bytes (a prefill that small costs the second
    launch less than the ring gains); and captured, where the fused launch's items (before any
    decode key chunks) exceed one wave of resident programs (over_wave: pod_over_wave), apart
    where the prefill counted as bytes is under POLICY.pod_ring_graph_apart_share of the
    decodes' bytes, whatever the sizes. gluon: the fused launch would be the Gluon kernel's
    (pod_fused_gluon); the Triton kernel's fused launch ran 0.38-0.8x of the parts apart
    (benchmarks/NOTES.md, 2026-11-28: page 1), so without it the parts always go apart, unless
    POLICY.pod_apart_balance is 0 (always fused)."""
    fixed = pod_apart_any_size(gluon)
    if fixed is not None:
        return fixed
    p = prefill_flops / POLICY.pod_flop_per_byte
    if (captured and decode_ring and over_wave
            and p < POLICY.pod_ring_graph_apart_share * decode_bytes):
        return True
    gathered = dense_prefill and fused_gathers
    floor = (POLICY.pod_gather_graph_min_bytes if captured and gathered
             else POLICY.pod_apart_min_bytes)
    if p + decode_bytes < floor:
        return False
    if gathered and 0 < POLICY.pod_gather_max_prefill_flops < prefill_flops:
        return True
    if decode_ring and not fused_gathers and p < POLICY.pod_ring_apart_share * decode_bytes:
        return True
    dense = (POLICY.pod_dense_small_apart_factor
             if prefill_flops < POLICY.pod_dense_apart_min_flops
             else POLICY.pod_dense_apart_factor)
    factor = (POLICY.pod_gather_apart_factor if gathered else dense) if dense_prefill else 1.0
    return decode_bytes < POLICY.pod_apart_balance * factor * p


def pod_side(prefill_flops: float, decode_bytes: float, *, gluon_64: bool,
             dense_gathers: bool = False, device: Device | None = None) -> int:
    """The decodes' programs where a POD call runs its parts side by side (two launches on
    two streams at once: the decodes' grid capped at that many programs, one a SM, on a
    high-priority stream, the prefill on the SMs left), else 0 (fused or apart: pod_apart).
    Side by side where the prefill counted as bytes (POLICY.pod_flop_per_byte) is at least
    POLICY.pod_side_min_prefill_bytes and the decodes' bytes at least POLICY.pod_side_min_bytes,
    and the prefill's share of the decodes' bytes is
    - at least POLICY.pod_side_share: the decodes on POLICY.pod_side_sms of the SMs (a decode
      program reads ~66 GB/s at most, so they need about half the SMs to keep their rate, and
      the prefill must be large enough to use the rest);
    - else at least POLICY.pod_side_heavy_share (decode-heavy calls): the decodes on their
      share of both parts' bytes, d / (d + p), at most POLICY.pod_side_sms_max of the SMs, the
      prefill hidden on the rest (its programs take the decodes' SMs as these finish).
    Under the prefill's floor, a call whose fused launch would gather a dense prefill's
    contiguous k / v (dense_gathers: POD's prefill where pod_fused_gathers; side by side its own
    launch reads them by TMA boxes) runs side by side where the prefill's share is at least
    POLICY.pod_side_share and the floors POLICY.pod_side_gather_min_prefill_bytes /
    POLICY.pod_side_gather_min_bytes hold, the decodes on their share of both parts' bytes,
    between POLICY.pod_side_gather_sms_min and POLICY.pod_side_sms_max of the SMs.
    gluon_64: the decodes' own launch is the Gluon kernel's persistent 64-row launch (pages
    read by TMA boxes or gathered: the only grid the cap reaches).
    Never under the interpreter (no streams there), nor with POLICY.pod_apart_balance 0 (one
    launch always) or POLICY.pod_side_share 0; device: the plan's by default."""
    if (INTERPRET or not gluon_64 or POLICY.pod_side_share <= 0 or POLICY.pod_side_sms <= 0
            or POLICY.pod_apart_balance <= 0):  # (always one launch)
        return 0
    prefill_bytes = prefill_flops / POLICY.pod_flop_per_byte
    if prefill_bytes < POLICY.pod_side_min_prefill_bytes:
        if not (dense_gathers and decode_bytes >= POLICY.pod_side_gather_min_bytes
                and prefill_bytes >= POLICY.pod_side_gather_min_prefill_bytes
                and prefill_bytes >= POLICY.pod_side_share * decode_bytes):
            return 0
        share = min(POLICY.pod_side_sms_max, max(POLICY.pod_side_gather_sms_min,
                                                 decode_bytes / (decode_bytes + prefill_bytes)))
    elif decode_bytes < POLICY.pod_side_min_bytes:
        return 0
    elif prefill_bytes >= POLICY.pod_side_share * decode_bytes:
        share = POLICY.pod_side_sms
    elif (POLICY.pod_side_heavy_share > 0
          and prefill_bytes >= POLICY.pod_side_heavy_share * decode_bytes):
        share = min(POLICY.pod_side_sms_max, decode_bytes / (decode_bytes + prefill_bytes))
    else:
        return 0
    dev = _plan_device() if device is None else device
    sms = dev.sm_count or H100.sm_count
    return max(1, min(sms, round(share * sms)))


def pod_over_wave(items: int, block_m: int, device: Device | None = None) -> bool:
    """Whether a fused POD launch of ``items`` work items (rows of both parts, times the KV
    heads) on tiles of block_m rows holds more than one wave of the device's resident
    programs (the plan's device by default), so that some items start only as others end."""
    return items > _resident_tiles(_plan_device() if device is None else device, block_m)


def pod_chunk_sms(fused_gluon: bool, device: Device | None = None) -> int:
    """The SM count a POD plan's decode key chunks are planned for (schedule.decode_chunk_count
    with POLICY.pod_chunk_fill over two waves; 0: no chunks), by POLICY.pod_chunks: "gluon"
    where the plan's fused launch is the Gluon kernel's (fused_gluon: pod_fused_gluon),
    "always" on any device (132 SMs where the device has none), "off" never."""
    mode = _chunk_mode("pod_chunks")
    if mode == "off" or (mode == "gluon" and not fused_gluon):
        return 0
    dev = _plan_device() if device is None else device
    return dev.sm_count or H100.sm_count


def pod_cut(prefill_items: int, longest_keys: int, sms: int) -> bool:
    """Whether a fused POD launch whose plan has decode key chunks (pod_chunk_sms) runs them:
    where the prefill's items (its tiles times the KV heads) fill one wave of resident 64-row
    programs on ``sms`` SMs or more, so that the decodes start late and would finish unevenly,
    or the longest decode has POLICY.pod_chunk_long_keys keys or more (two programs a SM then
    read faster than one). Beside a smaller prefill, short decodes lost more to the gather and
    merge launches than the chunks gained (measured before the row map replaced the gather,
    benchmarks/NOTES.md)."""
    return prefill_items >= RESIDENT_PER_SM[64] * sms or pod_cut_long(longest_keys)


def pod_cut_long(longest_keys: int) -> bool:
    """pod_cut's answer for the longest decode alone (POLICY.pod_chunk_long_keys): all a POD
    plan's key count enters the launch choice by (a re-plan whose longest decode stays on the
    same side keeps the last plan's chunks and the calls bound to them)."""
    return longest_keys >= POLICY.pod_chunk_long_keys


def pod_fused_gathers(head_dim: int, page_size: int) -> bool:
    """Whether a Gluon POD launch (pod_fused_gluon, on pod_tile's 64-row tile) whose decodes
    sit on pages of this size gathers both parts' K / V (prefill_gluon.pod_read's PAGED_GATHER)
    rather than reading them by boxes."""
    if INTERPRET or (64, head_dim) not in _gluon.TILES:
        return False
    block_n = _gluon.TILES[64, head_dim].block_n
    return _gluon.pod_read(0, page_size, block_n, head_dim) == _gluon.PAGED_GATHER.value


def pod_apart_any_size(gluon: bool) -> bool | None:
    """pod_apart's answer where the sizes do not enter it (None: they do): never apart with
    POLICY.pod_apart_balance 0, always apart where the fused launch would not be the Gluon
    kernel's (gluon False). What a call traced by torch.compile can decide without guards."""
    if POLICY.pod_apart_balance <= 0:
        return False
    return None if gluon else True


# Tiles resident per SM: two 64-row tiles (4 warps, ~113 KB of shared memory each) or one
# 128-row tile fit an H100 SM at once. Persistent launches (TMA 3) start twice that many
# programs per SM in case more fit: programs that start late find the counter spent and exit.
RESIDENT_PER_SM = {64: 2, 128: 1}


def _resident_tiles(dev: Device, block_m: int) -> int:
    """Tiles of this height that the device runs at once (RESIDENT_PER_SM on every SM)."""
    return RESIDENT_PER_SM.get(block_m, 1) * dev.sm_count


def _persistent_programs(dev: Device, items, block_m: int):
    """Programs of a persistent launch: twice the resident tiles (3 under the interpreter, so
    that programs take several items), at most one per item."""
    cap = 3 if INTERPRET else 2 * _resident_tiles(dev, block_m)
    return min(items, cap) if type(items) is int else torch.sym_min(items, cap)


def _dense_group(dev: Device, tiles, pairs, block_m: int, causal: bool):
    """(batch entry, KV head) pairs per group of the dense launch order (the kernels'
    _work_item / _dense_item). Causal: the largest divisor of ``pairs`` whose tiles fit one
    wave of resident programs. A group then runs its tiles heaviest first side by side, so the
    launch ends on light tiles instead of the last pair's heaviest ones, while the pairs running
    together are no more than one pair at a time would have resident (their K/V stays in L2;
    groups twice as large measured 2-5% slower, benchmarks/NOTES.md). Tiles of equal weight (no
    causal mask) and symbolic sizes keep one pair at a time. The interpreter takes 12 resident
    programs, so that small test shapes form groups."""
    if not causal or type(tiles) is not int or type(pairs) is not int or tiles <= 0:
        return 1
    resident = 12 if INTERPRET else _resident_tiles(dev, block_m)
    cap = max(1, min(pairs, resident // tiles))
    return next(g for g in range(cap, 0, -1) if pairs % g == 0)  # the largest divisor <= cap
