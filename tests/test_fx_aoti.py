"""torch.export -> compiled_attn rewrite -> torch.export.save/load -> AOTInductor package ->
load and run in a fresh process that imports compiled_attn -> output vs eager. Slow (an
AOTInductor C++ build each), so two representative models: HF Llama (sdpa, GQA, left padding)
causal and with left padding (custom mask: a known AOTI bug, strict xfail)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import compiled_attn
from compiled_attn import fx_passes

from .test_fx_models import assert_close_rel, hf_model, inputs

LOADER = textwrap.dedent("""
    import sys, torch
    import compiled_attn  # registers the compiled_attn ops the package calls
    pkg, io, out_path = sys.argv[1:4]
    args = torch.load(io)
    runner = torch._inductor.aoti_load_package(pkg)
    torch.save(runner(*args), out_path)
""")


def roundtrip(tmp_path, model, args):
    with torch.no_grad():
        ref = model(*args)
        fx_passes.counters.clear()
        ep = compiled_attn.export(model, args)
    assert fx_passes.counters["rewritten"] == 2, dict(fx_passes.counters)
    torch.export.save(ep, tmp_path / "ep.pt2")
    ep2 = torch.export.load(tmp_path / "ep.pt2")
    assert any(n.target is torch.ops.compiled_attn.single_prefill.default
               for n in ep2.graph.nodes)
    pkg = torch._inductor.aoti_compile_and_package(ep2, package_path=str(tmp_path / "m.pt2"))
    torch.save(args, tmp_path / "io.pt")
    subprocess.run([sys.executable, "-c", LOADER, pkg, str(tmp_path / "io.pt"),
                    str(tmp_path / "out.pt")], check=True, timeout=300)
    return torch.load(tmp_path / "out.pt"), ref


@pytest.mark.slow
def test_aoti_llama_sdpa_causal(tmp_path):
    model = hf_model("llama", "sdpa")
    ids, _ = inputs(None)
    out, ref = roundtrip(tmp_path, model, (ids, None))
    assert_close_rel(out, ref)


# Known bug (open): with a custom mask (packed bits) the AOTInductor package computes wrong
# outputs, while ep.module() and torch.compile(ep.module()) of the same rewritten program are
# correct, and AOTI is correct for MASK_CAUSAL / MASK_NONE. Strict: passes -> remove the xfail.
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="AOTInductor + custom-mask single_prefill: wrong output")
def test_aoti_llama_sdpa_padding(tmp_path):
    model = hf_model("llama", "sdpa")
    ids, am = inputs("left")
    out, ref = roundtrip(tmp_path, model, (ids, am))
    assert_close_rel(out, ref, am.bool())
