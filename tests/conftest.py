"""Test-session set-up. Without CUDA, Triton (where installed) must run its kernels in its interpreter, and
that is decided when triton is first imported: tests/test_row_attention.py runs the row-attention kernel so."""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
