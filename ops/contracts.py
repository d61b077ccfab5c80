"""The op contracts: schema, fake and device implementations of the four kernel families.

Each family is one op in the ``compiled_attn`` namespace with a fixed-arity schema, and its fake
(shapes and dtypes only) sits right below it:

- ``single_prefill``: a dense batch, q [B, Sq, Hq, Dqk] against k/v [B, Skv, Hkv, D] (B = 1 is
  FlashInfer's single-request prefill; the FX rewrite passes SDPA's batch).
- ``batch_ragged_prefill``: ragged q and ragged k/v, split by indptr arrays.
- ``batch_paged_prefill``: ragged q against a paged KV cache.
- ``pod_prefill_decode``: a paged prefill batch and a paged decode batch in one launch.

Every op returns ``(out, lse)`` (POD: both pairs); lse is float32, base 2 (natural logsumexp /
ln 2) over the final logits. Ops take plan tensors (``work``: int32 [W, 2] of (request, first
packed row), built by compiled_attn's plan()) and plain numbers; nothing here reads a device
value on the host, so run() can be captured in a CUDA graph and traced by torch.compile.

Registration (docs/design.md): with a real GPU stack the ops are ``torch.library.triton_op`` so
Inductor inlines the Triton kernel and AOTInductor compiles it into its package; CPU tensors take
the pure-PyTorch reference (``reference.py``). Under ``TRITON_INTERPRET=1`` the same Triton
kernel runs on CPU tensors, and the ops are opaque ``custom_op`` (triton_op's decomposition would
hand the interpreter's launch to Inductor). Either way the explicit fake below each op is the one
registered, and ``torch.library.opcheck`` checks it. There is no autograd: backward raises.

Integer codes: mask_mode MASK_NONE / MASK_CAUSAL / MASK_CUSTOM; pos_encoding_mode POS_NONE /
POS_ROPE_LLAMA / POS_ALIBI. window_left -1 disables the window, chunk_size 0 disables chunking,
logits_soft_cap 0 disables the cap.
"""

from __future__ import annotations

import functools

import torch

from . import launch, reference
from .policy import POLICY
from .modes import (INTERPRET, MASK_CAUSAL, MASK_CUSTOM, MASK_NONE,  # noqa: F401 (re-exported)
                    POS_ALIBI, POS_NONE, POS_ROPE_LLAMA)

Tensor = torch.Tensor


# Head dims the Triton kernel runs, D_qk and D_vo each (any pair): multiples of 8 from 16 to 256
# (tiles padded to a power of two, every load and store masked on the real dim; 8 elements keep
# rows 16-byte aligned for descriptors and vector loads at fp16, 16 is the smallest dot depth)
# and 512 (its own tiles: choose.config). The CPU reference takes any head dim.
KERNEL_HEAD_DIMS = frozenset((*range(16, 257, 8), 512))
KERNEL_HEAD_DIMS_TEXT = "a multiple of 8 from 16 to 256, or 512"


def check_kernel_head_dims(dqk, dvo, names=("D_qk", "D_vo")) -> None:
    """Raise ValueError naming the argument (names: those of dqk, dvo) and the supported set
    unless the Triton kernel runs these head dims (KERNEL_HEAD_DIMS): the one rule of the ops'
    launches, the API's validation on CUDA and the FX rewrite."""
    for name, d in zip(names, (dqk, dvo)):
        if d not in KERNEL_HEAD_DIMS:
            raise ValueError(
                f"{name} = {d} has no kernel on the GPU (nor under TRITON_INTERPRET=1): the "
                f"kernel runs head dims that are {KERNEL_HEAD_DIMS_TEXT}; pad the head dim to "
                "one of those (zero padding of q / k leaves the logits unchanged; pass sm_scale "
                "for the real dim), or run on CPU (any head dim)")


