"""compiled_attn.fx_passes: rewrites hand-written attention into compiled_attn ops."""

if __name__ != "compiled_attn.fx_passes":
    raise ImportError(
        f"the fx_passes package was imported as {__name__!r}; import it as "
        "compiled_attn.fx_passes (install the project with `pip install -e .`, or run `make test`)"
    )
