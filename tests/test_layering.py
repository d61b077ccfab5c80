"""Imports flow down (docs/design.md, Layers): ops/ never imports compiled_attn's public layer
or fx_passes; fx_passes imports only compiled_attn.ops and its own modules; inside ops/, the
leaf modules import nothing of ours, the reference only the mode codes, and the Gluon launcher
never the Triton one (prefill_kernel imports prefill_gluon, not the reverse).

Two checks. Each module's own import statements, read with ast (function-level imports
included: those run only when called). And each layer imported alone in a fresh interpreter
under a bare stand-in ``compiled_attn`` package (its ``__init__``, which imports the whole
public layer, never runs), then sys.modules read back: what the layer's import really pulls in.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> the package name it installs as
PACKAGES = {"ops": "compiled_attn.ops", "fx_passes": "compiled_attn.fx_passes"}
# ops/ modules that import nothing of ours
LEAVES = ("modes", "tiles", "device", "policy")


def _module_name(folder: str, path: pathlib.Path) -> str:
    pkg = PACKAGES[folder]
    return pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"


def _imports(folder: str, path: pathlib.Path) -> set[str]:
    """Every module an import statement of this file names (relative ones resolved; ``from X
    import y`` also counts X.y, which is a submodule where y is one)."""
    name = _module_name(folder, path)
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return found


def _ours(mods: set[str]) -> set[str]:
    return {m for m in mods if m == "compiled_attn" or m.startswith("compiled_attn.")
            or m.split(".")[0] in PACKAGES}


def _sources(folder: str) -> list[pathlib.Path]:
    files = sorted((ROOT / folder).glob("*.py"))
    assert files, folder
    return files


def _in(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


@pytest.mark.parametrize("path", _sources("ops"), ids=lambda p: p.name)
def test_ops_import_statements_stay_in_ops(path):
    ours = _ours(_imports("ops", path))
    # `from compiled_attn.ops import x` names compiled_attn.ops; nothing else of the package
    bad = sorted(m for m in ours if not _in(m, "compiled_attn.ops"))
    assert not bad, f"ops/{path.name} imports {bad}: ops/ must not reach compiled_attn's " \
                    "public layer or fx_passes"


@pytest.mark.parametrize("path", _sources("fx_passes"), ids=lambda p: p.name)
def test_fx_passes_import_statements_reach_only_ops(path):
    ours = _ours(_imports("fx_passes", path))
    bad = sorted(m for m in ours
                 if not (_in(m, "compiled_attn.ops") or _in(m, "compiled_attn.fx_passes")))
    assert not bad, f"fx_passes/{path.name} imports {bad}: only compiled_attn.ops and " \
                    "fx_passes' own modules"


def test_ops_inner_layers():
    imports = {p.stem: _ours(_imports("ops", p)) for p in _sources("ops")}
    for leaf in LEAVES:
        assert not imports[leaf], f"ops/{leaf}.py is a leaf but imports {sorted(imports[leaf])}"
    assert {m for m in imports["reference"] if m != "compiled_attn.ops"} == {
        "compiled_attn.ops.modes", "compiled_attn.ops.modes.MASK_CAUSAL",
        "compiled_attn.ops.modes.MASK_CUSTOM", "compiled_attn.ops.modes.POS_ALIBI",
        "compiled_attn.ops.modes.POS_ROPE_LLAMA"}, imports["reference"]
    assert not any(_in(m, "compiled_attn.ops.prefill_kernel") for m in imports["prefill_gluon"])
    assert not any(_in(m, "compiled_attn.ops.contracts") for m in imports["reference"])


# Runs in a fresh interpreter: a bare compiled_attn package (no __init__), the layers named in
# argv[1:] loaded from their folders under their installed names, then every module of each.
_ALONE = textwrap.dedent("""
    import importlib, importlib.util, json, pathlib, sys, types

    root = pathlib.Path(sys.argv[1])
    pkg = types.ModuleType("compiled_attn")
    pkg.__path__ = []
    sys.modules["compiled_attn"] = pkg
    for folder in sys.argv[2:]:
        name = "compiled_attn." + folder
        spec = importlib.util.spec_from_file_location(
            name, root / folder / "__init__.py", submodule_search_locations=[str(root / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(pkg, folder, mod)
        for f in sorted((root / folder).glob("*.py")):
            if f.stem != "__init__":
                importlib.import_module(name + "." + f.stem)
    print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith("compiled_attn")),
                      "public_init_ran": hasattr(pkg, "__version__")}))
""")


def _alone(*folders: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _ALONE, str(ROOT), *folders], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["public_init_ran"]
    return got["modules"]


def test_ops_alone_pulls_in_nothing_above_it():
    mods = _alone("ops")
    assert "compiled_attn.ops.dispatch" in mods and "compiled_attn.ops.schedule" in mods
    bad = [m for m in mods if m != "compiled_attn" and not _in(m, "compiled_attn.ops")]
    assert not bad, f"importing compiled_attn.ops alone imported {bad}"


def test_fx_passes_alone_pulls_in_only_ops():
    mods = _alone("ops", "fx_passes")
    assert "compiled_attn.fx_passes.rewrite" in mods
    bad = [m for m in mods if m != "compiled_attn"
           and not (_in(m, "compiled_attn.ops") or _in(m, "compiled_attn.fx_passes"))]
    assert not bad, f"importing compiled_attn.fx_passes alone imported {bad}"
