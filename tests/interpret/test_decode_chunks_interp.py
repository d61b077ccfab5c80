"""dev.decode_probe's key-chunk decode (each request's keys as one-row chunk requests in one
paged launch, then ``_merge_chunks``) under the Triton interpreter: the numbers a GPU timing of
that variant stands on. Against a float64 reference on fresh random inputs, with the output
poisoned first; and the merge kernel against compiled_attn.utils.merge_states, chunks that saw
no key (LSE -inf) included."""

import pytest
import torch

from compiled_attn.utils import merge_states
from dev import decode_probe as dp

F32 = torch.float32


def _decode_case(b, kv, page, hq, hkv, seed=0):
    """dp._inputs' layout (NHD pages [P, 2, page, Hkv, D], shuffled) in float32 on CPU."""
    g = torch.Generator().manual_seed(seed)
    npg = -(-kv // page)
    cache = torch.randn(b * npg, 2, page, hkv, dp.D, generator=g, dtype=F32)
    idx = torch.randperm(b * npg, generator=g).to(torch.int32)
    indptr = torch.arange(b + 1, dtype=torch.int32) * npg
    last = torch.full((b,), kv - (npg - 1) * page, dtype=torch.int32)
    q = torch.randn(b, hq, dp.D, generator=g, dtype=F32)
    return dict(cache=cache, idx=idx, indptr=indptr, last=last, q=q)


def _reference(x, kv, hq, hkv, dt=torch.float64):
    """Attention of each one-row request over its kv keys, computed by PyTorch in dt:
    [B, Hq, D]."""
    outs = []
    for r in range(x["q"].shape[0]):
        pages = x["idx"][x["indptr"][r]:x["indptr"][r + 1]].long()
        k, v = (x["cache"][pages, i].reshape(-1, hkv, dp.D)[:kv].to(dt) for i in (0, 1))
        k, v = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
        s = torch.einsum("hd,khd->hk", x["q"][r].to(dt), k) * dp.D ** -0.5
        outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
    return torch.stack(outs)


# (B, kv, page, Hq, Hkv), chunks (a power of two: the merge's arange): odd lengths, page 1,
# GQA 7:1, one KV head
@pytest.mark.parametrize("case,chunks", [((3, 37, 4, 4, 2), 2), ((2, 64, 16, 8, 1), 4),
                                         ((1, 29, 1, 7, 1), 4)])
def test_chunked_decode_matches_float64(case, chunks):
    b, kv, page, hq, hkv = case
    x = _decode_case(*case)
    fn, out, _ = dp._chunked(case, x, chunks)
    ref = _reference(x, kv, hq, hkv)
    own = (_reference(x, kv, hq, hkv, F32).double() - ref).abs().max().item()
    err = (out.double() - ref).abs().max().item()
    assert not out.isnan().any()
    # the kernel tests' bound (tests/kernel_cases.check): twice PyTorch's own float32 error,
    # one float32 step of the output's scale, 1e-6
    assert err <= 2 * own + torch.finfo(F32).eps * ref.abs().max().item() + 1e-6, (err, own)
    buf = fn().fill_(float("nan"))  # the buffer each call writes: poisoned, then run again
    again = fn()
    assert again.data_ptr() == buf.data_ptr() and not again.isnan().any()
    assert (again.double() - ref).abs().max().item() == err


def test_merge_chunks_is_merge_states_with_unseen_chunks():
    r, c, h, d = 3, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    o = torch.randn(r * c, h, d, generator=g)
    lse = torch.randn(r * c, h, generator=g) * 3
    lse.view(r, c, h)[1, :2] = float("-inf")  # chunks that saw no key
    lse.view(r, c, h)[2] = float("-inf")  # a request that saw none
    o.view(r, c, h, d)[lse.view(r, c, h) == float("-inf")] = 0
    out = torch.full((r, h, d), float("nan"))
    dp._merge_chunks[(r, h)](o, lse, out, C=c, HQ=h, D=d)
    ref, _ = merge_states(o.view(r, c, h, d).double(), lse.view(r, c, h).double())
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() <= 4 * torch.finfo(F32).eps * ref.abs().max()
