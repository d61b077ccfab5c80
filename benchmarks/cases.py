"""The benchmark workloads as plain data (no torch: listed and tested on the CPU machine).

A Case is one attention problem: per-request query and KV lengths, heads, head dim, mask, and how
the KV is addressed (``dense`` [B, S, H, D] batch, ``ragged`` indptr offsets, ``paged`` page table).
``panel`` and ``x`` say where it goes in the plot (one panel per ``panel`` value; ``x`` is S, or a
label for categorical suites).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from .flops import attention_flops

SUITES = ("fa3", "flashinfer", "paged", "gqa", "varlen")
FA3_TOKENS = 16 * 1024
FA3_HD = 2048
FLASHINFER_SWEEP = ((128, 1024), (64, 2048), (32, 4096), (16, 8192), (1, 32768))


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    layout: str  # "dense" | "ragged" | "paged"
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    page_size: int = 0  # paged only
    panel: str = ""
    x: float | str = 0
    group_key: str = ""  # cases of one group share lengths (paged vs ragged)
    fixed_case: str = ""  # varlen: the fixed-length case of the same total tokens
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def batch(self) -> int:
        return len(self.qo_lens)

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def tokens(self) -> int:
        return sum(self.qo_lens)

    @property
    def kv_tokens(self) -> int:
        return sum(self.kv_lens)

    @property
    def uniform(self) -> bool:
        return len(set(self.qo_lens)) <= 1 and self.qo_lens == self.kv_lens

    @property
    def seq_len(self) -> int:
        return max(self.qo_lens) if self.qo_lens else 0

    @property
    def flops(self) -> float:
        return attention_flops(self.qo_lens, self.kv_lens, self.num_qo_heads, self.head_dim,
                               self.head_dim, self.causal)

    @property
    def timing_group(self) -> str:
        """Cases whose ratios compare with each other (paged vs ragged on the same lengths, a
        varlen batch and its fixed-length companion) share this key: the harness times them
        interleaved, so that drift of the clock over the run cannot tilt their ratio."""
        if self.group_key:
            return f"{self.suite}/{self.group_key}"
        return f"{self.suite}/{self.fixed_case or self.name}"

    def row_fields(self) -> dict:
        """The case's columns in every result row (beside suite, case, provider, timings)."""
        d = {
            "B": self.batch, "S": self.seq_len, "Hq": self.num_qo_heads,
            "Hkv": self.num_kv_heads, "D": self.head_dim, "causal": self.causal,
            "layout": self.layout, "tokens": self.tokens, "flops": self.flops,
            "panel": self.panel, "x": self.x,
        }
        if self.layout == "paged":
            d["page_size"] = self.page_size
        if self.group_key:
            d["group_key"] = self.group_key
        if self.fixed_case:
            d["fixed_case"] = self.fixed_case
        if not self.uniform:
            d["lengths"] = list(self.qo_lens)
        d.update(self.extra)
        return d

    def as_dict(self) -> dict:
        return asdict(self)


def _uniform(suite, name, layout, b, s, hq, hkv, d, causal, **kw) -> Case:
    return Case(suite, name, layout, (s,) * b, (s,) * b, hq, hkv, d, causal, **kw)


def fa3_cases(quick: bool = False) -> list[Case]:
    """FA3-paper sweep: B*S = 16k tokens, H*D = 2048, D 64/128/256, S 512..16k, causal and not."""
    if quick:
        grid = [(128, s, c) for s in (1024, 4096, 16384) for c in (False, True)]
        grid += [(64, 4096, True), (256, 4096, True)]
    else:
        grid = [(d, s, c) for d in (64, 128, 256) for c in (False, True)
                for s in (512, 1024, 2048, 4096, 8192, 16384)]
    out = []
    for d, s, c in grid:
        h = FA3_HD // d
        name = f"D{d} S{s}" + (" causal" if c else "")
        out.append(_uniform("fa3", name, "dense", FA3_TOKENS // s, s, h, h, d, c,
                            panel=f"D{d} " + ("causal" if c else "non-causal"), x=s))
    return out


def _fi_sweep(quick: bool):
    return ((32, 4096), (16, 8192)) if quick else FLASHINFER_SWEEP


def flashinfer_cases(quick: bool = False) -> list[Case]:
    """FlashInfer's bench_hopper_attention sweep: 32/32 heads, D 128, causal, ragged KV."""
    return [_uniform("flashinfer", f"B{b} S{s}", "ragged", b, s, 32, 32, 128, True,
                     panel="H32/32 D128 causal, ragged", x=s, group_key=f"B{b} S{s}")
            for b, s in _fi_sweep(quick)]


