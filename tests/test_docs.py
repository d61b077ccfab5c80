"""The user docs against the code: docs/api.md is the rendering of the docstrings
(docs/gen_api.py) and names every public name; the docs' Python examples run on CPU; every
docs page a file refers to exists."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
import re

import pytest
import torch

import compiled_attn

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Pages whose ```python blocks run in order, as one script per page.
EXAMPLE_PAGES = ("index.md", "spec.md", "flashinfer-differences.md", "compile-and-export.md",
                 "troubleshooting.md")
# A block right after this comment is shown, not run here (its cost is covered elsewhere).
NOT_RUN = "<!-- not run by tests/test_docs.py"


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_md_is_the_rendering_of_the_docstrings():
    committed = (DOCS / "api.md").read_text()
    assert committed == _gen_api().render(), (
        "docs/api.md differs from the docstrings: run `.venv/bin/python docs/gen_api.py`")


def test_api_md_names_every_public_name():
    text = (DOCS / "api.md").read_text()
    headings = set(re.findall(r"^#{3,4} `([^`]+)`", text, re.M))
    names = [f"compiled_attn.{n}" for n in dir(compiled_attn)
             if not n.startswith("_") and not inspect.ismodule(getattr(compiled_attn, n))]
    for sub in ("hf", "fx_passes", "ops.dispatch"):
        mod = importlib.import_module(f"compiled_attn.{sub}")
        names += [f"compiled_attn.{sub}.{n}" for n in mod.__all__]
    names += [f"torch.ops.compiled_attn.{n}" for n in
              ("single_prefill", "batch_ragged_prefill", "batch_paged_prefill",
               "pod_prefill_decode")]
    missing = [n for n in names if n not in headings]
    assert not missing, f"public names without a section in docs/api.md: {missing}"
    for full in names:
        obj = eval(full, {"compiled_attn": compiled_attn, "torch": torch})  # noqa: S307
        if inspect.isclass(obj):
            short = full.rsplit(".", 1)[1]
            methods = [m for m in dir(obj) if not m.startswith("_")]
            lost = [m for m in methods if f"{short}.{m}" not in headings]
            assert not lost, f"{full}: methods without a section in docs/api.md: {lost}"


def test_public_docstrings_give_tensor_shapes():
    """Every public function or method that takes a tensor documents it, with a shape
    (a ``[...]`` in its docstring or, for a constructor, its class's)."""
    gen = _gen_api()
    bad = []
    for _, full, obj in gen.public_names():
        targets = [(full, obj, "")]
        if inspect.isclass(obj):
            # partialmethods (run_return_lse) document themselves as their method's call
            targets = [(f"{full}.{m}", gen._raw(obj, m), obj.__doc__ or "")
                       for m in ["__init__", *gen._members(obj)]]
        for name, fn, extra in targets:
            if not inspect.isfunction(fn):
                continue
            tensors = [p for p in inspect.signature(fn).parameters.values()
                       if "Tensor" in str(p.annotation)]
            text = (fn.__doc__ or "") + extra
            if tensors and "[" not in text:
                bad.append(name)
            bad += [f"{name}({p.name})" for p in tensors if p.name not in text]
    assert not bad, f"tensor arguments without a documented shape: {bad}"


def _examples(page: str) -> str:
    text = (DOCS / page).read_text()
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
        if not before.startswith(NOT_RUN):
            blocks.append(m.group(1))
    return "\n".join(blocks)


@pytest.mark.parametrize("page", EXAMPLE_PAGES)
def test_docs_examples_run(page, tmp_path, monkeypatch):
    code = _examples(page)
    assert code, f"docs/{page} has no runnable example"
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    compiled_attn.fx_passes.counters.clear()
    try:
        exec(compile(code, f"docs/{page}", "exec"), {"__name__": "docs_example"})  # noqa: S102
    finally:
        torch._dynamo.reset()


def test_docs_references_exist():
    """Every docs/<page>.md named in the code, tests or docs, and every relative link between
    the docs pages, exists."""
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md") and ".venv" not in p.parts
             and "build" not in p.parts and p.is_file()]
    missing = set()
    for f in files:
        text = f.read_text(errors="replace")
        missing |= {f"{f.relative_to(ROOT)}: {m}" for m in re.findall(r"docs/[\w./-]+\.md", text)
                    if not (ROOT / m).exists()}
        if f.parent == DOCS:
            for link in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", text):
                if not (DOCS / link).exists():
                    missing.add(f"{f.relative_to(ROOT)}: {link}")
    assert not missing, sorted(missing)


def test_design_lists_every_launch_policy_setting():
    """docs/design.md names the launch policy's settings in one sentence: all of them."""
    from compiled_attn.ops.policy import POLICY

    text = (DOCS / "design.md").read_text()
    listed = re.search(r"The policy's settings \(([^)]*)\)", text)
    assert listed, "docs/design.md: the sentence listing the policy's settings is gone"
    names = set(re.sub(r"\s+", " ", listed.group(1)).replace(" ", "").split(","))
    assert names == set(POLICY.settings()), sorted(names ^ set(POLICY.settings()))
