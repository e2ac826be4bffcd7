"""Grouped-query self-attention with RoPE and the paper's *gated attention* (eq. 3).

Gated attention (Lawson & Aitchison 2025, section 2.2):

    o_i = sum_{j<=i} g_j exp(q_i.k_j) v_j / sum_{j<=i} g_j exp(q_i.k_j)

i.e. the pre-softmax logit of **key** j gets `ln(max(g_j, eps))` added, for every query and every head
(one gate per token, shared by the heads). A token whose gate is 0 at a block therefore becomes invisible to
every other token there. The bias must be indexed by the key position: a constant added to a whole softmax
*row* (query-indexed) cancels in the normalisation and hides nothing -- the public reference code has that
bug, and `tests/test_attention.py` shows ours does not.

Two backends give the same result:
  * "sdpa": `scaled_dot_product_attention` with an additive float mask = causal mask + key bias. Runs
    everywhere; the CPU path.
  * "flex": FlexAttention with a `score_mod` on `kv_idx` and a causal block mask. Compiled on CUDA; on CPU
    it runs eagerly (slow) and is only used to check it against SDPA.

Under bf16 autocast the attention logits and softmax are computed in fp32 (paper 3.1).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from midlayer.config import ModelConfig
from .layers import fuse_linears, make_norm
from midlayer.ops import fused_rows, kernels, row_linear

_TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)

try:  # FlexAttention: torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    HAS_FLEX = True
except ImportError:  # pragma: no cover - old torch
    HAS_FLEX = False


# --------------------------------------------------------------------------------------------- RoPE
def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None,
                scaling: str = "none", scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] for RoPE (Su et al.): angle(t, i) = t * theta^(-2i/d).

    Context extension by a factor s (`scaling`): "linear" position interpolation (Chen et al. 2023, arXiv
    2306.15595) uses t / s, so s times longer contexts fall inside the trained angle range; "ntk"-aware
    scaling (bloc97 2023) keeps t and raises the base to theta * s^(d / (d - 2)), which slows the low
    frequencies by ~s and leaves the highest one unchanged.

    We rotate the two *halves* of each head (x[:d/2], x[d/2:]) as Hugging Face's Llama does, rather than
    interleaved pairs as Meta's reference does: the two are the same model up to a fixed permutation of the
    q/k projection rows, and this layout loads Hugging Face checkpoints without permuting weights.
    """
    if scaling == "ntk":
        theta = theta * scale ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    if scaling == "linear":
        t = t / scale
    freqs = torch.outer(t, inv_freq)  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
    return emb.cos().float(), emb.sin().float()