def paged_cases(quick: bool = False) -> list[Case]:
    """The FlashInfer sweep with the KV in a paged cache (pages 16 and 1, shuffled page indices),
    beside our ragged run on the same lengths (the paged/ragged ratios)."""
    out = []
    for b, s in _fi_sweep(quick):
        g = f"B{b} S{s}"
        out.append(_uniform("paged", f"{g} ragged", "ragged", b, s, 32, 32, 128, True,
                            panel="ragged", x=s, group_key=g))
        for p in (16, 1):
            out.append(_uniform("paged", f"{g} page{p}", "paged", b, s, 32, 32, 128, True,
                                page_size=p, panel=f"page {p}", x=s, group_key=g))
    return out


def gqa_cases(quick: bool = False) -> list[Case]:
    """GQA 32q/8kv and 64q/8kv heads, D 128, B 1, S 8192, causal."""
    heads = ((32, 8),) if quick else ((32, 8), (64, 8))
    return [_uniform("gqa", f"Hq{hq} Hkv{hkv} S8192", "dense", 1, 8192, hq, hkv, 128, True,
                     panel="B1 S8192 D128 causal", x=f"{hq}/{hkv}") for hq, hkv in heads]


def uniform_lengths(n: int = 16, lo: int = 512, hi: int = 4096, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def zipf_lengths(n: int = 16, mean: int = 1024, s: float = 1.0, min_len: int = 16,
                 seed: int = 0) -> list[int]:
    """Zipf-skewed lengths: rank r gets a share proportional to 1 / r**s, scaled so the mean is
    ``mean`` (16 requests, s = 1: the longest ~4.8k, the shortest ~300), shuffled."""
    w = [1.0 / (r ** s) for r in range(1, n + 1)]
    scale = mean * n / sum(w)
    lens = [max(min_len, round(x * scale)) for x in w]
    random.Random(seed).shuffle(lens)
    return lens


def varlen_cases(quick: bool = False) -> list[Case]:
    """B 16, causal, D 128, H 32: lengths uniform 512..4096 and Zipf-skewed (mean 1024), each
    with the fixed-length batch of the same total tokens (16 x total/16) for the load-balance
    ratio."""
    del quick  # four cases either way: the ratio needs its fixed-length companions
    out = []
    for label, lens in (("uniform 512-4096", uniform_lengths()), ("zipf mean1024", zipf_lengths())):
        fixed_len = round(sum(lens) / len(lens))
        fixed_name = f"fixed {fixed_len} (= {label.split()[0]} total)"
        out.append(Case("varlen", label, "ragged", tuple(lens), tuple(lens), 32, 32, 128, True,
                        panel="B16 H32 D128 causal", x=label, fixed_case=fixed_name))
        out.append(_uniform("varlen", fixed_name, "ragged", len(lens), fixed_len, 32, 32, 128,
                            True, panel="B16 H32 D128 causal", x=fixed_name))
    return out


def smoke_cases(quick: bool = False) -> list[Case]:
    """Tiny shapes over every layout, for the CPU test of the whole loop (not a benchmark)."""
    del quick
    return [
        _uniform("smoke", "dense D64 S128 causal", "dense", 2, 128, 4, 4, 64, True, panel="p", x=128),
        _uniform("smoke", "dense gqa S64", "dense", 1, 64, 4, 2, 64, False, panel="p", x=64),
        _uniform("smoke", "B2 S64 ragged", "ragged", 2, 64, 2, 2, 64, True, panel="q", x=64,
                 group_key="B2 S64"),
        _uniform("smoke", "B2 S64 page16", "paged", 2, 64, 2, 2, 64, True, page_size=16,
                 panel="q", x=64, group_key="B2 S64"),
        Case("smoke", "varlen", "ragged", (40, 90, 17), (40, 90, 17), 2, 2, 64, True,
             panel="v", x="varlen"),
    ]


SUITE_CASES = {
    "fa3": fa3_cases, "flashinfer": flashinfer_cases, "paged": paged_cases, "gqa": gqa_cases,
    "varlen": varlen_cases, "smoke": smoke_cases,
}


def cases_for(suites, quick: bool = False) -> list[Case]:
    out = []
    for s in suites:
        out.extend(SUITE_CASES[s](quick))
    return out
