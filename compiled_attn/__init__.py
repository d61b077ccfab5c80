"""compiled_attn: FlashInfer's prefill-side API on our own Triton kernels.

Drop-in for ``flashinfer``'s prefill entry points (``import compiled_attn as flashinfer``), with
every kernel family registered as a torch.library op (``compiled_attn.ops``) so the calls compile
under torch.compile, export through torch.export and package with AOTInductor. Each public
module below lists its names in ``__all__``; this file only gathers them.
"""

import importlib.util as _ilu
import os as _os
import sys as _sys


def _map_source_subpackages() -> None:
    """ops/ and fx_passes/ install as compiled_attn.ops / compiled_attn.fx_passes through
    setuptools' package-dir mapping. Where that mapping is absent (a source checkout on
    sys.path, or an editable install by a setuptools too old for mapped editable installs),
    load them from the checkout under those same names, so they are never a top-level package."""
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    for sub in ("ops", "fx_passes"):
        name = f"{__name__}.{sub}"
        init = _os.path.join(root, sub, "__init__.py")
        if name in _sys.modules or _ilu.find_spec(name) is not None or not _os.path.isfile(init):
            continue
        spec = _ilu.spec_from_file_location(name, init,
                                            submodule_search_locations=[_os.path.dirname(init)])
        module = _ilu.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)


_map_source_subpackages()
from . import ops  # noqa: E402,F401  (registers the compiled_attn:: ops)
from .ops import dispatch  # noqa: E402,F401  (installs the rule keeping traced Gluon calls)
from .prefill import *  # noqa: F401,F403  single / ragged / paged prefill
from .pod import *  # noqa: F401,F403  POD wrappers
from .utils import *  # noqa: F401,F403  packbits, page helpers, merge_state(s), alibi slopes
from .cudnn import *  # noqa: F401,F403  cudnn_batch_prefill_with_kv_cache
from .trtllm import *  # noqa: F401,F403  trtllm_fmha_v2_prefill
from .compile import *  # noqa: F401,F403  compile(), export()
from . import cp  # noqa: E402,F401  context-parallel prefill (torch.distributed imported on use)

__version__ = "0.1.0"

# Imported on first access (module __getattr__): the FX rewrite pulls in torch._inductor, and
# the HF integration transformers; neither is needed to call the prefill API.
_LAZY_SUBMODULES = ("fx_passes", "hf")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