def rope_half(cos: torch.Tensor, sin: torch.Tensor, half: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of side-by-side [global | local] RoPE tables (transformer.position_tables with a local base) ->
    the global (half 0) or local (half 1) base's cos/sin."""
    part = slice(half * head_dim, (half + 1) * head_dim)
    return cos[..., part], sin[..., part]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] with cos/sin broadcastable to it. x*cos + rotate_half(x)*sin."""
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2], x[..., d2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


# -------------------------------------------------------------------------- relative position biases
def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022, sec. 3): for n a power of two, m_h = 2^(-8 h / n), h = 1..n;
    otherwise the n' = 2^floor(log2 n) slopes of n', then every other slope of 2 n' for the rest."""
    def pow2(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 2 ** math.floor(math.log2(n_heads))
    slopes = pow2(p) if p == n_heads else pow2(p) + pow2(2 * p)[0::2][:n_heads - p]
    return torch.tensor(slopes)


def t5_bucket(distance: torch.Tensor, n_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's causal relative-position bucket (Raffel et al. 2020) of distance = q_pos - k_pos >= 0: distances
    below n/2 get their own bucket, larger ones log-spaced buckets up to max_distance, beyond it the last."""
    exact = n_buckets // 2
    d = distance.clamp_min(0)
    log_bucket = exact + (torch.log(d.float().clamp_min(1) / exact) / math.log(max_distance / exact)
                          * (n_buckets - exact)).long()
    return torch.where(d < exact, d, log_bucket.clamp_max(n_buckets - 1))


class PositionBias(nn.Module):
    """The additive attention bias of a relative position scheme, shared by every layer, from the query and
    key positions: ALiBi, -m_h (q - k); T5, a learned scalar per head and distance bucket. Returns
    [..., H, Tq, Tk] for positions [..., Tq] and [..., Tk]. Keys after the query are masked anyway."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind, self.n_heads = cfg.pos_encoding, cfg.n_heads
        self.n_buckets, self.max_distance = cfg.t5_buckets, cfg.t5_max_distance
        if self.kind == "alibi":
            self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)
        else:
            self.table = nn.Embedding(cfg.t5_buckets, cfg.n_heads)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        distance = (q_pos[..., :, None] - k_pos[..., None, :]).clamp_min(0)  # [..., Tq, Tk]
        if self.kind == "alibi":
            return -self.slopes.view(-1, 1, 1) * distance.unsqueeze(-3).float()
        return self.table(t5_bucket(distance, self.n_buckets, self.max_distance)).movedim(-1, -3).float()


# ------------------------------------------------------------------------------------ gate -> bias
def key_gate_bias(gates: torch.Tensor, eps: float, mode: str = "key") -> torch.Tensor | None:
    """The gates' additive attention bias (`ModelConfig.gate_attention`): "key", eq. 3, ln(max(g_j, eps)) per
    key position, [B, T] -> [B, 1, 1, T] (broadcast over heads and queries); "query", the same value per query
    row, [B, 1, T, 1] -- a constant added to a whole softmax row, which changes nothing (the public reference
    code's indexing; kept to show it); "none": no bias (None)."""
    if mode == "none":
        return None
    b = torch.log(gates.float().clamp_min(eps))
    return b[:, None, :, None] if mode == "query" else b[:, None, None, :]


@lru_cache(maxsize=16)
def _causal_mask(q_len: int, kv_len: int, device: torch.device, window: int = 0) -> torch.Tensor:
    """Additive causal mask [q_len, kv_len]; the last query sits at the last key (works with a KV prefix).
    window > 0 (sliding-window attention): query i also hides the keys j <= i - window."""
    i = torch.arange(q_len, device=device) + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)
    mask = torch.zeros(q_len, kv_len, device=device).masked_fill(j[None, :] > i[:, None], float("-inf"))
    return mask + window_mask(i, j, window) if window > 0 else mask


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive [..., Tq, Tk]: -inf where a key lies `window` or more positions before the query (sliding-
    window attention over explicit positions, e.g. the KV cache's), 0 elsewhere."""
    far = (q_pos[..., :, None] - k_pos[..., None, :]) >= window
    return torch.zeros(far.shape, device=far.device).masked_fill(far, float("-inf"))


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   key_bias: torch.Tensor | None = None, dropout_p: float = 0.0, window: int = 0) -> torch.Tensor:
    """Causal GQA attention through SDPA. q [B,H,Tq,d]; k,v [B,Hkv,Tk,d]; key_bias: an additive bias
    broadcastable to [B,H,Tq,Tk] (the gate bias [B,1,1,Tk], a position bias [1,H,Tq,Tk], their sum) or None;
    dropout_p on the attention probabilities (training); window > 0: sliding-window attention."""
    n_rep = q.shape[1] // k.shape[1]
    kwargs: dict = {"dropout_p": dropout_p} if dropout_p else {}
    if n_rep > 1:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:  # pragma: no cover - torch 2.4
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    local = 0 < window < k.shape[2]  # a window shorter than the keys hides some of them
    if key_bias is None and q.shape[2] == k.shape[2] and not local:
        # Dense path: let SDPA pick its fused causal kernel (flash / memory-efficient).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    mask = _causal_mask(q.shape[2], k.shape[2], q.device, window if local else 0)
    if key_bias is not None:
        mask = mask + key_bias  # the gate bias [B, 1, 1, Tk] (per key), a position bias [1, H, Tq, Tk], or both
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), **kwargs)


_compiled_flex = None


FLEX_MIN_HEAD_DIM = 16  # torch/_inductor/kernel/flex: "embedding dimension ... must be at least 16" (CUDA)


