"""The public API accepts every call FlashInfer's accepts: each mirrored entry point against
the signatures extracted from FlashInfer's sources (tests/data/flashinfer_signatures.json,
written by tests/data/flashinfer_signatures.py from the release the H100 benchmarks run).

A FlashInfer call binds to ours when every FlashInfer parameter exists here, its positional
ones at the same positions, each optional one optional here too, with the same default
unless DEFAULT_DIFFERENCES says why not; and every parameter of ours that FlashInfer lacks is
optional. (That a parameter takes effect is the other API tests' job.)"""

from __future__ import annotations

import inspect
import json
import pathlib

import pytest

import compiled_attn

DATA = json.loads((pathlib.Path(__file__).parent / "data" / "flashinfer_signatures.json")
                  .read_text())
SIGS = DATA["signatures"]

# (entry point, parameter) -> why our default differs from FlashInfer's (same meaning, or ours
# applies an argument FlashInfer ignores)
DEFAULT_DIFFERENCES = {
    ("PODWithPagedKVCacheWrapper.plan", "q_data_type"):
        "None resolves to float16, after the deprecated data_type, which FlashInfer's "
        "'float16' default makes miss q",
    ("BatchPODWithPagedKVCacheWrapper.plan", "q_data_type"): "as PODWithPagedKVCacheWrapper's",
    ("PODWithPagedKVCacheWrapper.run", "kv_layout_d"): "None: the wrapper's layout",
    ("PODWithPagedKVCacheWrapper.run", "pos_encoding_mode_d"):
        "None: the plan's (FlashInfer ignores the argument; ours applies it when given)",
    ("PODWithPagedKVCacheWrapper.run", "window_left_d"):
        "None: the plan's (FlashInfer ignores the argument; ours applies it when given)",
}


def _ours(name: str):
    obj = compiled_attn
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            pytest.fail(f"compiled_attn has no {name} (FlashInfer {DATA['flashinfer']} has)")
    return obj


def _kind(p: inspect.Parameter) -> str:
    return {p.POSITIONAL_ONLY: "pos", p.POSITIONAL_OR_KEYWORD: "pos", p.VAR_POSITIONAL: "varpos",
            p.KEYWORD_ONLY: "kwonly", p.VAR_KEYWORD: "varkw"}[p.kind]


@pytest.mark.parametrize("name", sorted(SIGS))
def test_flashinfer_calls_bind(name):
    fi_sig, ours = SIGS[name], _ours(name)
    if fi_sig and fi_sig[0] == "alias":  # e.g. begin_forward = plan: the same function here
        target = _ours(f"{name.rsplit('.', 1)[0]}.{fi_sig[1]}")
        assert ours is target, f"{name} should be {fi_sig[1]}"
        return
    if fi_sig and fi_sig[0] == "partial":  # functools.partial(target, **kw): callable here
        assert callable(ours)
        return
    params = inspect.signature(ours).parameters
    positional = [n for n, p in params.items() if _kind(p) == "pos"]
    problems = []
    fi_names = set()
    for i, (pname, kind, default, has_default) in enumerate(fi_sig):
        fi_names.add(pname)
        if kind == "varpos":
            if not any(_kind(p) == "varpos" for p in params.values()):
                problems.append(f"*{pname}: FlashInfer takes extra positional arguments")
            continue
        if kind == "varkw":
            if not any(_kind(p) == "varkw" for p in params.values()):
                problems.append(f"**{pname}: FlashInfer takes extra keyword arguments")
            continue
        p = params.get(pname)
        if p is None:
            problems.append(f"{pname}: missing")
            continue
        if kind == "pos" and (i >= len(positional) or positional[i] != pname):
            problems.append(f"{pname}: FlashInfer's positional parameter {i}, ours is "
                            f"{positional[i] if i < len(positional) else 'keyword-only'}")
        if kind == "kwonly" and _kind(p) not in ("pos", "kwonly"):
            problems.append(f"{pname}: not accepted by keyword")
        if not has_default:
            continue
        if p.default is inspect.Parameter.empty:
            problems.append(f"{pname}: optional in FlashInfer (default {default}), required here")
        elif repr(p.default) != default and (name, pname) not in DEFAULT_DIFFERENCES:
            # FlashInfer's default as source text; ours as a value
            try:
                same = eval(default, {}) == p.default
            except Exception:  # a name only FlashInfer defines
                same = False
            if not same:
                problems.append(f"{pname}: default {p.default!r}, FlashInfer's {default}")
    for pname, p in params.items():
        if pname not in fi_names and _kind(p) in ("pos", "kwonly") and \
                p.default is inspect.Parameter.empty:
            problems.append(f"{pname}: required here, FlashInfer has no such parameter")
    assert not problems, f"{name} against FlashInfer {DATA['flashinfer']}:\n  " + \
        "\n  ".join(problems)


def test_default_differences_are_current():
    """Every listed difference still exists (a stale entry would hide a future one)."""
    for name, pname in DEFAULT_DIFFERENCES:
        fi_default = next(p[2] for p in SIGS[name] if p[0] == pname)
        ours = inspect.signature(_ours(name)).parameters[pname].default
        assert repr(ours) != fi_default, (name, pname)
