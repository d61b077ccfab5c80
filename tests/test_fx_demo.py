"""``python -m compiled_attn`` (make demo) runs on CPU: exit 0, both sections OK, and the model
section reports 2 rewrites for compile and for export + AOTInductor, each within tolerance, with
no warning printed. The CLI: --help prints usage, --quick runs section 1 alone, and without
transformers the demo names the extra to install."""

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
    assert "Warning" not in out + res.stderr, out + res.stderr[-3000:]


def test_demo_help_prints_usage(capsys):
    from compiled_attn import __main__ as demo

    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m compiled_attn")


def test_demo_quick_and_without_transformers(capsys, monkeypatch):
    from compiled_attn import __main__ as demo

    assert demo.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "[1] paged prefill" in out and "  OK" in out and "[2]" not in out, out
    monkeypatch.setattr(demo, "_has_transformers", lambda: False)
    assert demo.main([]) == 2
    out = capsys.readouterr().out
    assert "pip install 'compiled_attn[demo]'" in out and "demo INCOMPLETE" in out, out
