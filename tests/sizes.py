"""Problem sizes per device: small on CPU (Triton interpreter), large on a GPU.

Both sets keep the awkward shapes: sequence lengths that are no multiple of any tile (down to 1),
seqlen_q != seqlen_k both ways, head dims that are not powers of two, GQA/MQA ratios.
"""

import os

import torch

# The GPU when there is one, unless the interpreter was asked for explicitly.
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"

# Turing (sm_75, or a GPU emulating it: ../shared/tools/emulate_gpu.py) has no bf16 tensor cores
# and the kernels refuse bf16 there (test_errors.py checks that); tests that take bf16 for its
# range take fp16 there instead.
BF16_SUPPORTED = not ON_GPU or torch.cuda.get_device_capability() >= (8, 0)
BF16 = torch.bfloat16 if BF16_SUPPORTED else torch.float16
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if BF16_SUPPORTED else [torch.float16, torch.float32]

# (seqlen_q, seqlen_k)
SEQLENS_CPU = [(1, 1), (17, 17), (113, 113), (203, 203), (113, 203), (203, 113), (1, 17), (17, 1)]
SEQLENS_GPU = SEQLENS_CPU + [(1023, 1024), (1024, 1023), (127, 513), (3, 799), (4096, 4096), (4093, 3001)]
SEQLENS = SEQLENS_GPU if ON_GPU else SEQLENS_CPU

HEAD_DIMS_CPU = [40, 59, 64, 80, 96, 111, 128, 192, 256]
HEAD_DIMS_GPU = HEAD_DIMS_CPU + [1, 16, 32, 160, 224]
HEAD_DIMS = HEAD_DIMS_GPU if ON_GPU else HEAD_DIMS_CPU

# (batch, heads_q, heads_kv): MHA, GQA 2:1, MQA 4:1, GQA 3:1
HEADS = [(2, 2, 2), (1, 4, 2), (2, 4, 1), (1, 6, 2)] if ON_GPU else [(1, 2, 2), (1, 4, 2), (1, 2, 1), (1, 3, 1)]

# The seqlens used where a test sweeps something else: on the GPU, past the short-sequence config
# buckets (configs.SEQLEN_BUCKETS), with ragged last tiles.
LONG_SEQLENS = (3001, 4093) if ON_GPU else (203, 113)
