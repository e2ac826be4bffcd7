"""Generation over a static KV cache, with *real* skipping of gated blocks.

Small named functions (prefill, decode_one_token, generate_stream, generate) over `forward_cached`, and a
naive reference (`generate_naive`: the whole sequence recomputed by `Transformer.forward` at every step)
that every fast path is tested against.

Real skipping (beyond the paper, which only estimates the saving; the reference code multiplies by 0):
in a gated model a token whose gate is exactly 0 at block l is not processed by block l at all -- no
projections, no attention, no FFN, no K/V entry -- and, having no K/V entry there, gets zero attention
weight from every other token. Only the tokens still active at a block are gathered into it and scattered
back. Since g = 0 at block l implies g = 0 at every block up to the mirror L-1-l (eqs. 1-2), such a token
skips the whole span [l, L-1-l]. The result equals the multiply-by-gate forward up to float rounding and
the eps floor of gated attention: a gated key's exp(score) is multiplied by 1e-6 there, not 0 as here, and
where scores are large that share is not negligible (a fuzzed tiny model with init_std 0.3 took another greedy
token at a top-two gap of 0.012; with skip=False, or gate_eps 1e-30, the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from midlayer.common import as_integer, as_real
from midlayer.model.kv_cache import KVCache, LayerView, kv_dtype
from midlayer.model.transformer import Transformer
from midlayer.ops import kernels


def check_max_new_tokens(n: object) -> int:
    """`n` as a token budget: an integer >= 0, else a ValueError that names it. One rule for plain and
    speculative decoding (the speculative loops once returned nothing for -3; 2.5 failed inside torch)."""
    v = as_integer(n)
    if v is None:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {n!r}")
    if v < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {v}")
    return v


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop_tokens: Sequence[int] = field(default_factory=tuple)
    skip: bool = True  # real skipping of gated blocks (False: compute them, multiplied by the gate)

    def __post_init__(self) -> None:
        """The settings checked (a ValueError naming the setting; the API's `LLM.settings` relies on these) and
        kept as Python numbers: a numpy integer, a bool, a float top_k or a seed past torch's range passed here
        once and failed inside torch."""
        self.max_new_tokens = check_max_new_tokens(self.max_new_tokens)
        t, k, p = as_real(self.temperature), as_integer(self.top_k), as_real(self.top_p)
        if t is None or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if k is None or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if p is None or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1: off), got {self.top_p!r}")
        seed = None if self.seed is None else as_integer(self.seed)
        if self.seed is not None and (seed is None or not -2**63 <= seed < 2**64):  # torch.manual_seed's range
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        self.temperature, self.top_k, self.top_p, self.seed = t, k, p, seed

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """The call's own generator for sampling (None at temperature 0): seeded with `seed`, else from the OS's
        entropy. Never through torch.seed(), which reseeds torch's global generator: a user's torch.rand after
        a sampled call with no seed drew other numbers. The one rule of every decoding path."""
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()  # (nondeterministic, this generator only)
        else:
            gen.manual_seed(self.seed)
        return gen


# ------------------------------------------------------------------------------------ cached forward
@dataclass
class JoinedRows:
    """Rows that join a cached forward *mid-network* (hidden transfer's pseudo states, arXiv 2404.12022
    sec. 3.4: one forward verifies the last draft and drafts the next).

    at[l](h) is called with the residual entering block l of the rows present there, [B, M, d], and returns
    the rows that join from block l up, [B, m, d]; they are appended after the present rows. `count` is the
    total number of joined rows J. Joined rows are never skipped (gate 1) and take the next cache slots
    after the token rows, in order, so the rows present at any block are a prefix of all rows.
    """

    at: dict[int, Callable[[torch.Tensor], torch.Tensor]]
    count: int


@torch.no_grad()
def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor, *,
                   active: torch.Tensor | None = None, skip: bool = True,
                   extra_mask: torch.Tensor | None = None, last_only: bool = False,
                   return_hidden: bool = False, capture: dict[int, torch.Tensor | None] | None = None,
                   joins: JoinedRows | None = None, all_hidden: bool = False, head_rows: int | None = None,
                   slots: torch.Tensor | None = None, run: Callable[[int], bool] | None = None,
                   stop: int | None = None):
    """Run `tokens` [B, T] at the next T cache slots; returns logits [B, T, V] ([B, V] if `last_only`).

    positions [B, T]: RoPE positions. active [B, T] (None: all): tokens to compute at all (False for
    padding). extra_mask [B, 1, T, S_after] or None: an additive mask on top of causality (tree attention).
    With `return_hidden` also returns the final residual [B, T, d] (before the last norm; only the last row
    with `last_only`, unless `all_hidden`: then every row, while the logits stay last-only). `capture`: a
    dict whose keys are block indices; each value is set to the residual entering that block, [B, M, d]
    (tokens that skip the block carry their unchanged residual), for drafters that read middle layers.
    `joins`: rows that join mid-network (`JoinedRows`); then positions and extra_mask cover all T + J rows
    and the outputs have T + J rows. `head_rows`: only the first head_rows rows go through the final norm and
    the LM head (the logits have that many rows; the hidden states all of them): rows whose logits a caller
    computes itself, on a draft vocabulary, or not at all. `slots` [B, T + J]: each row's own cache slots
    (the rows of a continuous batch have lengths of their own, engine/batch.py; the caller has set
    cache.length past every slot); None: the next T + J slots, the same for every row. `run` / `stop`: a
    drafter's partial forward (`Transformer.run_blocks`: only blocks l < stop with run(l) True); with `stop`
    the result is the residual leaving block stop - 1 [B, T + J, d], no head.
    """
    B, T = tokens.shape
    J = joins.count if joins is not None else 0
    if positions.shape[-1] != T + J:
        raise ValueError(f"positions cover {positions.shape[-1]} rows, expected {T + J}")
    if positions.numel() and int(positions.max()) >= model.cfg.max_seq_len:  # (RoPE's table ends there)
        raise ValueError(f"position {int(positions.max())} is beyond the model's context of {model.cfg.max_seq_len} "
                         "tokens")
    if slots is None:
        start = cache.length
        slots = cache.reserve(T + J)[None, :].expand(B, T + J)
        cache.pos[:, start:start + T + J] = positions
    else:
        if slots.shape != (B, T + J) or int(slots.max()) >= cache.length:
            raise ValueError(f"slots {tuple(slots.shape)} must be [B, T + J] = [{B}, {T + J}] and below the "
                             f"cache's length {cache.length}")
        start = None
        cache.pos.scatter_(1, slots, positions)
    cos_all, sin_all = model.rope_cos[positions][:, None], model.rope_sin[positions][:, None]  # [B, 1, T+J, hd]
    h = model.embed(tokens, positions[..., :T])
    if skip and model.routers is not None and model.cfg.gate_attention != "key":
        # Real skipping drops a skipped token's keys, which is what key-indexed gated attention (eq. 3)
        # computes; with "query" / "none" gating skipped tokens stay visible: the multiply-by-gate path.
        skip = False
    step = CachedStep(cache, start, slots, cos_all, sin_all, active=active,
                      skip=skip, extra_mask=extra_mask, position_bias=model.pos_bias,
                      gate_mode=model.cfg.gate_attention, layers_alike=model.routers is None)
    h = model.run_blocks(h, step, routed=T, capture=capture, joins=None if joins is None else joins.at, run=run,
                         stop=stop)
    if stop is not None:
        return h
    if h.shape[1] != T + J:
        raise ValueError(f"joined rows: {h.shape[1] - T} rows joined, JoinedRows.count says {J}")
    hidden = h
    if last_only:
        h = h[:, -1:]
    logits = model.output(model.norm(h if head_rows is None or last_only else h[:, :head_rows]))
    logits = logits[:, 0] if last_only else logits
    return (logits, hidden if all_hidden else h) if return_hidden else logits


class CachedStep:
    """How rows go through a block over the KV cache (a `Transformer.run_blocks` step): the rows present at
    a block (a prefix of all rows, as rows only ever join) write their K/V at their slots and attend
    through the cache's mask (kv_cache.LayerView), with real skipping of tokens whose gate is 0 (or that
    are inactive padding) when `skip`. `start` None: every row has slots of its own (`query_slots`), so every
    view goes through the per-row writes and masks (kv_cache.LayerView with `valid`)."""

    def __init__(self, cache: KVCache, start: int | None, query_slots: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor,
                 *, active: torch.Tensor | None = None, skip: bool = True,
                 extra_mask: torch.Tensor | None = None, position_bias=None, gate_mode: str = "key",
                 layers_alike: bool = False) -> None:
        self.cache, self.start, self.query_slots = cache, start, query_slots  # query_slots [B, all rows]
        self.cos, self.sin = cos, sin  # [B, 1, all rows, hd]
        self.active, self.skip, self.extra_mask = active, skip, extra_mask
        self.position_bias = position_bias  # Transformer.position_bias of a model with ALiBi / T5, else None
        # "key" gating keeps each key's ln g in the cache; a "query" bias is a row constant of the softmax (no
        # effect), so the cached path leaves it out; "none" has none
        self.gate_mode = gate_mode
        cache.mask_memo = {}  # a mask is shared by the layers of one forward only (LayerView.finish)
        cache.layers_alike = layers_alike
        self.rows_valid = None if start is not None else torch.ones_like(query_slots, dtype=torch.bool)
        # every layer of the cache holds the same keys with the same biases (a model without routers): then
        # per-row slots (start None) still share one mask across the blocks of a fused stretch
        self.layers_alike = layers_alike

    def run_fused(self, blocks, start: int, stop: int, h: torch.Tensor) -> torch.Tensor | None:
        """Blocks start..stop-1 in ONE C call (kernels.blocks_q4) when each would take its fused q4 path
        (model.Block.forward) with the same mask: every block q4-fused, no gates, nothing skipped or
        inactive, no position bias, each layer dense (per-row slots: every layer alike); else None (the caller
        runs them one by one). The K/V and the key biases it leaves are the block-by-block ones, bit for bit
        (tests/test_kernels.py, tests/test_batch.py)."""
        c = self.cache
        B, M = h.shape[:2]
        alike = self.layers_alike if self.start is None else all(c.dense_layers[start:stop])
        if (stop - start < 2 or c.layer_windows is not None or self.active is not None or self.position_bias is not None or not alike
                or h.device.type != "cpu" or h.dtype != torch.float32 or torch.is_grad_enabled()
                or c.k_layers[0].dtype not in kernels.KV_DTYPES):
            return None
        plans = [blocks[layer].fused_q4 for layer in range(start, stop)]
        if any(p is None for p in plans):
            return None
        # the rows present: a prefix of all rows (rows only ever join), as in __call__
        cos, sin, query_slots = self.cos[:, :, :M], self.sin[:, :, :M], self.query_slots[:, :M]
        em = self.extra_mask
        if em is not None and M < em.shape[2]:
            em = em[:, :, :M]
        valid = None if self.rows_valid is None else self.rows_valid[:, :M]
        view = LayerView(c, start, query_slots, start=self.start, valid=valid, extra_mask=em)
        mask = view.finish(M, h.device)  # layer `start`'s key biases and the mask every layer shares
        if self.start is None:  # the same record at the other layers
            c.bias[start + 1:stop, torch.arange(B, device=h.device)[:, None], query_slots] = 0.0
        else:
            c.bias[start + 1:stop, :, self.start:self.start + M] = 0.0
        return kernels.blocks_q4(h, plans, cos, sin, c.k, c.v, start, query_slots, mask, c.length)

    def __call__(self, layer: int, block, h: torch.Tensor, gate: torch.Tensor | None,
                 key_bias: torch.Tensor | None) -> torch.Tensor:
        B, M = h.shape[:2]
        cos, sin, query_slots = self.cos[:, :, :M], self.sin[:, :, :M], self.query_slots[:, :M]
        em = self.extra_mask
        if em is not None and M < em.shape[2]:
            em = em[:, :, :M]
        gate_bias = key_bias[:, 0, 0] if key_bias is not None and self.gate_mode == "key" else None  # per key
        act = self.active
        if act is not None and M > act.shape[1]:  # joined rows are always active
            act = torch.cat([act, act.new_ones(B, M - act.shape[1])], 1)
        if gate is not None and self.skip:
            act = gate > 0 if act is None else act & (gate > 0)
        if act is None or bool(act.all()):
            valid = None if self.rows_valid is None else self.rows_valid[:, :M]
            view = LayerView(self.cache, layer, query_slots, start=self.start, valid=valid, gate_bias=gate_bias,
                             extra_mask=em, position_bias=self.position_bias)
            return block(h, cos, sin, gate, None, view)
        return _sparse_block(block, layer, h, cos, sin, gate, gate_bias, act, self.cache, query_slots, em,
                             self.position_bias)


def _sparse_block(block, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  gate: torch.Tensor | None, gate_bias: torch.Tensor | None, act: torch.Tensor, cache: KVCache,
                  query_slots: torch.Tensor, extra_mask: torch.Tensor | None, position_bias=None) -> torch.Tensor:
    """Run `block` on the active tokens only (gathered, row-padded to the largest count), scatter back."""
    B, T, d = h.shape
    # some slot of this forward is not held at this layer (skipped or padding): later queries need the mask
    # (kv_cache.LayerView's unmasked dense step would read its stale keys), even when no row computes here
    cache.dense_layers[layer] = False
    counts = act.sum(1)
    M = int(counts.max())
    if M == 0:
        return h  # nobody computes this block: the residual passes unchanged, no K/V is written
    order = torch.argsort((~act).to(torch.int8), dim=1, stable=True)[:, :M]  # active tokens first, in order
    valid = torch.arange(M, device=h.device)[None, :] < counts[:, None]

    def take(x: torch.Tensor) -> torch.Tensor:  # gather along the token axis (dim 1)
        idx = order.view(B, M, *([1] * (x.dim() - 2))).expand(B, M, *x.shape[2:])
        return x.gather(1, idx)

    xa = take(h)
    cos_a, sin_a = take(cos[:, 0])[:, None], take(sin[:, 0])[:, None]
    ga = take(gate) if gate is not None else None
    gb = take(gate_bias) if gate_bias is not None else None
    em = None
    if extra_mask is not None:
        em = extra_mask.gather(2, order[:, None, :, None].expand(B, 1, M, extra_mask.shape[-1]))
    view = LayerView(cache, layer, take(query_slots), valid=valid, gate_bias=gb, extra_mask=em,
                     position_bias=position_bias)
    ya = block(xa, cos_a, sin_a, ga, None, view)
    b_idx, m_idx = valid.nonzero(as_tuple=True)
    out = h.clone()
    out[b_idx, order[b_idx, m_idx]] = ya[b_idx, m_idx]
    return out


# ----------------------------------------------------------------------------------------- sampling
def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row from logits [B, V]: argmax at temperature 0 (kernels.argmax: torch's first-maximum
    rule in one C pass), else top-k / top-p sampling. Top-k keeps every token tied with the k-th largest logit
    (so more than k where ties straddle it); top-p keeps the smallest prefix of the sorted distribution that
    reaches p, the token that crosses it included."""
    # below fp32's smallest normal number every gap between logits divides into -inf: the limit, argmax (a
    # temperature under 1.4e-45 was 0 in fp32, and 0 / 0 gave NaN inside torch)
    if temperature < torch.finfo(torch.float32).tiny:
        return kernels.argmax(logits)
    # the row's maximum first: every value is then <= 0, and a tiny temperature gives -inf, never inf - inf = NaN
    # (1e-39 overflowed fp32 and softmax failed inside torch)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (keep at least one).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int = 0) -> list[tuple[float, dict[int, float]]]:
    """Per row of logits [R, V]: the log-probability of tokens[r] under it and the `top` most likely tokens with
    theirs, log-softmax in fp32. The one scoring rule of the API's `LLM.logprobs` and the continuous batch's
    per-token logprobs (the server's chat logprobs), so the two give the same numbers for the same logits."""
    lp = logits.float().log_softmax(-1)
    picked = lp.gather(1, tokens.view(-1, 1).to(lp.device))[:, 0].tolist()
    if not top:
        return [(p, {}) for p in picked]
    vals, idx = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [(p, dict(zip(i, v))) for p, i, v in zip(picked, idx.tolist(), vals.tolist())]


