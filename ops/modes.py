"""The integer codes of the ops' modes and whether the Triton interpreter runs: a leaf module
(it imports nothing of ours), so the reference, the contracts, the kernels and the rewrite all
read one definition.

mask_mode: MASK_NONE / MASK_CAUSAL / MASK_CUSTOM; pos_encoding_mode: POS_NONE / POS_ROPE_LLAMA /
POS_ALIBI (FlashInfer's PosEncodingMode order).
"""

from __future__ import annotations

import os

__all__ = ["MASK_NONE", "MASK_CAUSAL", "MASK_CUSTOM", "POS_NONE", "POS_ROPE_LLAMA", "POS_ALIBI",
           "INTERPRET"]

MASK_NONE, MASK_CAUSAL, MASK_CUSTOM = 0, 1, 2
POS_NONE, POS_ROPE_LLAMA, POS_ALIBI = 0, 1, 2

# Under the Triton interpreter, the kernel runs on CPU tensors (CI tests the real kernel code).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
