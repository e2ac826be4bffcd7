"""Cost model: estimated forward FLOPs, parameter counts and KV-cache bytes (paper section 3).

The paper compares models by the estimated FLOPs of one forward pass over one sequence at batch 1,
"assuming the maximum possible benefit from the sparsity of the gate values" (section 3, Figure 2). These
are pure functions of a `ModelConfig`, so they can be checked against a hand count and printed by
`midlayer flops`.

Notation: T tokens, d = dim, H = n_heads, K = n_kv_heads, hd = head_dim (H hd = d unless head_size is set),
h = ffn_hidden_dim,
V = vocab_size, L = n_layers, R = L/2 routers (gated models only), P = query-key pairs actually scored.
Causal attention over T tokens scores P = T (T + 1) / 2 pairs (token t attends to keys 1..t, itself
included), not the T^2 square; a sliding-window block (window W) scores P = sum_t min(t, W) (`causal_pairs`).

Counting conventions (FLOPs, one multiply or add each; exp and log count as 1):

==================  ==============================================  =========================================
term                formula (one block unless noted)                 why
==================  ==============================================  =========================================
qkv_proj            2 T d d + 2 * 2 T d (K hd)                      matmul 2 m n k; GQA shrinks k, v to K hd
out_proj            2 T d d                                          wo
rope                3 T (H + K) hd                                   x cos + rot(x) sin: 2 mul + 1 add per
                                                                     rotated element, on q and k
attn_scores         2 hd H P = 2 d P                                 q . k for each scored pair and head
softmax             5 H P                                            scale, max-subtract, exp, sum, divide
attn_values         2 d P                                            weights times v, each pair and head
key_bias (gated)    H P + 2 T                                        add ln(g_j) to each score (eq. 3) and
                                                                     ln(max(g, eps)) once per token
ffn_proj            3 * 2 T d h                                      w1, w3 (d -> h) and w2 (h -> d); a
                                                                     plain MLP (ffn_type relu/gelu/silu):
                                                                     2 * 2 T d h, no w3
swiglu              5 T h                                            silu(a) = a / (1 + exp(-a)): negate, exp,
                                                                     add, divide (4), times w3 output (1);
                                                                     every activation is counted so (GELU's
                                                                     erf and ReLU's max differ by O(T h)), a
                                                                     plain MLP without the product: 4 T h
norms               n_norm * 4 T d                                   RMSNorm: square, sum, scale by rsqrt,
                                                                     scale by weight; per-row rsqrt and eps
                                                                     (O(T)) neglected. n_norm = 2 for
                                                                     "pre" and "post", 4 for "sandwich";
                                                                     LayerNorm: + subtract the mean (and + bias)
                                                                     = 5 (6) per element; qk_norm: + the
                                                                     (H + K) hd elements of q and k
residual            2 T d                                            two residual adds
gate_mul (gated)    2 T d                                            g * attn_out and g * ffn_out
embed_norm          4 T d                 (once)                     the norm after the embedding
final_norm          4 T d                 (once)                     the norm before the head
lm_head             2 T d V               (once)                     logits at every position
router (gated)      R T (2 d + 2)         (once)                     w . h (2 d), + b, ReLU (eq. 1)
router_gates        T ((R - 1) + 3 R)     (once)                     running sum S (eq. 1), 1 - clamp(S, 0,
                                                                     1) (eq. 2: max, min, subtract)
skipped_kv (gated,  z T (4 d K hd + 4 d + 3 K hd)                    "query"/"none" gating hide no key, so a
query / none)                                                        skipped token's k and v are still read:
                                                                     its input norm, k, v and RoPE on k
                                                                     (+ QK-norm on k where set)
embedding lookup    0                                                a gather, no arithmetic
==================  ==============================================  =========================================

Sparsity: `sparsity[l] = z_l`, the fraction of tokens whose gate is exactly 0 at block l < L/2 (paper 2.1).
Block l and its mirror L-1-l (eq. 2) both have every term multiplied by (1 - z_l): a skipped token does no
work in them. This is linear in z for the attention pair terms too, i.e. it assumes the skipped tokens'
queries are removed but still charges surviving queries for the skipped keys; real skipping removes those
keys as well (about a (1 - z)^2 saving on the pair terms), so the estimate is slightly conservative.
That holds for key-indexed gating (eq. 3), which hides a skipped token from every query. With "query" or
"none" gating (`ModelConfig.gate_attention`) the other tokens still attend to a skipped token, so its key
and value must still be computed from its unchanged residual: `skipped_kv` charges that per skipped token
and attention block (the pair terms are then exactly linear in z: surviving queries, all keys).
Embedding, norms outside blocks, head and routers are not scaled. The router of block l only runs for
tokens that reached block l; counting every router for every token is the simple, honest upper bound.

No factor 2 on blocks and no T^2 square (the authors' script has both): one block is counted once per
token, and causal attention over its triangle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from midlayer.config import ModelConfig
from midlayer.model.ssm import ssm_flops_per_token, ssm_param_count

# Per-element constants (see the module docstring for the operation counts behind each).
RMSNORM_FLOPS_PER_ELEM = 4
LAYERNORM_EXTRA_FLOPS_PER_ELEM = 1  # subtract the mean; + 1 more for the bias


def norm_flops_per_elem(cfg: ModelConfig) -> int:
    """FLOPs per normalised element of the model's norm_type (module docstring, `norms`)."""
    if cfg.norm_type == "rmsnorm":
        return RMSNORM_FLOPS_PER_ELEM
    return RMSNORM_FLOPS_PER_ELEM + LAYERNORM_EXTRA_FLOPS_PER_ELEM + (1 if cfg.norm_type == "layernorm" else 0)