# fp8 dtypes: K/V caches may hold them (upcast in the kernel); outputs may be written in them
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def interpreter_miscomputes(dt: torch.dtype) -> bool:
    """Whether the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) computes wrongly in dtype
    dt: bfloat16 dot products, fp8 roundings (CI tests float16 / float32 there; fp8 K/V inputs
    are upcast right). The ops raise for such a q or output (_kernel_call); the wrappers say so
    at plan time (compiled_attn._validate.check_interpreter)."""
    return INTERPRET and (dt == torch.bfloat16 or dt in FP8_DTYPES)


def refuse_if_miscomputed(name: str, dt: torch.dtype) -> None:
    """Raise NotImplementedError naming argument ``name`` when the interpreter miscomputes its
    dtype dt (interpreter_miscomputes); the one message of the ops and the wrappers."""
    if interpreter_miscomputes(dt):
        raise NotImplementedError(
            f"{name}: {dt} under TRITON_INTERPRET=1: the Triton interpreter computes bfloat16 "
            "dot products and fp8 roundings wrongly on CPU; use float16 / float32 there, or "
            f"unset TRITON_INTERPRET (the CPU reference takes {dt})")


# Whether the op runs the Triton kernel on t's device (CUDA, or CPU under the interpreter)
# rather than the reference.
_use_kernel = launch.on_kernel_device


def _kernel_call(q: Tensor, out_dtype: torch.dtype | None) -> bool:
    """_use_kernel for an op's q and output dtype; under the interpreter a dtype it miscomputes
    raises NotImplementedError naming the argument, instead of returning wrong numbers."""
    if not _use_kernel(q):
        return False
    if q.device.type == "cpu":
        refuse_if_miscomputed("q", q.dtype)
        refuse_if_miscomputed("out_dtype", out_dtype or q.dtype)
    return True


# op name -> its Python implementation (the body the op runs; the FX rewrite traces it when it
# inlines an op into an Inductor graph).
IMPLEMENTATIONS: dict = {}


def _bound_call(name: str, fn, args: tuple, kwargs: dict):
    """A call of op ``name`` (implementation fn) that nothing observes, as the entry points'
    plain eager calls run it: a bound launch replayed (launch.LaunchCache; the first call with a
    given metadata records). launch.NOT_PLAIN, with nothing run, for any other call or with
    bound launches off. The one rule of the op's body and its front kernel."""
    if POLICY.bound_launches and launch.unwatched():
        return launch.DEFAULT.call(fn, name, args, kwargs)
    return launch.NOT_PLAIN


def _replaying(name: str, fn):
    """fn as the op's body: a call through torch.ops that nothing observes (a serving engine's
    direct call under inference_mode, Inductor's run-time call of an op node it kept opaque)
    replays a bound launch (_bound_call); traced calls (fake or functional tensors) and
    observed ones run fn."""
    @functools.wraps(fn)  # the schema is inferred from fn's signature (followed through)
    def body(*args, **kwargs):
        out = _bound_call(name, fn, args, kwargs)
        return fn(*args, **kwargs) if out is launch.NOT_PLAIN else out

    return body


def _register(name: str, fn, fake):
    """Define compiled_attn::<name> from fn (schema inferred from its annotations), with fake as
    its FakeTensor implementation and a backward that raises."""
    qualname = f"compiled_attn::{name}"
    IMPLEMENTATIONS[name] = fn
    body = _replaying(name, fn)
    if INTERPRET:
        op = torch.library.custom_op(qualname, body, mutates_args=())
    else:
        op = torch.library.triton_op(qualname, body, mutates_args=())
    op.register_fake(fake)
    refuse_backward(op, qualname)
    _register_front(name, fn, op)
    return op


# The kernels that stand in front of the custom ops' own autograd kernel for the devices the
# Triton kernels run on (_register_front); held here so that the registrations live.
_FRONT = torch.library.Library("compiled_attn", "IMPL")
# op name -> whether its front kernel is registered (False on a torch whose custom-op internals
# differ: calls then take the custom op's own path, at its host cost)
FRONT: dict = {}


