"""compiled_attn: FlashInfer's prefill-side API on our own Triton kernels.

Drop-in for ``flashinfer``'s prefill entry points (``import compiled_attn as flashinfer``), with
every kernel family registered as a torch.library op so the calls compile under torch.compile,
export through torch.export and package with AOTInductor.
"""

from . import ops  # noqa: F401  (registers the compiled_attn:: ops)

__version__ = "0.1.0"