def norms_per_block(cfg: ModelConfig) -> int:
    """Norms over d features in one block: 2 (pre, post) or 4 (sandwich)."""
    return 4 if cfg.norm_placement == "sandwich" else 2
ROPE_FLOPS_PER_ELEM = 3
SOFTMAX_FLOPS_PER_SCORE = 5
SWIGLU_FLOPS_PER_HIDDEN = 5
KEY_BIAS_LOG_FLOPS_PER_TOKEN = 2  # ln(max(g, eps))
GATE_FN_FLOPS_PER_TOKEN = 3  # 1 - clamp(S, 0, 1)

_BLOCK_TERMS = ("qkv_proj", "out_proj", "rope", "attn_scores", "softmax", "attn_values", "key_bias",
                "ffn_proj", "swiglu", "norms", "residual", "gate_mul", "ssm_mixer", "skipped_kv")
_ATTENTION_TERMS = ("qkv_proj", "out_proj", "rope", "attn_scores", "softmax", "attn_values", "key_bias")
_OTHER_TERMS = ("embed_norm", "final_norm", "lm_head", "router", "router_gates")


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs by term. Block terms are totals over all L blocks, already scaled by (1 - z_l).

    `n_tokens` tokens were processed with `n_pairs` causal query-key pairs in total in a block that sees every
    key (a forward over T tokens: n_tokens = T, n_pairs = T (T + 1) / 2; a decode step: 1 and the context
    length), and `window_pairs` in a sliding-window block (`causal_pairs`; n_pairs without a window).
    `per_block[l]` is the total of all block terms of block l.
    """

    n_tokens: int
    n_pairs: int
    window_pairs: int
    qkv_proj: float
    out_proj: float
    rope: float
    attn_scores: float
    softmax: float
    attn_values: float
    key_bias: float
    ffn_proj: float
    swiglu: float
    norms: float
    residual: float
    gate_mul: float
    ssm_mixer: float  # the blocks of ssm_layers: their state-space mixer instead of the attention terms
    skipped_kv: float  # "query"/"none" gating: keys and values of the skipped tokens, which stay visible
    embed_norm: float
    final_norm: float
    lm_head: float
    router: float
    router_gates: float
    per_block: tuple[float, ...]

    @property
    def blocks(self) -> float:
        """Sum of the block terms over all blocks."""
        return sum(getattr(self, n) for n in _BLOCK_TERMS)

    @property
    def total(self) -> float:
        return self.blocks + sum(getattr(self, n) for n in _OTHER_TERMS)

    def as_rows(self) -> list[tuple[str, float]]:
        """(term, FLOPs) for every term, block terms first, then ("total", total)."""
        return [(n, float(getattr(self, n))) for n in _BLOCK_TERMS + _OTHER_TERMS] + [("total", self.total)]


class PrefillDecode(NamedTuple):
    """FLOPs of a prefill over the prompt and of the decode steps that process the new tokens."""

    prefill: float
    decode: float


def _check_pos_int(name: str, v: int, minimum: int = 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")


def _block_keep(cfg: ModelConfig, sparsity: Sequence[float] | None) -> list[float]:
    """(1 - z) for every block l = 0..L-1, mirroring the first-half values (eq. 2)."""
    L = cfg.n_layers
    if sparsity is None:
        return [1.0] * L
    if not cfg.gating:
        raise ValueError("sparsity applies only to gated models (cfg.gating=True); pass None for a dense model")
    z = [float(v) for v in sparsity]
    if len(z) != L // 2:
        raise ValueError(f"sparsity needs one value per first-half block ({L // 2} for n_layers={L}), "
                         f"got {len(z)}")
    for l, v in enumerate(z):
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            raise ValueError(f"sparsity[{l}] must be in [0, 1], got {v}")
    # S of eq. 2 only grows with depth: a token closed at block l stays closed at every later first-half block,
    # so z_0 <= z_1 <= ... (1e-6: room for a mean's rounding)
    for l in range(1, len(z)):
        if z[l] < z[l - 1] - 1e-6:
            raise ValueError(f"sparsity must not decrease over the first half (eq. 2's S is cumulative): "
                             f"sparsity[{l}] = {z[l]} < sparsity[{l - 1}] = {z[l - 1]}")
    keep = [1.0 - v for v in z]
    return keep + keep[::-1]


def causal_pairs(n_tokens: int, window: int = 0, context: int = 0) -> int:
    """Query-key pairs that `n_tokens` new tokens, after `context` cached ones, score under a causal mask:
    token t (1-based over all) sees min(t, window) keys, itself included (every key when window is 0)."""
    last = context + n_tokens
    full = last * (last + 1) // 2 - context * (context + 1) // 2
    if not window:
        return full

    def upto(t: int) -> int:  # sum over t' = 1..t of min(t', window)
        return t * (t + 1) // 2 if t <= window else window * (window + 1) // 2 + (t - window) * window
    return upto(last) - upto(context)


def _block_terms(cfg: ModelConfig, T: int, P: int) -> dict[str, int]:
    """One dense-compute block's FLOPs, term by term (formulas in the module docstring), for `T` new tokens
    scoring `P` query-key pairs."""
    d, H, K, hd, h = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden_dim
    n_norm, nf = norms_per_block(cfg), norm_flops_per_elem(cfg)
    n_ffn = 3 if cfg.ffn_glu else 2
    E, k = cfg.moe_experts, (cfg.moe_top_k if cfg.moe_experts else 1)  # a token runs k experts' FFNs
    g = 1 if cfg.gating else 0
    return {
        "qkv_proj": 2 * T * d * (H * hd) + 2 * 2 * T * d * (K * hd),
        "out_proj": 2 * T * (H * hd) * d,
        "rope": ROPE_FLOPS_PER_ELEM * T * (H + K) * hd if cfg.pos_encoding == "rope" else 0,
        "attn_scores": 2 * H * hd * P,
        "softmax": SOFTMAX_FLOPS_PER_SCORE * H * P,
        "attn_values": 2 * H * hd * P,
        # gated: + ln(g_j) on every score ("none" adds no gate bias); ALiBi / T5: + the position bias on every score
        "key_bias": (g if cfg.gate_attention != "none" else 0) * (H * P + KEY_BIAS_LOG_FLOPS_PER_TOKEN * T) + (H * P if cfg.pos_encoding in ("alibi", "t5") else 0),
        # mixture of experts: k active experts per token, the router (2 d E), softmax and the weighted sum
        "ffn_proj": k * n_ffn * 2 * T * d * h + (2 * T * d * E + SOFTMAX_FLOPS_PER_SCORE * T * E + 2 * k * T * d
                                                 if E else 0),
        "swiglu": k * (SWIGLU_FLOPS_PER_HIDDEN - (0 if cfg.ffn_glu else 1)) * T * h,
        "norms": n_norm * nf * T * d + (nf * T * (H + K) * hd if cfg.qk_norm else 0),
        "residual": 2 * T * d,
        "gate_mul": g * 2 * T * d,
        "ssm_mixer": 0,
    }


def _breakdown(cfg: ModelConfig, n_tokens: int, n_pairs: int, sparsity: Sequence[float] | None,
               window_pairs: int | None = None) -> FlopsBreakdown:
    """The cost model for `n_tokens` new tokens scoring `n_pairs` causal query-key pairs in a block that sees
    every key, and `window_pairs` in a sliding-window block (`ModelConfig.window_of`; default n_pairs)."""
    keep = _block_keep(cfg, sparsity)
    T = n_tokens
    d, H, K, hd, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    nf = norm_flops_per_elem(cfg)
    one = _block_terms(cfg, T, n_pairs)
    local = _block_terms(cfg, T, n_pairs if window_pairs is None else window_pairs)
    # Hybrids (ssm_layers): their blocks run the state-space mixer instead of the attention terms (and of
    # QK-norm); every other term is the same in every block. Each term is scaled by the blocks that run it;
    # the pair terms of a sliding-window block by its own pairs.
    ssm = set(cfg.ssm_layers)
    kept = sum(keep)
    kept_attn = sum(k for l, k in enumerate(keep) if l not in ssm and not cfg.window_of(l))
    kept_local = sum(k for l, k in enumerate(keep) if l not in ssm and cfg.window_of(l))
    kept_ssm = sum(k for l, k in enumerate(keep) if l in ssm)
    qk = nf * T * (H + K) * hd if cfg.qk_norm and ssm else 0
    mixer = ssm_flops_per_token(cfg) * T if ssm else 0
    totals = {name: (float(v) * kept_attn + float(local[name]) * kept_local if name in _ATTENTION_TERMS
                     else float(v) * kept) for name, v in one.items()}
    totals["norms"] -= qk * kept_ssm
    totals["ssm_mixer"] = float(mixer) * kept_ssm
    attn_block, local_block = sum(one.values()), sum(local.values())
    ssm_block = attn_block - sum(one[t] for t in _ATTENTION_TERMS) - qk + mixer
    # A skipped token whose key stays visible ("query"/"none" gating) still pays, per attention block, what its
    # key and value need: the input norm over its unchanged residual, k and v, RoPE and QK-norm on k.
    kv_only = 0.0
    if cfg.gating and cfg.gate_attention != "key":
        kv_only = float(T * (2 * 2 * d * K * hd + nf * d  # gating needs pre- or sandwich-LN: an input norm
                             + (ROPE_FLOPS_PER_ELEM * K * hd if cfg.pos_encoding == "rope" else 0)
                             + (nf * K * hd if cfg.qk_norm else 0)))
    skipped_kv = [kv_only * (1.0 - k) for k in keep]  # gating excludes ssm_layers (config check)
    totals["skipped_kv"] = sum(skipped_kv)
    R = cfg.n_routers
    return FlopsBreakdown(
        n_tokens=T,
        n_pairs=n_pairs,
        window_pairs=n_pairs if window_pairs is None else window_pairs,
        **totals,
        embed_norm=float(nf * T * d) if cfg.embed_norm else 0.0,
        final_norm=float(nf * T * d),
        lm_head=float(2 * T * d * V),
        router=float(R * T * (2 * d + 2)),
        router_gates=float(T * (max(R - 1, 0) + GATE_FN_FLOPS_PER_TOKEN * R)),
        per_block=tuple(float(ssm_block if l in ssm else local_block if cfg.window_of(l) else attn_block) * k
                        + skipped_kv[l] for l, k in enumerate(keep)),
    )


def forward_flops(cfg: ModelConfig, seq_len: int, sparsity: Sequence[float] | None = None) -> FlopsBreakdown:
    """Estimated FLOPs of one forward pass over one sequence of `seq_len` tokens at batch 1 (paper sec. 3).

    `sparsity`: one z_l in [0, 1] per first-half block (length L/2, gated models only; None means 0).
    `seq_len` may exceed `cfg.max_seq_len`: this is an estimate, not a run.
    """
    _check_pos_int("seq_len", seq_len)
    return _breakdown(cfg, seq_len, causal_pairs(seq_len), sparsity, causal_pairs(seq_len, cfg.sliding_window))


def decode_flops(cfg: ModelConfig, context_len: int, sparsity: Sequence[float] | None = None) -> FlopsBreakdown:
    """FLOPs of one decode step: one new token attending to `context_len` keys, its own included.

    That is the token at position `context_len` (1-based) with `context_len - 1` positions already in the
    KV cache. So forward_flops(T) equals the sum of decode_flops(t) for t = 1..T.
    """
    _check_pos_int("context_len", context_len)
    return _breakdown(cfg, 1, context_len, sparsity, causal_pairs(1, cfg.sliding_window, context_len - 1))


def prefill_decode_split(cfg: ModelConfig, prompt_len: int, new_tokens: int,
                         sparsity: Sequence[float] | None = None) -> PrefillDecode:
    """Prefill FLOPs over the prompt and total FLOPs of `new_tokens` decode steps after it.

    Decode step j = 1..new_tokens processes new token j at position prompt_len + j, attending to
    prompt_len + j keys, so prefill + decode == forward_flops(prompt_len + new_tokens).total. (Emitting N
    tokens strictly needs N - 1 steps, since the prefill's last logits give the first one; we count the
    N steps that also put every new token into the cache.) The prefill counts the LM head at every prompt
    position, as `forward_flops` does; a server that keeps only the last logits saves 2 (T - 1) d V.
    """
    _check_pos_int("prompt_len", prompt_len)
    _check_pos_int("new_tokens", new_tokens, minimum=0)
    prefill = forward_flops(cfg, prompt_len, sparsity).total
    # A decode step costs a + b * context_len + c * min(context_len, window) (only the pair terms depend on the
    # context; c: the sliding-window blocks'), so the sum over the steps' contexts is closed-form: the pairs
    # the new tokens score after the prompt.
    a = _breakdown(cfg, 1, 0, sparsity, 0).total
    b = _breakdown(cfg, 1, 1, sparsity, 0).total - a
    c = _breakdown(cfg, 1, 0, sparsity, 1).total - a
    pairs = causal_pairs(new_tokens, 0, prompt_len), causal_pairs(new_tokens, cfg.sliding_window, prompt_len)
    return PrefillDecode(prefill=prefill, decode=new_tokens * a + b * pairs[0] + c * pairs[1])


def norm_params_per_feature(cfg: ModelConfig) -> int:
    """A norm's parameters per normalised feature: its weight (+ a LayerNorm's bias)."""
    return 2 if cfg.norm_type == "layernorm" else 1


def block_param_count(cfg: ModelConfig) -> int:
    """N_B (paper 2.1): parameters of one Transformer block -- attention, FFN, its norms; no skip router; a
    mixture of experts counts every expert and its router."""
    ffn = ffn_param_count(cfg) * max(cfg.moe_experts, 1) + cfg.dim * cfg.moe_experts  # experts + their router
    return attention_param_count(cfg) + ffn + norms_per_block(cfg) * cfg.dim * norm_params_per_feature(cfg)


def attention_param_count(cfg: ModelConfig) -> int:
    """Parameters of one block's attention: q, k, v, o projections (+ Qwen2 biases, + QK-norm weights)."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    qk = 2 * cfg.head_dim * norm_params_per_feature(cfg) if cfg.qk_norm else 0
    return 2 * d * q + 2 * d * kv + ((q + 2 * kv) if cfg.qkv_bias else 0) + qk