def _register_front(name: str, fn, op) -> None:
    """Register, at AutogradCUDA (and AutogradCPU under the interpreter), a kernel that runs a
    plain eager call's bound launch right there (_bound_call: the entry points' direct path).
    Through torch's dispatcher a custom op's call otherwise passes custom_op's Python autograd
    kernel, a redispatch and its Python backend kernel (which checks the outputs for aliasing)
    before ``_replaying`` runs: ~11 us of the host's time on a 16-argument op
    (benchmarks/NOTES.md, 2026-11-28). Any call that is not plain eager (launch.unobserved:
    a mode, a transform, the profiler, a subclass or fake tensor, a tensor requiring grad while
    grad is on) goes on to custom_op's autograd kernel unchanged, so tracing, the fakes and the
    backward that raises behave as before. Under torch.inference_mode() the dispatcher skips
    the autograd keys, this kernel with them: such calls reach ``_replaying``, which replays by
    the same rule."""
    try:  # custom_op's own autograd kernel (private; present in torch 2.11-2.13)
        from torch._library.autograd import make_autograd_impl

        autograd_impl = make_autograd_impl(op._opoverload, op)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another torch
        FRONT[name] = False
        return

    def front(keyset, *args, **kwargs):
        out = _bound_call(name, fn, args, kwargs)
        return autograd_impl(keyset, *args, **kwargs) if out is launch.NOT_PLAIN else out

    for key in ("AutogradCUDA", "AutogradCPU") if INTERPRET else ("AutogradCUDA",):
        _FRONT.impl(name, front, key, with_keyset=True)
    FRONT[name] = True


def refuse_backward(op, qualname: str) -> None:
    """Register on custom op ``op`` (named qualname) a backward that raises: compiled_attn's
    ops are inference-only."""
    def _backward(ctx, *grads):
        raise RuntimeError(
            f"{qualname} has no backward: compiled_attn's kernels are inference-only. "
            "Run under torch.no_grad()/torch.inference_mode(), or detach the inputs."
        )

    op.register_autograd(_backward, setup_context=lambda ctx, inputs, output: None)


def _params(mask_mode, window_left, chunk_size, sm_scale, logits_soft_cap, pos_encoding_mode,
            rope_scale, rope_theta, v_scale):
    return dict(
        mask_mode=mask_mode, window_left=window_left, chunk_size=chunk_size, sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale, rope_theta=rope_theta, v_scale=v_scale,
    )


def _out_pair(q: Tensor, lead: tuple, dvo: int, out_dtype: torch.dtype | None,
              row_max: bool = False):
    hq = q.shape[-2]
    out = q.new_empty((*lead, hq, dvo), dtype=out_dtype or q.dtype)
    lse = q.new_empty((*lead, hq, 2) if row_max else (*lead, hq), dtype=torch.float32)
    return out, lse


def _check_q_rows(name: str, q_rows: Tensor | None, q: Tensor) -> int:
    """The rows of an op whose q rows come through the row map ``q_rows`` (None: q's own):
    a contiguous 1-D int32 tensor on q's device (the kernels read entry t at offset t). Its
    entries must lie in [0, q's rows), like the indptrs' the caller's contract (the wrappers
    build it at plan time), unchecked here: a check would read the device."""
    if q_rows is None:
        return q.shape[0]
    if (q_rows.dim() != 1 or q_rows.dtype != torch.int32 or q_rows.device != q.device
            or (q_rows.shape[0] > 1 and q_rows.stride(0) != 1)):
        raise ValueError(f"{name}: a row map is a contiguous 1-D int32 tensor on q's device "
                         f"({q.device}); got {q_rows.dtype} {tuple(q_rows.shape)} with "
                         f"strides {q_rows.stride()} on {q_rows.device}")
    return q_rows.shape[0]