# --------------------------------------------------------------------------------------- generation
def validate_prompts(model: Transformer, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    out = []
    V, ctx = model.cfg.vocab_size, model.cfg.max_seq_len
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. the BOS token)")
        if len(p) > ctx:
            raise ValueError(f"prompt {i} has {len(p)} tokens, longer than the model's context of {ctx}")
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {V}): {bad[:5]}")
        out.append(p)
    return out


def prefill(model: Transformer, prompts: list[list[int]], cache: KVCache, skip: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad the prompts into one batch and fill the cache. Returns (last logits [B, V], next pos [B])."""
    dev = cache.pos.device
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    P = int(lengths.max())
    pad = P - lengths
    tokens = torch.zeros(len(prompts), P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):] = torch.tensor(p, device=dev)
    cols = torch.arange(P, device=dev)[None, :]
    active = cols >= pad[:, None]
    positions = (cols - pad[:, None]).clamp_min(0)
    step = cache.chunk(P)  # a bounded window takes the prompt in chunks of at most W tokens
    for a in range(0, P, step):
        b = min(a + step, P)
        cache.make_room(b - a)
        act = active[:, a:b]
        logits = forward_cached(model, tokens[:, a:b], cache, positions[:, a:b],
                                active=None if bool(act.all()) else act, skip=skip, last_only=True)
    return logits, lengths.clone()


def decode_one_token(model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                     skip: bool = True) -> torch.Tensor:
    """One step: tokens [B] at positions [B] -> next-token logits [B, V]."""
    cache.make_room(1)
    return forward_cached(model, tokens[:, None], cache, positions[:, None], skip=skip, last_only=True)


@torch.no_grad()
def generate_stream(model: Transformer, prompts: Sequence[Sequence[int]], cfg: GenerationConfig | None = None
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (tokens [B], done [B]) once per generated position. A row is done after a stop token (which
    is yielded) or when the context is full; rows that are done keep computing but their tokens are
    meaningless (batched decoding), so consumers drop tokens where `done` was already set. The rows are one
    left-padded batch: they share the room the longest prompt leaves, and sampled rows draw from one generator
    (the continuous batch, engine/batch.py, decodes each row as it would decode alone)."""
    cfg = cfg or GenerationConfig()
    model.eval()
    prompts = validate_prompts(model, prompts)
    dev = model.tok_embeddings.weight.device
    ctx = model.cfg.max_seq_len
    P = max(len(p) for p in prompts)
    budget = min(cfg.max_new_tokens, ctx - P + 1)  # the last token generated needs no cache slot
    if budget <= 0:
        return
    W = model.cfg.sliding_window
    # a sliding window bounds the cache: W - 1 kept keys + a chunk of at most W new ones (`prefill`); with
    # windowed and global blocks mixed, only the windowed blocks' keys are bounded (the global ones keep all)
    size = min(ctx, P + budget) if not W or model.cfg.mixed_windows else min(ctx, P + budget, 2 * W - 1)
    cache = KVCache.for_model(model.cfg, len(prompts), max_len=size, device=dev,
                              dtype=kv_dtype(model), local_len=2 * W - 1 if model.cfg.mixed_windows else None)
    gen = cfg.generator(dev)
    stop = torch.tensor(list(cfg.stop_tokens), device=dev, dtype=torch.long)
    logits, pos = prefill(model, prompts, cache, cfg.skip)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    for i in range(budget):
        tok = sample_next(logits, cfg.temperature, cfg.top_k, cfg.top_p, gen)
        done = done | (torch.isin(tok, stop) if len(stop) else torch.zeros_like(done))
        yield tok, done
        if bool(done.all()) or i == budget - 1:
            return
        logits = decode_one_token(model, cache, tok, pos, cfg.skip)
        pos = pos + 1


def generate(model: Transformer, prompts: Sequence[Sequence[int]], cfg: GenerationConfig | None = None
             ) -> list[list[int]]:
    """New tokens for each prompt (a stop token, when hit, is included and ends the row). Several prompts are
    one left-padded batch (`generate_stream`): each gets at most the room the longest prompt leaves in the
    context."""
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    for tok, done in generate_stream(model, prompts, cfg):
        for b, t in enumerate(tok.tolist()):
            if not finished[b]:
                out[b].append(t)
                finished[b] = bool(done[b])
    return out


def finish_reason(model: Transformer, prompt: Sequence[int], new_tokens: Sequence[int], cfg: GenerationConfig
                  ) -> str:
    """Why a generation of `new_tokens` after `prompt` ended, in OpenAI's terms: "stop" (a stop token, which
    ends the row), "length" (max_new_tokens reached) or "context" (the model's context filled up first; OpenAI
    reports this as "length" too). The CLI says so on stderr when the context cut the answer short."""
    if new_tokens and new_tokens[-1] in cfg.stop_tokens:
        return "stop"
    if len(new_tokens) >= cfg.max_new_tokens:
        return "length"
    return "context" if len(prompt) + len(new_tokens) > model.cfg.max_seq_len else "stop"


@torch.no_grad()
def generate_naive(model: Transformer, prompts: Sequence[Sequence[int]], cfg: GenerationConfig | None = None
                   ) -> list[list[int]]:
    """Reference: each prompt alone, the whole sequence re-run through `Transformer.forward` per token
    (multiply-by-gate, no cache, no padding, no skipping)."""
    cfg = cfg or GenerationConfig()
    model.eval()
    prompts = validate_prompts(model, prompts)
    dev = model.tok_embeddings.weight.device
    gen = cfg.generator(dev)
    outs = []
    for p in prompts:
        seq = list(p)
        new: list[int] = []
        for _ in range(min(cfg.max_new_tokens, model.cfg.max_seq_len - len(p) + 1)):
            logits = model(torch.tensor([seq[-model.cfg.max_seq_len:]], device=dev)).logits[:, -1]
            t = int(sample_next(logits, cfg.temperature, cfg.top_k, cfg.top_p, gen)[0])
            new.append(t)
            seq.append(t)
            if t in cfg.stop_tokens:
                break
        outs.append(new)
    return outs