def ffn_param_count(cfg: ModelConfig) -> int:
    """Parameters of one FFN (one expert of a mixture): 3 d h for a GLU, 2 d h for a plain MLP."""
    return (3 if cfg.ffn_glu else 2) * cfg.dim * cfg.ffn_hidden_dim


def param_count(cfg: ModelConfig) -> int:
    """Total parameters: embedding, L blocks, embedding norm, final norm, head (unless tied), routers.

    Routers are (d + 1) per first-half block (paper 2.1). No biases anywhere else.
    """
    d, V = cfg.dim, cfg.vocab_size
    head = 0 if cfg.tie_embeddings else V * d
    norms = (2 if cfg.embed_norm else 1) * d * norm_params_per_feature(cfg)
    pos = cfg.max_seq_len * d if cfg.pos_encoding == "learned" else 0  # a learned absolute position table
    pos += cfg.t5_buckets * cfg.n_heads if cfg.pos_encoding == "t5" else 0  # T5's bias table, shared by layers
    mixers = len(cfg.ssm_layers) * (ssm_param_count(cfg) - attention_param_count(cfg))  # hybrids
    return V * d + cfg.n_layers * block_param_count(cfg) + norms + head + cfg.n_routers * (d + 1) + pos + mixers


def active_param_count(cfg: ModelConfig, sparsity: Sequence[float] | None = None) -> float:
    """Mean parameters used per token: total minus 2 N_B sum_{l < L/2} z_l (paper 2.1); a mixture of experts
    uses k of its E experts in every block it runs, so its (E - k) idle experts are not counted."""
    keep = _block_keep(cfg, sparsity)
    idle = (cfg.moe_experts - cfg.moe_top_k) * ffn_param_count(cfg) if cfg.moe_experts else 0
    # With "query"/"none" gating a skipped token's key and value are still computed (`skipped_kv`): it still
    # uses the block's input norm, wk, wv (their biases, the k-norm).
    kv = cfg.n_kv_heads * cfg.head_dim
    still = (cfg.dim * norm_params_per_feature(cfg) + 2 * cfg.dim * kv + (2 * kv if cfg.qkv_bias else 0)
             + (cfg.head_dim * norm_params_per_feature(cfg) if cfg.qk_norm else 0)
             if cfg.gating and cfg.gate_attention != "key" else 0)
    return param_count(cfg) - (block_param_count(cfg) - still) * (len(keep) - sum(keep)) - idle * sum(keep)


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_elem: int = 2, sparsity: Sequence[float] | None = None) -> float:
    """KV-cache bytes one token occupies: K and V, K heads of hd each, in every block it is processed by.

    2 * L * n_kv_heads * head_dim * bytes_per_elem for a dense model; a token skipped at block l has no K/V
    there (SPEC 2, real skipping), so each block's share is scaled by (1 - z_l), mirrored. Only key-indexed
    gating (eq. 3) hides a skipped token's key: with "query" or "none" gating it stays in the cache.
    """
    if bytes_per_elem <= 0:
        raise ValueError(f"bytes_per_elem must be > 0, got {bytes_per_elem}")
    keep = _block_keep(cfg, sparsity)
    if cfg.gating and cfg.gate_attention != "key":
        keep = [1.0] * len(keep)
    attention = sum(k for l, k in enumerate(keep) if l not in cfg.ssm_layers)  # SSM blocks keep a constant state
    return 2.0 * cfg.n_kv_heads * cfg.head_dim * bytes_per_elem * attention


