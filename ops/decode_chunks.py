"""Decode key chunks: the launches beside a decode batch cut into chunk requests.

A decode batch of few requests (one query row each) over long keys gives the paged launch too
few programs to fill the GPU. Its plan (compiled_attn/prefill.py) may then cut each request's
pages into chunks (schedule.build_decode_chunks), each a one-row request of its own over the
same page table, so that the paged launch runs on the Gluon kernel with enough programs instead
of a split plan on the Triton kernel (which the Gluon kernel does not take). That launch reads
each chunk row's query row in place through the ops' row map (batch_paged_prefill's q_rows,
pod_prefill_decode's q_rows_d: the plan's ``src``); then
- ``merge_chunks``: each request's chunk outputs combined by their base-2 LSEs into its output
  row and LSE, as compiled_attn.utils.merge_states combines states (a chunk that saw no key has
  LSE -inf and weight 0; a row none of whose chunks saw a key gets output 0 and LSE -inf),
  through launch.run_direct (eager only; a recording call notes it), so a bound run() replays
  both launches together;
- ``gather_rows``: the map's rows copied from q, for a launch that takes no row map (the Triton
  kernel's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from . import choose, launch, schedule
from .modes import POS_NONE

# The merge launch's warps a program (one merge row, one query head: at most MAX_CHUNKS x D
# values)
MERGE_WARPS = 4
# Whether the merge launches as a programmatic dependent launch of the paged one (PDL: its
# programs start, and read their merge rows, while the paged launch ends, then wait for its
# grid to complete before they read the chunks' outputs). These settings are read when a call
# is recorded: bound calls replay what they recorded (policy.touch() drops them).
MERGE_PDL = True


def exact(*, custom_mask: bool, window_left: int, pos_encoding_mode: int,
          logits_soft_cap: float, sinks, dtypes: tuple) -> bool:
    """Whether decode requests cut into key chunks and merged compute the attention of the
    uncut requests exactly: no custom mask, window or position encoding (a chunk request counts
    positions, RoPE's and ALiBi's, from its own last key), no soft cap or sinks (the merge
    takes none), and one dtype for all of ``dtypes`` (q, K/V, and the output where it has its
    own). A causal row of a one-row request sees every key, as it does in each of its
    chunks."""
    return (not custom_mask and window_left < 0 and pos_encoding_mode == POS_NONE
            and not logits_soft_cap and sinks is None and len(set(dtypes)) == 1)


@triton.jit
def _gather_rows(src_ptr, q_ptr, out_ptr, stride_qn, stride_qh, stride_qd, HQ: tl.constexpr,
                 D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (chunk rows, HQ): out [R, HQ, D] (contiguous) row r, head h = q[src[r], h]."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    s = tl.load(src_ptr + r).to(tl.int64)
    x = tl.load(q_ptr + s * stride_qn + h * stride_qh + d * stride_qd, mask=d < D)
    tl.store(out_ptr + (r.to(tl.int64) * HQ + h) * D + d, x, mask=d < D)


@triton.jit
def _merge_chunks(merge_ptr, o_ptr, lse_ptr, out_ptr, out_lse_ptr, stride_on, stride_oh,
                  stride_ln, stride_lh, HQ: tl.constexpr, D: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (merge rows, HQ): merge row (out row, first chunk row, chunks) of chunk outputs o
    [R, HQ, D] and base-2 LSEs lse [R, HQ] (contiguous) into out [N, HQ, D] and out_lse [N, HQ]
    (strides given): the chunks' outputs weighted by 2^(lse - max) over the weights' sum; LSE
    max + log2(sum). Chunks of LSE -inf weigh 0; a row of only such chunks writes 0 / -inf. A
    merge row of out row -1 is padding (a CUDA-graph plan's buffer past its rows): no store.
    PDL: launched as a programmatic dependent of the launch writing o / lse, whose completion
    it waits for (griddepcontrol.wait) after reading its merge row (the plan's, not written
    by that launch)."""
    m_row = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(merge_ptr + m_row * 3).to(tl.int64)
    keep = row >= 0  # (compared as blocks below: a scalar mask fails under the interpreter)
    row = tl.maximum(row, 0)
    first = tl.load(merge_ptr + m_row * 3 + 1)
    n = tl.load(merge_ptr + m_row * 3 + 2)
    if PDL:
        gdc_wait()
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    rows = (first + c).to(tl.int64)
    lse = tl.load(lse_ptr + rows * HQ + h, mask=c < n, other=float("-inf"))
    mx = tl.max(lse, 0)
    base = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - base)  # 0 for -inf chunks and past n
    total = tl.sum(w, 0)
    o = tl.load(o_ptr + (rows * HQ + h)[:, None] * D + d[None, :],
                mask=(c < n)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(o * w[:, None], 0) / tl.where(total == 0, 1.0, total)
    tl.store(out_ptr + row * stride_on + h * stride_oh + d, acc.to(out_ptr.dtype.element_ty),
             mask=(d < D) & (d * 0 + keep.to(tl.int32) > 0))
    log_total = tl.log2(tl.where(total == 0, 1.0, total))
    out_lse = tl.where(total == 0, float("-inf"), base + log_total)
    one = tl.arange(0, 1)  # (one value stored as a block)
    tl.store(out_lse_ptr + row * stride_ln + h * stride_lh + one,
             out_lse + tl.zeros([1], tl.float32), mask=one * 0 + keep.to(tl.int32) > 0)


def gather_rows(q: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] (any strides), src int32 [R] (rows of q) -> contiguous [R, Hq, D]: a
    scratch buffer (launch.scratch) that a bound run allocates again per call. For launches
    that take no row map (the ops' q_rows on the Triton kernel); launch.run, so a traced call
    takes it too."""
    r, (_, hq, d) = src.shape[0], q.shape
    rows = launch.scratch((r, hq, d), q.dtype, q.device)
    if r:
        launch.run(_gather_rows, (r, hq), src, q, rows, q.stride(0), q.stride(1), q.stride(2),
                   HQ=hq, D=d, BLOCK_D=triton.next_power_of_2(d), num_warps=1)
    return rows


def _pdl_ok(device: torch.device) -> bool:
    """Whether launches on device may be programmatic dependent launches: CUDA on Hopper or
    later (the interpreter runs no launch dependencies)."""
    return (device.type == "cuda" and not launch.INTERPRET
            and choose.device_of(device).major >= 9)


def _pdl(device: torch.device) -> dict:
    """The merge launch's PDL arguments (MERGE_PDL, _pdl_ok)."""
    return dict(PDL=True, launch_pdl=True) if MERGE_PDL and _pdl_ok(device) else {}


def merge_chunks(o: torch.Tensor, lse: torch.Tensor, merge: torch.Tensor, rows: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk outputs o [R, Hq, D] and base-2 LSEs lse float32 [R, Hq] (contiguous), merge int32
    [M, 3] (schedule.build_decode_chunks; at most MAX_CHUNKS chunks a row) -> (out [rows, Hq,
    D] in o's dtype, lse float32 [rows, Hq]). Rows no merge row names are not written (a decode
    batch's rows are all named: every request with a row has one)."""
    hq, d = o.shape[1], o.shape[2]
    out = torch.empty((rows, hq, d), dtype=o.dtype, device=o.device)
    out_lse = torch.empty((rows, hq), dtype=torch.float32, device=o.device)
    if merge.shape[0]:
        launch.run_direct(_merge_chunks, (merge.shape[0], hq), merge, o, lse, out, out_lse,
                          out.stride(0), out.stride(1), out_lse.stride(0), out_lse.stride(1),
                          HQ=hq, D=d, BLOCK_C=schedule.MAX_CHUNKS,
                          BLOCK_D=triton.next_power_of_2(d), num_warps=MERGE_WARPS,
                          **_pdl(o.device))
    return out, out_lse