def _stats_skip(row_max: bool, skip_softmax: float) -> dict:
    """The ragged and paged ops' two approximation / statistics options, checked.

    row_max: the second output becomes float32 [..., Hq, 2] = (LSE, row max), both base 2: the
    max of each row's final logits (-inf for a row that sees no key), the LSE as without it.
    skip_softmax: a factor f >= 0 (0: exact attention). With f > 0, a row skips a key tile
    (BLOCK_N keys from a multiple of BLOCK_N, in ascending order) whose largest logit m_t is
    below the row's running max m by more than ln(kv_len / f): exp(m_t - m) < f / kv_len,
    FlashInfer's skip-softmax rule (kv_len the request's keys); the tile is left out of that
    row's softmax, and its P.V is not computed when every row of the tile skips it. Each
    skipped key's weight is below f / kv_len of the row's largest, so the skipped softmax
    mass is below f and the output moves by less than 2 f max|v|. Under split-KV the running
    max is that of the tile's own key chunk."""
    if not isinstance(row_max, bool):
        raise TypeError(f"row_max: got {row_max!r}; pass a bool")
    skip = float(skip_softmax)
    if not (skip >= 0.0 and skip < float("inf")):
        raise ValueError(f"skip_softmax: got {skip_softmax!r}; pass a finite factor >= 0 "
                         "(0: exact attention)")
    return dict(row_max=row_max, skip_softmax=skip)