def _flex(*args, **kwargs):
    """FlexAttention, compiled on CUDA (its fast path); eager elsewhere (a slow reference path)."""
    global _compiled_flex
    if args[0].is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(*args, **kwargs)
    return flex_attention(*args, **kwargs)


def flex_gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_bias: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """The same causal gated (sliding-window) attention as `sdpa_attention`, as a FlexAttention `score_mod`
    on kv_idx and a block mask."""
    if not HAS_FLEX:  # pragma: no cover
        raise RuntimeError("attn_backend='flex' needs torch >= 2.5 (torch.nn.attention.flex_attention)")
    B, _, Tq, _ = q.shape
    Tk = k.shape[2]
    offset = Tk - Tq

    def causal(b, h, q_idx, kv_idx):
        if window > 0:
            return (kv_idx <= q_idx + offset) & (q_idx + offset - kv_idx < window)
        return kv_idx <= q_idx + offset

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=Tq, KV_LEN=Tk, device=q.device)
    score_mod = None
    if key_bias is not None:
        bias = key_bias.reshape(B, Tk).to(torch.float32)

        def score_mod(score, b, h, q_idx, kv_idx):  # eq. 3: + ln g_j, indexed by the KEY position
            return score + bias[b, kv_idx]

    enable_gqa = q.shape[1] != k.shape[1]
    return _flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)


