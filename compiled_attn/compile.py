"""compiled_attn.compile / compiled_attn.export: torch.compile and torch.export with the
attention rewrite (compiled_attn.fx_passes) installed.

``compile`` passes the rewrite to Inductor through ``options`` (per call, no global config
change); ``mode=`` is translated into the equivalent options because torch.compile takes one
or the other. ``export`` is torch.export.export followed by ``rewrite_exported_program``.
Note: ``from .compile import *`` binds ``compiled_attn.compile`` to the function; the module
stays importable as ``importlib.import_module("compiled_attn.compile")``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["compile", "export"]

_builtin_compile = compile  # noqa: A001 - keep Python's builtin reachable in this module


def compile(model, **torch_compile_kwargs: Any):  # noqa: A001 - public name
    """torch.compile(model, **torch_compile_kwargs) with compiled_attn's attention rewrite as
    Inductor's joint_custom_pre_pass. backend must be Inductor (the default)."""
    from compiled_attn.fx_passes import AttentionRewritePass

    kw = dict(torch_compile_kwargs)
    backend = kw.get("backend", "inductor")
    if backend != "inductor":
        raise ValueError(
            f"compiled_attn.compile needs the Inductor backend (got backend={backend!r}): the "
            "rewrite is an Inductor graph pass. Use compiled_attn.export for other toolchains."
        )
    options = dict(kw.pop("options", None) or {})
    mode = kw.pop("mode", None)
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode, kw.get("dynamic")), **options}
    if options.get("joint_custom_pre_pass") is not None:
        raise ValueError(
            "options['joint_custom_pre_pass'] is already set; compiled_attn.compile installs "
            "its own there. Chain your pass with compiled_attn.fx_passes.AttentionRewritePass "
            "yourself and call torch.compile directly."
        )
    options["joint_custom_pre_pass"] = AttentionRewritePass()
    return torch.compile(model, options=options, **kw)


def export(model, args, kwargs=None, *, dynamic_shapes=None, strict: bool = False):
    """torch.export.export(model, args, kwargs, dynamic_shapes=, strict=) with attention
    rewritten into compiled_attn ops. The result saves/loads with torch.export.save/load and
    compiles with torch._inductor.aoti_compile_and_package (the loader must import
    compiled_attn, which registers the ops)."""
    from compiled_attn.fx_passes import rewrite_exported_program

    ep = torch.export.export(model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes,
                             strict=strict)
    return rewrite_exported_program(ep)
