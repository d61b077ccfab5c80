"""compiled_attn.fx_passes and compiled_attn.hf are lazy attributes of the package: a plain
``import compiled_attn`` imports neither (nor transformers), and first access imports them.
Each check runs in a fresh interpreter so that nothing imported by other tests hides a leak."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


def test_import_does_not_load_fx_passes_hf_or_transformers():
    out = _run("""
        import sys
        import compiled_attn
        print(sorted(m for m in ("transformers", "compiled_attn.fx_passes", "compiled_attn.hf")
                     if m in sys.modules))
    """)
    assert out == "[]", out


def test_lazy_attributes_load_on_first_access():
    out = _run("""
        import collections, sys
        import compiled_attn
        c = compiled_attn.fx_passes.counters
        assert isinstance(c, collections.Counter), type(c)
        assert "compiled_attn.fx_passes" in sys.modules
        from compiled_attn import fx_passes
        assert fx_passes is compiled_attn.fx_passes
        assert callable(compiled_attn.hf.register)
        assert "transformers" not in sys.modules  # hf imports transformers in register() only
        assert "fx_passes" in dir(compiled_attn) and "hf" in dir(compiled_attn)
        try:
            compiled_attn.no_such_name
        except AttributeError as e:
            print("ok", e)
    """)
    assert out.startswith("ok") and "no_such_name" in out, out
