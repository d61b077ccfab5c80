"""compiled_attn.op_call under the Triton interpreter: a plain eager call of a public entry point
runs the op's implementation directly, and gives the op's own result bit for bit (the op path
taken with the policy's direct off)."""

import pytest
import torch

import compiled_attn as fi
from compiled_attn.ops import contracts
from tests.helpers import WS, indptr, make_paged, rand
from compiled_attn.ops.policy import POLICY

QO, KV = [5, 0, 9], [13, 7, 9]
HQ, HKV, D, PAGE = 4, 2, 32, 4
F32 = torch.float32


def _call(entry):
    if entry == "single":
        q, k, v = rand(9, HQ, D, seed=1, dtype=F32), rand(13, HKV, D, seed=2, dtype=F32), \
            rand(13, HKV, D, seed=3, dtype=F32)
        return "single_prefill", lambda: fi.single_prefill_with_kv_cache(
            q, k, v, causal=True, return_lse=True)
    q = rand(sum(QO), HQ, D, seed=4, dtype=F32)
    if entry == "ragged":
        k, v = rand(sum(KV), HKV, D, seed=5, dtype=F32), rand(sum(KV), HKV, D, seed=6, dtype=F32)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, causal=True, q_data_type=F32)
        return "batch_ragged_prefill", lambda: w.run(q, k, v, return_lse=True)
    # a shuffled page table with spare pages it never names
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, PAGE, dtype=F32, seed=7)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(QO), kvi, idx, last, HQ, HKV, D, PAGE, causal=True, q_data_type=F32)
    return "batch_paged_prefill", lambda: w.run(q, cache, return_lse=True)


