"""In-process A/B of host code (dev tool): the host suite's eager calls timed with chosen
functions of the working tree swapped for another tree's versions and back, rounds interleaved,
all in one process.

The GPU hosts' speed moves between processes and calls (up to 1.5-2x, benchmarks/NOTES.md,
2026-12-01): two trees timed in two processes compare the hosts as much as the code. Here the
base tree's source of each named function is compiled into the live module's namespace (so it
sees the working tree's globals), and every round times each case under both versions in turn.
A swap names a file of the repository and a function or method in it, FILE:QUALNAME
(``ops/launch.py:Memo.replay_fast``); a name the working tree lacks is added for the base
variant and removed again, one the base lacks is removed for it. --patch OLD=>NEW rewrites the
base sources' text first (e.g. where the working tree records something the base code does not
know: the base code runs on the working tree's recorded calls).

    git archive HEAD~1 ops compiled_attn | tar -x -C /tmp/base
    python -m dev.swap_ab --base /tmp/base --swap ops/launch.py:Memo._key \\
        --swap ops/launch.py:Memo.replay_fast --cases pod_run,paged_run --rounds 6
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import textwrap
from pathlib import Path

# the repository's source folders -> their package (ops/ and fx_passes/ install under
# compiled_attn)
_PACKAGES = {"ops": "compiled_attn.ops", "fx_passes": "compiled_attn.fx_passes",
             "compiled_attn": "compiled_attn"}


def module_of(path: str):
    """The live module of repository file ``path`` (``ops/launch.py`` ->
    compiled_attn.ops.launch)."""
    parts = Path(path).with_suffix("").parts
    if parts[0] not in _PACKAGES:
        raise ValueError(f"--swap: {path!r} is not under {sorted(_PACKAGES)}")
    name = ".".join((_PACKAGES[parts[0]], *parts[1:]))
    return importlib.import_module(name[:-len(".__init__")] if name.endswith(".__init__")
                                   else name)


def _def_source(tree: ast.Module, text: str, qualname: str) -> str | None:
    """The source of function / method ``qualname`` in a parsed file, dedented; None where the
    file has no such definition."""
    names = qualname.split(".")
    scope = tree.body
    for i, name in enumerate(names):
        found = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef))
                      and n.name == name), None)
        if found is None:
            return None
        if i == len(names) - 1:
            if isinstance(found, ast.ClassDef):
                raise ValueError(f"--swap: {qualname} is a class; name a function or method")
            return textwrap.dedent(ast.get_source_segment(text, found))
        scope = found.body
    return None


class Swap:
    """One FILE:QUALNAME: its live version and the base tree's, switched by use()."""

    _ABSENT = object()

    def __init__(self, spec: str, base: Path, patches: list[tuple[str, str]]):
        path, _, qualname = spec.partition(":")
        if not qualname:
            raise ValueError(f"--swap: {spec!r}: give FILE:QUALNAME")
        self.spec, self.module = spec, module_of(path)
        *owner_path, self.name = qualname.split(".")
        owner = self.module
        for part in owner_path:
            owner = getattr(owner, part)
        self.owner = owner
        self.new = owner.__dict__.get(self.name, self._ABSENT)
        text = (base / path).read_text()
        for old, new in patches:
            text = text.replace(old, new)
        src = _def_source(ast.parse(text), text, qualname)
        if src is None:
            self.old = self._ABSENT
        else:
            scope: dict = {}
            exec(compile(src, f"{base / path} ({qualname})", "exec"), self.module.__dict__,
                 scope)
            self.old = scope[self.name]
        if self.old is self._ABSENT and self.new is self._ABSENT:
            raise ValueError(f"--swap: neither tree defines {spec}")

    def use(self, which: str) -> None:
        f = self.old if which == "base" else self.new
        if f is self._ABSENT:
            if self.name in self.owner.__dict__:
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, f)


def use(swaps: list[Swap], which: str) -> None:
    """Every swap's "base" or "new" version in place."""
    for s in swaps:
        s.use(which)


def _cases(names: list[str]) -> dict:
    """The host suite's eager run() calls of compiled_attn by name."""
    import torch

    import compiled_attn as ca
    from benchmarks import host

    dev = torch.device("cuda")
    x = host._inputs(dev)
    calls = dict(host._wrappers(ca, x, dev, "compiled_attn"), pod_run=host._pod(ca, x, dev),
                 pod_run_layers=host._pod(ca, x, dev, layers=True),
                 batch_pod_run=host._batch_pod(ca, x, dev))
    unknown = set(names) - set(calls)
    if unknown:
        raise ValueError(f"--cases: unknown {sorted(unknown)}; known: {sorted(calls)}")
    return {n: calls[n] for n in names}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other tree's root")
    ap.add_argument("--swap", action="append", required=True, metavar="FILE:QUALNAME",
                    help="a function or method to swap (repeatable)")
    ap.add_argument("--patch", action="append", default=[], metavar="OLD=>NEW",
                    help="rewrite the base sources' text before compiling (repeatable)")
    ap.add_argument("--cases", default="single_prefill,paged_run,pod_run",
                    help="comma-separated host-suite cases")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="JSON of every round's figures")
    args = ap.parse_args(argv)
    from benchmarks.host import host_us  # (calls queued behind a sleeping GPU)

    patches = [tuple(p.split("=>", 1)) for p in args.patch]
    swaps = [Swap(s, args.base, patches) for s in args.swap]
    cases = _cases(args.cases.split(","))
    for fn in cases.values():  # (records, compiles)
        for _ in range(5):
            fn()
    res: dict = {}
    for r in range(args.rounds):
        for which in (("base", "new") if r % 2 == 0 else ("new", "base")):
            use(swaps, which)
            for name, fn in cases.items():
                res.setdefault(name, {}).setdefault(which, []).append(host_us(fn, args.calls))
    use(swaps, "new")
    print(f"{'case':24} {'base us':>9} {'new us':>9}  new/base")
    for name, v in res.items():
        b, n = statistics.median(v["base"]), statistics.median(v["new"])
        print(f"{name:24} {b:9.2f} {n:9.2f}  {n / b:.3f}")
    if args.out:
        args.out.write_text(json.dumps(dict(swaps=args.swap, patches=args.patch, rounds=res),
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
