"""The integer codes of the ops' modes and whether the Triton interpreter runs: a leaf module
(it imports nothing of ours), so the reference, the contracts, the kernels and the rewrite all
read one definition.

mask_mode: MASK_NONE / MASK_CAUSAL / MASK_CUSTOM; pos_encoding_mode: POS_NONE / POS_ROPE_LLAMA /
POS_ALIBI (FlashInfer's PosEncodingMode order). LOG2E: log2(e), the factor that turns natural
logits into the base-2 ones both kernels keep.
"""

from __future__ import annotations

import os

__all__ = ["MASK_NONE", "MASK_CAUSAL", "MASK_CUSTOM", "POS_NONE", "POS_ROPE_LLAMA", "POS_ALIBI",
           "INTERPRET", "LOG2E"]

MASK_NONE, MASK_CAUSAL, MASK_CUSTOM = 0, 1, 2
POS_NONE, POS_ROPE_LLAMA, POS_ALIBI = 0, 1, 2
LOG2E = 1.4426950408889634

# Under the Triton interpreter, the kernel runs on CPU tensors (CI tests the real kernel code).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