def format_breakdown(cfg: ModelConfig, seq_len: int, sparsity: Sequence[float] | None = None,
                     new_tokens: int = 256, bytes_per_elem: int = 2) -> str:
    """A readable report: FLOPs per term, params, active params, prefill/decode split, KV bytes per token."""
    fb = forward_flops(cfg, seq_len, sparsity)
    total = fb.total
    kind = "gated" if cfg.gating else "dense"
    z = "none" if sparsity is None else "[" + ", ".join(f"{float(v):.3g}" for v in sparsity) + "]"
    lines = [
        f"Estimated forward FLOPs, one sequence of {seq_len} tokens at batch 1 "
        f"({kind}, {cfg.n_layers} layers, dim {cfg.dim}, {cfg.norm_placement} norm, sparsity {z})",
        f"{'term':<14}{'GFLOPs':>12}{'% total':>10}",
    ]
    for name, v in fb.as_rows():
        if name == "total":
            lines.append("-" * 36)
        if v == 0 and name != "total":
            continue  # gating terms of a dense model
        lines.append(f"{name:<14}{v / 1e9:>12.4f}{100 * v / total:>9.2f}%")
    per_block = ", ".join(f"{v / 1e9:.3f}" for v in fb.per_block)
    split = prefill_decode_split(cfg, seq_len, new_tokens, sparsity)
    lines += [
        f"per block GFLOPs: [{per_block}]",
        f"FLOPs per token (forward / {seq_len}): {total / seq_len / 1e6:.2f} MFLOPs",
        f"params: {param_count(cfg):,} (N_B = {block_param_count(cfg):,} per block)",
        f"active params: {active_param_count(cfg, sparsity):,.0f}",
        f"prefill ({seq_len} tokens): {split.prefill / 1e9:.4f} GFLOPs; "
        f"decode ({new_tokens} new tokens): {split.decode / 1e9:.4f} GFLOPs"
        + (f", {split.decode / new_tokens / 1e6:.2f} MFLOPs/token" if new_tokens else ""),
        f"KV cache: {kv_bytes_per_token(cfg, bytes_per_elem, sparsity):,.0f} bytes/token "
        f"({bytes_per_elem} bytes per element)",
    ]
    return "\n".join(lines)


__all__ = ["FlopsBreakdown", "PrefillDecode", "forward_flops", "decode_flops", "prefill_decode_split",
           "param_count", "block_param_count", "active_param_count", "kv_bytes_per_token", "format_breakdown",
           "RMSNORM_FLOPS_PER_ELEM", "ROPE_FLOPS_PER_ELEM", "SOFTMAX_FLOPS_PER_SCORE",
           "SWIGLU_FLOPS_PER_HIDDEN"]
