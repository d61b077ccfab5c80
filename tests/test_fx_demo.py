"""``python -m compiled_attn`` (make demo) runs on CPU: exit 0, both sections OK, and the model
section reports 2 rewrites for compile and for export + AOTInductor, each within tolerance."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_on_cpu():
    res = subprocess.run([sys.executable, "-m", "compiled_attn"], capture_output=True, text=True,
                         timeout=300)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-3000:]
    for path in ("compiled_attn.compile", "export + AOTInductor"):
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(path)), None)
        assert line is not None, out
        assert "rewritten 2" in line and line.rstrip().split()[-1] != "FAILED", line
        assert " ok" in line, line
    assert "demo OK" in out, out
