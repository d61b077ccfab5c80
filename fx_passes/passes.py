"""Entry points of the attention rewrite: the Inductor custom pass and the ExportedProgram
rewrite.

``AttentionRewritePass`` is installed as Inductor's ``joint_custom_pre_pass``: it sees the
aten graph before Inductor's own pattern passes (so its SDPA-fusion does not rewrite hand-written
attention first) and, in inference, that graph is the forward graph. Its ``uuid()`` hashes the
source of every module of the rewrite and of compiled_attn.ops (the ops whose implementation
the rewrite inlines into Inductor's graph: the Triton launch on GPU, the reference on CPU, the
work-list builders the launchers ask, and dispatch, which decides which rewritten calls stay
opaque), plus the pass configuration and the launch policy's graph_gluon, so Inductor's FX graph
cache never serves a graph rewritten, or an op body inlined, by other code. Note: on a cache hit the
pass does not run, so ``counters`` only count rewrites made by this process.

``rewrite_exported_program`` rewrites an ExportedProgram's graph in place and returns it. Its
inputs and signature keep their meaning; where a rewritten node was itself a graph output (the
attention result returned directly), the output spec is renamed to the node that replaces it.
"""

from __future__ import annotations

import os

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .rewrite import rewrite_graph

_SOURCES = tuple(
    os.path.join(os.path.dirname(__file__), f)
    for f in ("__init__.py", "graph_utils.py", "masks.py", "rewrite.py", "passes.py",
              "patterns.py")
)


class AttentionRewritePass(CustomGraphPass):
    """Inductor custom graph pass: rewrites attention sites into compiled_attn ops.

    Use as ``torch._inductor.config.joint_custom_pre_pass`` (``compiled_attn.compile`` does
    this for you) or post_grad_custom_pre_pass. ``enabled=False`` makes it a no-op (with its
    own uuid), for A/B comparisons.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.enabled:
            rewrite_graph(graph, inductor=True)

    def uuid(self) -> bytes:
        import compiled_attn.ops as ops

        # The ops' code is inlined into the cached graph (Emitter.call_op), and ops.dispatch
        # decides which rewritten calls stay opaque: a change to either must miss the cache.
        ops_dir = os.path.dirname(ops.__file__)
        op_sources = tuple(sorted(os.path.join(ops_dir, f) for f in os.listdir(ops_dir)
                                  if f.endswith(".py")))
        return get_hash_for_files(_SOURCES + op_sources,
                                  extra=f"enabled={self.enabled} "
                                        f"graph_gluon={ops.policy.POLICY.graph_gluon}")


def rewrite_exported_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrite the attention sites of an ExportedProgram (any IR: training or core ATen) into
    compiled_attn ops, in place; returns ep. ``counters`` records what happened."""
    gm = ep.graph_module
    rewrite_graph(gm.graph)
    gm.recompile()
    _sync_output_specs(ep)
    return ep


def _sync_output_specs(ep: torch.export.ExportedProgram) -> None:
    """Point each tensor output spec at the node now in its slot of the graph's output: the
    specs name output nodes, and torch.export.save rejects a spec whose node is gone."""
    from torch.export.graph_signature import TensorArgument

    outs = ep.graph.output_node().args[0]
    specs = ep.graph_signature.output_specs
    if len(outs) != len(specs):
        raise AssertionError(f"the graph returns {len(outs)} values but its signature has "
                             f"{len(specs)} output specs")
    for spec, node in zip(specs, outs):
        if isinstance(spec.arg, TensorArgument) and isinstance(node, torch.fx.Node):
            spec.arg.name = node.name