class Attention(nn.Module):
    """GQA self-attention. Projection names follow the Llama reference (wq, wk, wv, wo); no biases unless
    `qkv_bias` (Qwen2). `fuse()` (inference) joins q|k|v into one projection `wqkv`; `row_invariant` (set by
    the q4 weight format) routes cached attention through the row-invariant kernel (kernels.attention), as a
    cache view's `c_attention` does for any format."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.wqkv: nn.Module | None = None
        self.row_invariant = False
        self.backend = cfg.attn_backend
        self.attn_dropout = cfg.attn_dropout
        self.window = cfg.window_of(layer)
        # position_tables holds [global | local] RoPE side by side when the windowed blocks have their own base:
        # which half this block rotates by (None: the tables are this block's as they are)
        self.rope_half = None if not cfg.rope_theta_local else (1 if self.window else 0)
        # biases FlexAttention's score_mod does not take (it reads a per-key gate bias): SDPA for those
        self.position_biased = cfg.pos_encoding in ("alibi", "t5") or cfg.gate_attention == "query"
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # QK-norm (Dehghani et al. 2023; OLMo 2, Qwen3): per-head norm of q and k before RoPE
            self.q_norm, self.k_norm = make_norm(cfg, cfg.head_dim), make_norm(cfg, cfg.head_dim)

    def fuse(self) -> None:
        """Replace wq, wk, wv by one projection wqkv = [wq; wk; wv] (inference only)."""
        if self.wqkv is None:
            self.wqkv = fuse_linears([self.wq, self.wk, self.wv])
            del self.wq, self.wk, self.wv

    def use_flex(self, x: torch.Tensor, key_bias: torch.Tensor | None = None) -> bool:
        # The compiled Flex kernel on CUDA needs head_dim >= FLEX_MIN_HEAD_DIM (its Triton template's tl.dot;
        # torch raises NotImplementedError from inside Inductor otherwise: seen on an H100, where every test
        # training the 8-wide-head `debug` preset on the default device failed so). "auto" takes SDPA there;
        # an explicit "flex" is refused here with the reason, not a compiler trace. Eager Flex (CPU) has no limit.
        fits = not x.is_cuda or self.head_dim >= FLEX_MIN_HEAD_DIM
        if self.backend == "flex":
            if not fits:
                raise ValueError(f"attn_backend='flex' on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM} (the compiled "
                                 f"FlexAttention kernel's minimum); this model has {self.head_dim}: use "
                                 f"attn_backend='sdpa' or 'auto'")
            return True
        # "auto" on CUDA: FlexAttention (compiled, `_flex`) in training, where the batch shape is fixed and
        # its kernel is the fastest measured (docs/results/cuda-h100.md: 31.8 ms/step gated vs 75.3 ms with
        # SDPA, whose bf16 path upcasts to fp32), and wherever it replaces a materialised [Tq, Tk] mask (the
        # gate's key bias, a sliding window). Plain causal attention outside training (a frozen dense base,
        # generation: many sequence lengths) takes SDPA's fused causal kernel: the compiled Flex kernel is
        # specialised to each length (dynamic=False), and draft training on the dense SmolLM2 hit dynamo's
        # recompile limit on an H100 and fell back to eager Flex, which materialises the scores.
        # SDPA also when attention dropout is on: FlexAttention has none.
        return (self.backend == "auto" and HAS_FLEX and x.is_cuda and fits and not self.position_biased
                and (self.training or key_bias is not None or self.window > 0)
                and not (self.attn_dropout and self.training))

    def projects(self, x: torch.Tensor, cache) -> bool:
        """Whether the caller may make this attention's queries with `project` (its norm, q|k|v, RoPE and the
        K/V store as one kernel, ops/row_linear.norm_linear) and hand them to `forward` (`q`): where the cache
        view takes RoPE and the store (decode_step.StaticView) and the fused projection runs in the row-linear
        kernel (the static step's kernels with its linears: Block.forward)."""
        return (fused_rows.fuses_linear(x, self.wqkv) and cache is not None and self.q_norm is None
                and cache.fuses_rope(x))  # (first: the check that is False outside the static step's kernels)

    def project(self, x: torch.Tensor, carry: torch.Tensor | None, norm, cos: torch.Tensor, sin: torch.Tensor,
                cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, q) for h = x + carry (x where carry is None): `norm` (an RMSNorm) of h, this attention's q|k|v, RoPE
        on q and k, k and v stored in the cache, all one kernel (where `projects`); q [B, T, H, hd] rotated,
        for `forward(q=)`. cos, sin as `forward` takes them."""
        cos, sin = self.rope_tables(cos, sin, x.shape[0])  # (per row, as the kernel reads them)
        kc, vc, slots = cache.rope_targets(x.shape[0])
        return row_linear.norm_linear(x, carry, norm.weight, norm.eps, self.wqkv.weight,
                                      rope=fused_rows.RopeStore(cos, sin, self.n_heads, kc, vc, slots))

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, batch: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as this block's RoPE reads them, from what `forward` takes ([T, hd], [B, 1, T, hd] or
        [B, T, hd]): [T, hd] or [B, T, hd], this block's base among two where it has one (`rope_half`); with
        `batch`, [B, T, hd] always (a [T, hd] table expanded, not copied)."""
        if cos.dim() == 4:
            cos, sin = cos[:, 0], sin[:, 0]
        if self.rope_half is not None:  # this block's RoPE base among the two (position_tables)
            cos, sin = rope_half(cos, sin, self.rope_half, self.head_dim)
        if batch is not None and cos.dim() == 2:
            cos, sin = cos.expand(batch, *cos.shape), sin.expand(batch, *sin.shape)
        return cos, sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_bias: torch.Tensor | None = None, cache=None, q: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]. Without `cache`: causal (gated) attention over these T tokens.

        With `cache` (a `kv_cache.CacheView`), the new keys/values are written into the KV cache and the
        queries attend over every position the cache holds for this layer, through the mask it returns
        (causality, padding, skipped tokens and the gate bias are all in that mask).
        cos/sin: [T, hd] (one sequence of positions) or [B, 1, T, hd] / [B, T, hd] (per row).
        q: the rotated queries [B, T, H, hd] of `project`, their keys and values stored (only where
        `projects`).
        """
        B, T, _ = x.shape
        H, Hk, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if q is not None:
            if not self.projects(x, cache):
                raise ValueError("Attention.forward takes queries made by `project` only where `projects` says so")
            return self.wo(cache.attend_rotated(self, q).transpose(1, 2).reshape(B, T, -1))
        cos, sin = self.rope_tables(cos, sin)
        if (cache is not None and cache.direct and (self.row_invariant or cache.c_attention)
                and self.kernels_take(x.device, cache.k_buffer.dtype)):
            return self._forward_kernels(x, cos, sin, cache)
        if cache is not None and self.wqkv is not None and self.q_norm is None and cache.fuses_rope(x):
            # RoPE, the K/V store and the attention in the view's own kernels (decode_step.StaticView)
            out = cache.rope_attention(self, self.wqkv(x).view(B, T, H + 2 * Hk, hd), cos, sin)
            return self.wo(out.transpose(1, 2).reshape(B, T, -1))
        # RoPE in the projection's own [B, T, heads, hd] layout: no copy before the attention kernel.
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if self.wqkv is not None:
            qkv = self.wqkv(x).view(B, T, H + 2 * Hk, hd)
            q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hk], qkv[:, :, H + Hk:]
        else:
            q, k = self.wq(x).view(B, T, H, hd), self.wk(x).view(B, T, Hk, hd)
            v = self.wv(x).view(B, T, Hk, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif self.wqkv is not None:
            qk = apply_rope(qkv[:, :, :H + Hk], cos, sin)  # q and k rotated in one go
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            out = self.attend(q, k, v, key_bias)
        else:
            out = cache.attention(self, q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))

    def kernels_take(self, device: torch.device, kv: torch.dtype) -> bool:
        """Whether `_forward_kernels` can run this attention with activations on `device` over K/V of dtype `kv`:
        on the CPU, q|k|v fused, no q/k norms, K/V the kernels hold, the library built. (What a static step's
        attention="c" is allowed on: decode_step.c_attention_runs.)"""
        return (self.wqkv is not None and self.q_norm is None and device.type == "cpu" and kv in kernels.KV_DTYPES
                and kernels.available())

    def _forward_kernels(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """The cached step of the q4 format, and of any format in a static step with attention="c"
        (cache.c_attention): projection, RoPE + cache store and attention in three C calls, every one
        row-invariant (kernels.py; the projection through the step's linear). Same result as the PyTorch path
        up to float rounding."""
        B, T, _ = x.shape
        H, Hk, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).float()
        if cos.shape[0] != B:  # one sequence of positions for every row
            cos, sin = cos.expand(B, T, hd), sin.expand(B, T, hd)
        kernels.rope_store(qkv, H, Hk, cos, sin, cache.k_buffer, cache.v_buffer, cache.query_slots)
        mask = cache.finish(T, x.device)
        out = kernels.attention_fused(qkv, H, cache.k_buffer, cache.v_buffer, mask, cache.length)
        return self.wo(out.to(x.dtype))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_bias: torch.Tensor | None) -> torch.Tensor:
        dtype = q.dtype
        p = self.attn_dropout if self.training else 0.0
        if self.use_flex(q, key_bias):
            # FlexAttention accumulates logits and softmax in fp32 from bf16 inputs inside its kernel.
            return flex_gated_attention(q, k, v, key_bias, self.window).to(dtype)
        if dtype != torch.float32:
            # Paper 3.1: attention logits in fp32 under bf16 autocast.
            with torch.autocast(q.device.type, enabled=False):
                return sdpa_attention(q.float(), k.float(), v.float(), key_bias, p, self.window).to(dtype)
        return sdpa_attention(q, k, v, key_bias, p, self.window)

    def attend_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with an explicit additive mask [B, 1, Tq, Tk] (None: every key visible), logits and
        softmax in fp32 whatever the cache dtype (the module's promise)."""
        if self.row_invariant and q.device.type == "cpu" and not torch.compiler.is_compiling():
            if k.dtype not in kernels.KV_DTYPES or v.dtype != k.dtype:
                k, v = k.float(), v.float()
            # (an fp16 cache is read as it is: the kernel widens each value exactly, the bits of a widened copy
            # without making one per layer per step)
            return kernels.attention(q.float(), k, v, mask).to(q.dtype)
        dtype = q.dtype
        kwargs = {}
        if q.shape[1] != k.shape[1]:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:  # pragma: no cover - torch 2.4
                n_rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        if mask is not None:
            mask = mask.float()
        with torch.autocast(q.device.type, enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, **kwargs).to(dtype)
