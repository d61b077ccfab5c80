"""compiled_attn: FlashInfer's prefill-side API on our own Triton kernels.

Drop-in for ``flashinfer``'s prefill entry points (``import compiled_attn as flashinfer``), with
every kernel family registered as a torch.library op (``compiled_attn.ops``) so the calls compile
under torch.compile, export through torch.export and package with AOTInductor. Each public
module below lists its names in ``__all__``; this file only gathers them.
"""

from . import ops  # noqa: F401  (registers the compiled_attn:: ops)
from .prefill import *  # noqa: F401,F403  single / ragged / paged prefill
from .pod import *  # noqa: F401,F403  POD wrappers
from .utils import *  # noqa: F401,F403  packbits, page helpers, merge_state(s), alibi slopes
from .cudnn import *  # noqa: F401,F403  cudnn_batch_prefill_with_kv_cache
from .trtllm import *  # noqa: F401,F403  trtllm_fmha_v2_prefill
from .compile import *  # noqa: F401,F403  compile(), export()

__version__ = "0.1.0"
