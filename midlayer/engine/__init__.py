"""Inference: cached generation (prefill, the one-token step, sampling), the static-shape decode step that owns
its cache and is captured in CUDA graphs, weight compression (bf16, int8, int4, q4), and pretrained loading
(GGUF, Hugging Face folders) with export.

May import `common`, `ops`, `config`, `data`, `model` and `train` (checkpoints). It does not know drafters:
the speculative loop sits above it and drives it.
"""
