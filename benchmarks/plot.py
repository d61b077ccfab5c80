"""python -m benchmarks.plot benchmarks/results/h100.json: one PNG per suite beside the JSON
(<stem>_<suite>.png): TFLOP/s against S (or against the case label where x is not a number),
one line per provider, one panel per case family (e.g. D and causal in the fa3 suite)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import results


def _panels(rows):
    order = []
    for r in rows:
        p = r.get("panel", "")
        if p not in order:
            order.append(p)
    return order


def plot_suite(doc: dict, suite: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .providers import ALL_PROVIDERS

    rows = [r for r in doc["rows"] if r["suite"] == suite]
    panels = _panels(rows)
    ncols = min(3, len(panels)) or 1
    nrows = -(-len(panels) // ncols) or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
    providers = [p for p in ALL_PROVIDERS if any(r["provider"] == p for r in rows)]
    for r in rows:
        if r["provider"] not in providers:
            providers.append(r["provider"])
    cmap = plt.get_cmap("tab10")
    # one color and marker per provider in every suite's plot (the harness's providers in its
    # order, then any other)
    order = list(ALL_PROVIDERS) + [p for p in providers if p not in ALL_PROVIDERS]
    slot = {p: i for i, p in enumerate(order)}
    style = {p: dict(color=cmap(slot[p] % 10), marker="os^vDP*Xhp"[slot[p] % 10],
                     lw=2.4 if p == "compiled_attn" else 1.4) for p in providers}
    for ax, panel in zip(axes.flat, panels):
        prow = [r for r in rows if r.get("panel", "") == panel]
        xs = [r.get("x", r.get("S")) for r in prow]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
        cats = []
        if not numeric:
            for x in xs:
                if str(x) not in cats:
                    cats.append(str(x))
        for p in providers:
            ok = [r for r in prow if r["provider"] == p and r.get("status", "ok") == "ok"
                  and r.get("tflops") is not None]
            if not ok:
                continue
            if numeric:
                pts = sorted((r.get("x", r.get("S")), r["tflops"]) for r in ok)
            else:
                pts = sorted((cats.index(str(r.get("x", r.get("S")))), r["tflops"]) for r in ok)
            ax.plot([a for a, _ in pts], [b for _, b in pts], label=p, **style[p])
        if numeric:
            ax.set_xscale("log", base=2)
            ticks = sorted({x for x in xs})
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{int(t) // 1024}k" if t >= 1024 else str(int(t))
                                for t in ticks])
            ax.set_xlabel("S (tokens per request)")
        else:
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels(cats, rotation=20, ha="right", fontsize=8)
            ax.set_xlim(-0.5, len(cats) - 0.5)
        ax.set_title(panel or suite, fontsize=10)
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    # a one-panel figure is too narrow for 7 legend entries or the title on one line
    ncol = min(len(labels), 4 if ncols == 1 else 7) if handles else 1
    legend_rows = -(-len(labels) // ncol)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    sep = "\n" if ncols == 1 else ", "
    fig.suptitle(f"{suite}: {doc['gpu']}{sep}torch {doc['torch']}, triton {doc['triton']}, "
                 f"{doc['date'][:10]}", fontsize=10)
    bottom = 0.06 * legend_rows / nrows if handles else 0
    fig.tight_layout(rect=(0, bottom, 1, 0.95 if ncols > 1 else 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__)
    ap.add_argument("json", help="results file, e.g. benchmarks/results/h100.json")
    a = ap.parse_args(argv)
    src = Path(a.json)
    doc = results.load(src)
    suites = []
    for r in doc["rows"]:
        if r["suite"] not in suites:
            suites.append(r["suite"])
    for s in suites:
        out = plot_suite(doc, s, src.with_name(f"{src.stem}_{s}.png"))
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
