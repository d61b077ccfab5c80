"""compiled_attn.fx_passes: rewrites hand-written attention into compiled_attn ops.

- ``AttentionRewritePass``: the Inductor custom pass (``compiled_attn.compile`` installs it).
- ``rewrite_exported_program(ep)``: the same rewrite on a torch.export ExportedProgram.
- ``rewrite_graph(graph)``: the rewrite on any aten FX graph.
- ``counters``: ``collections.Counter`` of rewrites ("rewritten", "pattern:<name>",
  "mask:<kind>", "gqa:<how>", "soft_cap"), "skipped:<reason>" per attention site left alone,
  and "unmatched:softmax @ v" per softmax feeding a matmul that is neither (a form the pass
  does not know).
- ``patterns``: the source-level patterns recognised, as named plain torch functions.
"""

if __name__ != "compiled_attn.fx_passes":
    raise ImportError(
        f"the fx_passes package was imported as {__name__!r}; import it as "
        "compiled_attn.fx_passes (install the project with `pip install -e .`, or run `make test`)"
    )

from . import patterns  # noqa: E402,F401
from .passes import AttentionRewritePass, rewrite_exported_program  # noqa: E402
from .rewrite import counters, rewrite_graph  # noqa: E402

__all__ = ["AttentionRewritePass", "rewrite_exported_program", "rewrite_graph", "counters",
           "patterns"]