# --------------------------------------------------------------------------------------------
# single_prefill
# --------------------------------------------------------------------------------------------
def _single_prefill(
    q: Tensor, k: Tensor, v: Tensor,
    packed_mask: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None,
    mask_mode: int, window_left: int, chunk_size: int, sm_scale: float, logits_soft_cap: float,
    pos_encoding_mode: int, rope_scale: float, rope_theta: float, v_scale: float,
    out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """Dense-batch prefill.

    q: [B, Sq, Hq, Dqk]; k: [B, Skv, Hkv, Dqk]; v: [B, Skv, Hkv, Dvo] (any strides: HND and
    SDPA's [B, H, S, D] come in as permuted views). packed_mask: uint8 bits of a bool
    [B, Sq, Skv] flattened row-major, little-endian (MASK_CUSTOM only). alibi_slopes, sinks:
    float32 [Hq]. Returns out [B, Sq, Hq, Dvo] (out_dtype, default q's) and lse float32
    [B, Sq, Hq], base 2.
    """
    params = _params(mask_mode, window_left, chunk_size, sm_scale, logits_soft_cap,
                     pos_encoding_mode, rope_scale, rope_theta, v_scale)
    if _kernel_call(q, out_dtype):
        from . import prefill_kernel

        return prefill_kernel.launch_single(q, k, v, packed_mask, alibi_slopes, sinks,
                                            out_dtype=out_dtype or q.dtype, **params)
    return reference.single_prefill(q, k, v, packed_mask, alibi_slopes, sinks,
                                    out_dtype=out_dtype or q.dtype, **params)


def _single_prefill_fake(q, k, v, packed_mask, alibi_slopes, sinks, mask_mode, window_left,
                         chunk_size, sm_scale, logits_soft_cap, pos_encoding_mode, rope_scale,
                         rope_theta, v_scale, out_dtype):
    return _out_pair(q, (q.shape[0], q.shape[1]), v.shape[-1], out_dtype)


single_prefill = _register("single_prefill", _single_prefill, _single_prefill_fake)


# --------------------------------------------------------------------------------------------
# batch_ragged_prefill
# --------------------------------------------------------------------------------------------
def _batch_ragged_prefill(
    q: Tensor, k: Tensor, v: Tensor, qo_indptr: Tensor, kv_indptr: Tensor, work: Tensor,
    packed_mask: Tensor | None, mask_indptr: Tensor | None,
    alibi_slopes: Tensor | None, sinks: Tensor | None, block_m: int,
    mask_mode: int, window_left: int, chunk_size: int, sm_scale: float, logits_soft_cap: float,
    pos_encoding_mode: int, rope_scale: float, rope_theta: float, v_scale: float,
    out_dtype: torch.dtype | None, merge: Tensor | None = None, row_max: bool = False,
    skip_softmax: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Ragged-batch prefill.

    q: [Nq, Hq, Dqk] split by qo_indptr int32 [B+1]; k: [Nk, Hkv, Dqk], v: [Nk, Hkv, Dvo] split
    by kv_indptr int32 [B+1] (any strides). work: int32 [W, 2] = (request, first packed row) of
    each tile of block_m packed rows (packed row r of a request = token r // G, head r % G of
    the group, G = Hq / Hkv). packed_mask: uint8, request b's bits of its bool [qo_len, kv_len]
    mask start at byte mask_indptr[b] (int32 [B+1]). Split-KV: work int32 [W, 4] = (request,
    first packed row, key chunk, number of chunks) with merge int32 [T, 4] = (request, first
    packed row, first work item, number of chunks) for each tile cut into more than one chunk
    (compiled_attn.ops.schedule.build_split_work); a tile's chunks are consecutive work items.
    row_max, skip_softmax: see _stats_skip. Returns out [Nq, Hq, Dvo], lse [Nq, Hq] (row_max:
    [Nq, Hq, 2]).
    """
    params = _params(mask_mode, window_left, chunk_size, sm_scale, logits_soft_cap,
                     pos_encoding_mode, rope_scale, rope_theta, v_scale)
    if _kernel_call(q, out_dtype):
        from . import prefill_kernel

        return prefill_kernel.launch_ragged(q, k, v, qo_indptr, kv_indptr, work, packed_mask,
                                            mask_indptr, alibi_slopes, sinks, block_m, merge,
                                            out_dtype=out_dtype or q.dtype, **params,
                                            **_stats_skip(row_max, skip_softmax))
    return reference.batch_ragged_prefill(q, k, v, qo_indptr, kv_indptr, packed_mask,
                                          mask_indptr, alibi_slopes, sinks,
                                          out_dtype=out_dtype or q.dtype, **params,
                                          **_stats_skip(row_max, skip_softmax))


def _batch_ragged_prefill_fake(q, k, v, qo_indptr, kv_indptr, work, packed_mask, mask_indptr,
                               alibi_slopes, sinks, block_m, mask_mode, window_left, chunk_size,
                               sm_scale, logits_soft_cap, pos_encoding_mode, rope_scale,
                               rope_theta, v_scale, out_dtype, merge=None, row_max=False,
                               skip_softmax=0.0):
    return _out_pair(q, (q.shape[0],), v.shape[-1], out_dtype, row_max)


batch_ragged_prefill = _register("batch_ragged_prefill", _batch_ragged_prefill,
                                 _batch_ragged_prefill_fake)


# --------------------------------------------------------------------------------------------
# batch_paged_prefill
# --------------------------------------------------------------------------------------------
def _batch_paged_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, qo_indptr: Tensor, kv_page_indptr: Tensor,
    kv_page_indices: Tensor, kv_last_page_len: Tensor, work: Tensor,
    packed_mask: Tensor | None, mask_indptr: Tensor | None,
    alibi_slopes: Tensor | None, sinks: Tensor | None, block_m: int,
    mask_mode: int, window_left: int, chunk_size: int, sm_scale: float, logits_soft_cap: float,
    pos_encoding_mode: int, rope_scale: float, rope_theta: float, v_scale: float,
    out_dtype: torch.dtype | None, merge: Tensor | None = None, row_max: bool = False,
    skip_softmax: float = 0.0, q_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Paged-KV batch prefill.

    q: [Nq, Hq, Dqk] split by qo_indptr int32 [B+1]. k_cache: [P, page, Hkv, Dqk], v_cache:
    [P, page, Hkv, Dvo] in logical NHD order with any strides (HND caches and 5-D caches come in
    as views). kv_page_indptr int32 [B+1] (in pages), kv_page_indices int32 [npages],
    kv_last_page_len int32 [B] in [1, page]. work, block_m, packed_mask, mask_indptr, merge,
    row_max, skip_softmax: as batch_ragged_prefill. q_rows: None, or int32 [R]: the op's
    rows are q's rows q_rows (q[q_rows], read in place where the kernel takes a row map: decode
    key chunks, each chunk a request of its own over its request's query row; entries in [0,
    Nq)); qo_indptr then splits those R rows. Returns out [Nq, Hq, Dvo], lse [Nq, Hq] (row_max:
    [Nq, Hq, 2]); with q_rows, R rows each.
    """
    _check_q_rows("q_rows", q_rows, q)
    params = _params(mask_mode, window_left, chunk_size, sm_scale, logits_soft_cap,
                     pos_encoding_mode, rope_scale, rope_theta, v_scale)
    if _kernel_call(q, out_dtype):
        from . import prefill_kernel

        return prefill_kernel.launch_paged(q, k_cache, v_cache, qo_indptr, kv_page_indptr,
                                           kv_page_indices, kv_last_page_len, work, packed_mask,
                                           mask_indptr, alibi_slopes, sinks, block_m, merge,
                                           q_rows, out_dtype=out_dtype or q.dtype, **params,
                                           **_stats_skip(row_max, skip_softmax))
    if q_rows is not None:
        q = q.index_select(0, q_rows.long())
    return reference.batch_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_page_indptr,
                                         kv_page_indices, kv_last_page_len, packed_mask,
                                         mask_indptr, alibi_slopes, sinks,
                                         out_dtype=out_dtype or q.dtype, **params,
                                         **_stats_skip(row_max, skip_softmax))


def _batch_paged_prefill_fake(q, k_cache, v_cache, qo_indptr, kv_page_indptr, kv_page_indices,
                              kv_last_page_len, work, packed_mask, mask_indptr, alibi_slopes,
                              sinks, block_m, mask_mode, window_left, chunk_size, sm_scale,
                              logits_soft_cap, pos_encoding_mode, rope_scale, rope_theta,
                              v_scale, out_dtype, merge=None, row_max=False, skip_softmax=0.0,
                              q_rows=None):
    return _out_pair(q, (_check_q_rows("q_rows", q_rows, q),), v_cache.shape[-1], out_dtype,
                     row_max)


batch_paged_prefill = _register("batch_paged_prefill", _batch_paged_prefill,
                                _batch_paged_prefill_fake)


# --------------------------------------------------------------------------------------------
# pod_prefill_decode
# --------------------------------------------------------------------------------------------
def pod_part_params(mask_mode_p, window_left_p, sm_scale_p, logits_soft_cap_p, mask_mode_d,
                    window_left_d, sm_scale_d, logits_soft_cap_d, pos_encoding_mode, rope_scale,
                    rope_theta, v_scale, out_dtype) -> tuple[dict, dict]:
    """Each part's keyword options (batch_paged_prefill's names, out_dtype resolved) from
    pod_prefill_decode's scalar arguments: the op's launch and the torch.compile dispatch's
    reading of a traced call (ops.dispatch) build them here alike."""
    common = dict(chunk_size=0, pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                  rope_theta=rope_theta, v_scale=v_scale, out_dtype=out_dtype)
    return (dict(mask_mode=mask_mode_p, window_left=window_left_p, sm_scale=sm_scale_p,
                 logits_soft_cap=logits_soft_cap_p, **common),
            dict(mask_mode=mask_mode_d, window_left=window_left_d, sm_scale=sm_scale_d,
                 logits_soft_cap=logits_soft_cap_d, **common))


def _pod_prefill_decode(
    q_p: Tensor, k_cache_p: Tensor, v_cache_p: Tensor, qo_indptr_p: Tensor,
    kv_page_indptr_p: Tensor, kv_page_indices_p: Tensor, kv_last_page_len_p: Tensor,
    q_d: Tensor, k_cache_d: Tensor, v_cache_d: Tensor, qo_indptr_d: Tensor,
    kv_page_indptr_d: Tensor, kv_page_indices_d: Tensor, kv_last_page_len_d: Tensor,
    work: Tensor, packed_mask_p: Tensor | None, mask_indptr_p: Tensor | None,
    alibi_slopes: Tensor | None, block_m: int,
    mask_mode_p: int, window_left_p: int, sm_scale_p: float, logits_soft_cap_p: float,
    mask_mode_d: int, window_left_d: int, sm_scale_d: float, logits_soft_cap_d: float,
    pos_encoding_mode: int, rope_scale: float, rope_theta: float, v_scale: float,
    out_dtype: torch.dtype | None, q_rows_d: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prefill and decode batches, each against its own paged cache, in one launch.

    The prefill part (suffix _p) and the decode part (suffix _d) each take the arguments of
    batch_paged_prefill (q [N, Hq, Dqk], caches [P, page, Hkv, D], qo_indptr, page table). A
    single-request prefill with contiguous k/v comes in as a one-page cache. work: int32 [W, 3]
    = (part: 0 prefill / 1 decode, request, first packed row). q_rows_d: the decode part's
    row map, as batch_paged_prefill's q_rows (decode key chunks). Returns (out_p, lse_p,
    out_d, lse_d).
    """
    _check_q_rows("q_rows_d", q_rows_d, q_d)
    p_params, d_params = pod_part_params(
        mask_mode_p, window_left_p, sm_scale_p, logits_soft_cap_p, mask_mode_d, window_left_d,
        sm_scale_d, logits_soft_cap_d, pos_encoding_mode, rope_scale, rope_theta, v_scale,
        out_dtype or q_p.dtype)
    if _kernel_call(q_p, out_dtype):
        from . import prefill_kernel

        return prefill_kernel.launch_pod(
            q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
            kv_last_page_len_p, q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d,
            kv_page_indices_d, kv_last_page_len_d, work, packed_mask_p, mask_indptr_p,
            alibi_slopes, block_m, p_params, d_params, q_rows_d)
    if q_rows_d is not None:
        q_d = q_d.index_select(0, q_rows_d.long())
    out_p, lse_p = reference.batch_paged_prefill(
        q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
        kv_last_page_len_p, packed_mask_p, mask_indptr_p, alibi_slopes, None, **p_params)
    out_d, lse_d = reference.batch_paged_prefill(
        q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d, kv_page_indices_d,
        kv_last_page_len_d, None, None, alibi_slopes, None, **d_params)
    return out_p, lse_p, out_d, lse_d


def _pod_prefill_decode_fake(q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p,
                             kv_page_indices_p, kv_last_page_len_p, q_d, k_cache_d, v_cache_d,
                             qo_indptr_d, kv_page_indptr_d, kv_page_indices_d,
                             kv_last_page_len_d, work, packed_mask_p, mask_indptr_p,
                             alibi_slopes, block_m, mask_mode_p, window_left_p, sm_scale_p,
                             logits_soft_cap_p, mask_mode_d, window_left_d, sm_scale_d,
                             logits_soft_cap_d, pos_encoding_mode, rope_scale, rope_theta,
                             v_scale, out_dtype, q_rows_d=None):
    rows_d = _check_q_rows("q_rows_d", q_rows_d, q_d)
    out_p, lse_p = _out_pair(q_p, (q_p.shape[0],), v_cache_p.shape[-1], out_dtype or q_p.dtype)
    out_d, lse_d = _out_pair(q_d, (rows_d,), v_cache_d.shape[-1], out_dtype or q_p.dtype)
    return out_p, lse_p, out_d, lse_d


pod_prefill_decode = _register("pod_prefill_decode", _pod_prefill_decode,
                               _pod_prefill_decode_fake)
