"""FLOP counting from the actual lengths (no torch: the CPU tests call it on tiny shapes).

A request with qo query rows and kv keys costs 2 * pairs * Hq * (Dqk + Dvo) FLOPs (one multiply-add
per element of QK^T and of PV), i.e. 4 * qo * kv * H * D for equal head dims and no mask.
Causal: on square requests (qo == kv) the pairs are halved, qo * kv / 2, the convention of the FA2/FA3
papers and of FlashInfer's benchmarks (so our TFLOP/s compare with their published figures). On
non-square requests the visible pairs are counted exactly, bottom-right aligned as in FlashInfer and
ops/reference.py: query row i sees keys j <= i + kv - qo.
"""

from __future__ import annotations

from collections.abc import Sequence


def causal_pairs_exact(qo: int, kv: int) -> int:
    """Number of (query, key) pairs a bottom-right aligned causal mask leaves visible."""
    if qo <= 0 or kv <= 0:
        return 0
    # Row i sees min(kv, max(0, i + kv - qo + 1)) keys; the count reaches kv only at the last row,
    # so the visible counts run over a, a+1, ..., kv with a = max(1, kv - qo + 1).
    a = max(1, kv - qo + 1)
    return (kv + a) * (kv - a + 1) // 2


def visible_pairs(qo: int, kv: int, causal: bool) -> float:
    """Pairs counted for the FLOP rate: all pairs; causal square halved; causal otherwise exact."""
    if qo <= 0 or kv <= 0:
        return 0
    if not causal:
        return qo * kv
    if qo == kv:
        return qo * kv / 2
    return causal_pairs_exact(qo, kv)


def attention_flops(qo_lens: Sequence[int], kv_lens: Sequence[int], num_qo_heads: int,
                    head_dim_qk: int, head_dim_vo: int | None = None, causal: bool = False) -> float:
    """Total FLOPs of a batch of requests (GQA does not change the count: every query head
    does its own QK^T and PV)."""
    if len(qo_lens) != len(kv_lens):
        raise ValueError(f"qo_lens has {len(qo_lens)} requests but kv_lens has {len(kv_lens)}")
    dvo = head_dim_qk if head_dim_vo is None else head_dim_vo
    pairs = sum(visible_pairs(int(q), int(k), causal) for q, k in zip(qo_lens, kv_lens))
    return 2.0 * pairs * num_qo_heads * (head_dim_qk + dvo)


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
