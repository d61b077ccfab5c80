"""compiled_attn.cp on 2 GPUs over NCCL (spawned ranks, 127.0.0.1): the all-gather method bitwise
against the single-GPU op on the whole sequence (chunks of 2048 tokens: whole tiles; the kernel
choice pinned: Triton alone, or every launch free to take the Gluon kernel), the ring within
twice the single-GPU op's own error against float64; GQA 32/8 and 32/4, MHA, D 64 / 128 / 256;
the all-gather compiled (Inductor, fullgraph)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_ranks

pytestmark = pytest.mark.gpu

S_EXACT = 8192  # 4 chunks of 2048 on 2 ranks; every rank's longest prefix (6k, 8k) > 4k keys
S_RING = 4096
BITWISE = [(32, 8, 64), (32, 8, 128), (32, 8, 256), (32, 4, 128)]
RING = [(32, 32, 64), (32, 32, 128), (32, 32, 256), (32, 8, 128)]
PINS = ("triton", "any")


def _inputs(n, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for h in (hq, hkv, hkv)]


def _opts(d):
    return dict(window_left=-1, sm_scale=d ** -0.5, logits_soft_cap=0.0)


def _whole_op(q, k, v):
    """The single-GPU op (one ragged request) on the whole sequence, causal."""
    from compiled_attn import cp

    n = q.shape[0]
    return cp._attend(q, k, v, [(n, n)], True, _opts(q.shape[-1]))


def _gather_unshard(t, world):
    import torch.distributed as dist

    from compiled_attn import cp

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return cp.unshard(torch.cat(parts), world, seq_len=parts[0].shape[0] * world)


def _pinned(pin):
    """The launch policy's settings of a pin: 'triton' (no Gluon kernel), 'any' (no launch
    falls back from Gluon for its size)."""
    return {"use_gluon": False} if pin == "triton" else {"host_tma_min_flop": 0}


def _bitwise(rank, world, hq, hkv, d, pin):
    import torch.distributed as dist

    from compiled_attn import cp
    from compiled_attn.ops import schedule
    from compiled_attn.ops import policy

    with policy.override(**_pinned(pin)):
        g = hq // hkv
        longest = [S_EXACT * (2 * world - r) // (2 * world) for r in range(world)]
        tiles = {schedule.block_m_for(d, d, g, n, True) for n in longest + [S_EXACT]}
        assert len(tiles) == 1, f"the ranks' launches and the whole one tile differently: {tiles}"
        q, k, v = _inputs(S_EXACT, hq, hkv, d, seed=d + hkv)
        ql, kl, vl = (cp.shard(t, world, rank) for t in (q, k, v))
        torch.full_like(q, float("nan"))  # poison the allocator's next blocks
        out, lse = cp.prefill(ql, kl, vl, group=dist.group.WORLD, causal=True,
                              method="all_gather")
        o, s = _gather_unshard(out, world), _gather_unshard(lse, world)
        one_o, one_s = _whole_op(q, k, v)
        assert not o.isnan().any()
        assert torch.equal(o, one_o), (o.float() - one_o.float()).abs().max().item()
        assert torch.equal(s, one_s), (s - one_s).abs().max().item()


def _ref64(q, k, v):
    """float64 oracle, causal, by groups of KV heads (bounded memory)."""
    from compiled_attn.ops import reference

    n, hq, d = q.shape
    g = hq // k.shape[1]
    ip = torch.tensor([0, n], dtype=torch.int32, device=q.device)
    outs, lses = [], []
    for h in range(0, k.shape[1], 2):
        o, s = reference.batch_ragged_prefill(
            q[:, h * g:(h + 2) * g].double(), k[:, h:h + 2].double(), v[:, h:h + 2].double(),
            ip, ip, None, None, None, None, out_dtype=torch.float64, mask_mode=1,
            window_left=-1, chunk_size=0, sm_scale=d ** -0.5, logits_soft_cap=0.0,
            pos_encoding_mode=0, rope_scale=1.0, rope_theta=1e4, v_scale=1.0)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def _ring(rank, world, hq, hkv, d, compiled=False, method="ring", as_op=False):
    import torch.distributed as dist

    from compiled_attn import cp

    q, k, v = _inputs(S_RING, hq, hkv, d, seed=7 * d + hkv)
    ql, kl, vl = (cp.shard(t, world, rank) for t in (q, k, v))

    def run(a, b, c):
        return cp.prefill(a, b, c, group=dist.group.WORLD, causal=True, method=method,
                          as_op=as_op)

    # dynamic=False: the all-gather and ring cases share run's code object; each compiles for
    # its own sizes (cp.prefill specialises them either way)
    fn = torch.compile(run, fullgraph=True, dynamic=False) if compiled else run
    out, lse = fn(ql, kl, vl)
    o, s = _gather_unshard(out, world), _gather_unshard(lse, world)
    if rank != 0:
        return
    one_o, one_s = _whole_op(q, k, v)
    r_o, r_s = _ref64(q, k, v)
    assert not o.isnan().any() and not s.isnan().any()
    err = (o.double() - r_o).abs().max().item()
    own = (one_o.double() - r_o).abs().max().item()
    eps = torch.finfo(torch.bfloat16).eps
    assert err <= 2 * own + eps * r_o.abs().max().item(), (err, own)
    lerr = (s.double() - r_s).abs().max().item()
    lown = (one_s.double() - r_s).abs().max().item()
    assert lerr <= 2 * lown + 1e-4 * max(1.0, r_s.abs().max().item()), (lerr, lown)


def _gpu_cases(rank, world, attempt):
    for hq, hkv, d in BITWISE:
        for pin in PINS:
            attempt(f"all_gather_{hq}_{hkv}_d{d}_{pin}",
                    lambda: _bitwise(rank, world, hq, hkv, d, pin))
    for hq, hkv, d in RING:
        attempt(f"ring_{hq}_{hkv}_d{d}", lambda: _ring(rank, world, hq, hkv, d))
    attempt("all_gather_compiled", lambda: _ring(rank, world, 32, 8, 128, True, "all_gather"))
    attempt("ring_compiled", lambda: _ring(rank, world, 32, 32, 128, True))
    # the opaque form (as_op: one compiled_attn::cp_prefill node) under Inductor
    attempt("all_gather_compiled_as_op",
            lambda: _ring(rank, world, 32, 8, 128, True, "all_gather", as_op=True))
    attempt("ring_compiled_as_op", lambda: _ring(rank, world, 32, 32, 128, True, as_op=True))


KEYS = ([f"all_gather_{hq}_{hkv}_d{d}_{pin}" for hq, hkv, d in BITWISE for pin in PINS]
        + [f"ring_{hq}_{hkv}_d{d}" for hq, hkv, d in RING]
        + ["all_gather_compiled", "ring_compiled", "all_gather_compiled_as_op",
           "ring_compiled_as_op"])
_RESULTS: dict = {}


@pytest.mark.parametrize("key", KEYS)
def test_cp_two_gpus(key):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not _RESULTS:
        _RESULTS.update(run_ranks(_gpu_cases, 2, backend="nccl"))
    assert key in _RESULTS, f"{key} did not run"
    assert _RESULTS[key] is None, _RESULTS[key]
