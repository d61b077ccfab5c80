"""compiled_attn.ops: the op contracts of the four kernel families and their implementations.

This package sits at the repository top level (the user's layout) and installs as
``compiled_attn.ops`` through setuptools' package-dir mapping. It registers the torch.library
ops in the ``compiled_attn`` namespace: ``single_prefill``, ``batch_ragged_prefill``,
``batch_paged_prefill`` and ``pod_prefill_decode``. ``reference`` holds the pure-PyTorch oracle
(any dtype, float64 included), which is also the CPU implementation of every op; the Triton
kernels live beside the contracts and never import the reference.

Importing it as a top-level ``ops`` package (``import ops`` from the repository root) would
register every op a second time under another module name; that fails loudly here instead.
"""

if __name__ != "compiled_attn.ops":
    raise ImportError(
        f"the ops package was imported as {__name__!r}; import it as compiled_attn.ops "
        "(install the project with `pip install -e .`, or run `make test`), never as a "
        "top-level 'ops' package from the repository root: that would register every "
        "compiled_attn op twice"
    )

from . import reference  # noqa: E402,F401
from .modes import (  # noqa: E402,F401
    MASK_NONE,
    MASK_CAUSAL,
    MASK_CUSTOM,
    POS_NONE,
    POS_ROPE_LLAMA,
    POS_ALIBI,
)
from .contracts import (  # noqa: E402,F401
    batch_paged_prefill,
    batch_ragged_prefill,
    pod_prefill_decode,
    single_prefill,
)