@pytest.mark.parametrize("entry", ["single", "ragged", "paged"])
def test_direct_call_is_the_op_bit_for_bit(entry, monkeypatch):
    name, run = _call(entry)
    calls = []
    impl = contracts.IMPLEMENTATIONS[name]
    monkeypatch.setitem(contracts.IMPLEMENTATIONS, name,
                        lambda *a, **k: calls.append(name) or impl(*a, **k))
    out, lse = run()
    assert calls == [name]  # the direct path ran (the op holds its own reference to impl)
    monkeypatch.setattr(POLICY, "direct", False)
    ref_out, ref_lse = run()
    assert calls == [name]
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_interpreter_refuses_bf16_and_fp8_outputs():
    # The interpreter computes bf16 dot products and fp8 roundings wrongly on CPU (an audit:
    # errors of ~1e9 and -0.474 -> -0.25 in e5m2, with no error raised): the entry points
    # refuse those dtypes under TRITON_INTERPRET=1 and name the way out; fp16 still runs.
    q, k, v = (rand(4, 2, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    with pytest.raises(NotImplementedError, match="bfloat16 under TRITON_INTERPRET=1"):
        fi.single_prefill_with_kv_cache(q, k, v)
    q, k, v = (x.to(torch.float16) for x in (q, k, v))
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(NotImplementedError, match="float8_e5m2 under TRITON_INTERPRET=1"):
        fi.cudnn_batch_prefill_with_kv_cache(
            q, k, v, 0.3, torch.empty(1), max_token_per_sequence=4, max_sequence_kv=4,
            actual_seq_lens_q=i32(4), actual_seq_lens_kv=i32(4), causal=True,
            return_lse=False, o_data_type=torch.float8_e5m2)
    with pytest.raises(NotImplementedError, match="bfloat16 under TRITON_INTERPRET=1"):
        fi.trtllm_fmha_v2_prefill((q.to(torch.float8_e4m3fn), k, v), "SEPARATE_Q_K_V",
                                  torch.empty(1), i32(4), 4, 4, 0.3, 1.0, 1, i32(0, 4),
                                  i32(0, 4))
    assert fi.single_prefill_with_kv_cache(q, k, v).dtype == torch.float16


def test_ops_refuse_what_the_interpreter_miscomputes():
    # The same guard at the op contract (contracts._kernel_call): a direct torch.ops call, which
    # no wrapper validates, raises too, naming the argument; fp16 / fp32 run the kernel.
    from compiled_attn import ops

    q, k, v = (rand(1, 4, 2, 16, seed=s, dtype=torch.bfloat16) for s in (1, 2, 3))
    tail = (None, None, None, ops.MASK_CAUSAL, -1, 0, 0.3, 0.0, ops.POS_NONE, 1.0, 1e4, 1.0)
    with pytest.raises(NotImplementedError, match="^q: torch.bfloat16 under TRITON_INTERPRET"):
        torch.ops.compiled_attn.single_prefill(q, k, v, *tail, None)
    q, k, v = (x.to(torch.float16) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="^out_dtype: torch.float8_e4m3fn under"):
        torch.ops.compiled_attn.single_prefill(q, k, v, *tail, torch.float8_e4m3fn)
    out, lse = torch.ops.compiled_attn.single_prefill(q, k, v, *tail, None)
    assert out.dtype == torch.float16 and not out.isnan().any()


def test_calls_that_are_not_plain_go_through_the_op():
    """A tensor requiring grad (grad on) makes a call not plain eager: the launch cache answers
    NOT_PLAIN without running anything, and the entry point's call goes through the op, whose
    autograd kernel raises on backward; the same call under no_grad is plain and runs."""
    from compiled_attn.ops import launch

    q, k, v = (rand(9, h, D, seed=s, dtype=F32) for s, h in ((1, HQ), (2, HKV), (3, HKV)))
    ran = []
    cache = launch.LaunchCache()
    assert cache.call(lambda *a: ran.append(a), "x", (q.requires_grad_(),), {}) \
        is launch.NOT_PLAIN
    assert cache.call(lambda *a: ran.append(a), "x", (1, None), {}) is launch.NOT_PLAIN
    assert not ran
    out = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()
    with torch.no_grad():
        ref = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
    assert torch.equal(out.detach(), ref)


def test_torch_ops_call_takes_the_front_kernel(monkeypatch):
    """A plain eager torch.ops call stops at the front kernel (contracts._register_front): the
    custom op's backend kernel, whose body is _replaying, is not entered; the bits are those of
    the op's full path (bound launches off). A call that is not plain (grad on, q requiring
    grad) goes on to the custom op's autograd kernel: its output's backward raises."""
    from compiled_attn import ops
    from compiled_attn.ops import launch

    assert all(contracts.FRONT.values()) and set(contracts.FRONT) == set(contracts.IMPLEMENTATIONS)
    q, k, v = (rand(1, 9, h, D, seed=s, dtype=F32) for s, h in ((1, HQ), (2, HKV), (3, HKV)))
    args = (q, k, v, None, None, None, ops.MASK_CAUSAL, -1, 0, 0.3, 0.0, ops.POS_NONE, 1.0,
            1e4, 1.0, None)
    seen = []  # per call: whether it was asked below the autograd keys (custom_op's backend)
    real = launch.unwatched
    below = lambda: torch._C._dispatch_tls_is_dispatch_key_excluded(  # noqa: E731
        torch._C.DispatchKey.AutogradFunctionality)
    monkeypatch.setattr(launch, "unwatched", lambda: seen.append(below()) or real())
    cache = launch.LaunchCache()  # a fresh cache: the first call records, the second replays
    monkeypatch.setattr(launch, "DEFAULT", cache)
    with torch.no_grad():
        first = torch.ops.compiled_attn.single_prefill(*args)
        again = torch.ops.compiled_attn.single_prefill(*args)
        assert seen == [False, False]  # each call asked once, at the front (above autograd)
        with torch.inference_mode():  # no autograd keys: _replaying replays instead
            inference = torch.ops.compiled_attn.single_prefill(*args)
        assert seen == [False, False, True] and cache.hits == 2
        monkeypatch.setattr(POLICY, "bound_launches", False)
        full = torch.ops.compiled_attn.single_prefill(*args)
    assert not first[0].isnan().any()
    for a, b in zip((*first, *again, *inference), (*full, *full, *full)):
        assert torch.equal(a, b)
    monkeypatch.setattr(POLICY, "bound_launches", True)
    out, _ = torch.ops.compiled_attn.single_prefill(q.clone().requires_grad_(), *args[1:])
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="has no backward"):
        out.sum().backward()
