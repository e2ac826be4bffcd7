"""EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", arXiv
2401.15077): a one-layer draft network that is autoregressive over the base model's top-layer features.

What it is. The base's feature f_t is its final residual at position t after the final norm, f_t =
norm(h_t): the state its LM head reads to give the distribution of token t + 1 (what EAGLE's code takes
from the last hidden state of a Llama, which is normalised). Features. Our residuals are large and
unevenly scaled (SmolLM2's reach ~10^4 in a few dimensions), so a regression on the raw residual h_t
would be dominated by those dimensions; the normalised feature has the scale the LM head expects, and the
predicted feature is decoded by the LM head alone. The
draft network reads, at each position t, the feature f_t together with the embedding of the NEXT token,
e_{t+1} (the "shifted" token, which tells the draft which of the possible continuations was actually
taken, EAGLE sec. 3), and predicts the next feature:

    x_t       = W_fc [f_t ; e_{t+1}] + b_fc                       W_fc: R^{2d} -> R^d
    fhat_{t+1} = Block(x_{<=t})_t                                 one decoder layer (attention + SwiGLU FFN,
                                                                  causal over the draft rows, RoPE position t+1)
    q(. | x_{<=t+1}) = softmax(LMHead(fhat_{t+1}))                 the base's frozen LM head:
                                                                  a guess of the distribution of token t + 2
Drafting is autoregressive over features: the predicted feature and the embedding of the token drafted from
it feed the next step (EAGLE sec. 4, "drafting phase"), so depth d of the tree costs one draft-layer call.
e_t is the embedding the base's first block reads, `Transformer.embed` (emb_norm(tok_embeddings(x_t)), plus
an absolute position embedding for bases that have one; the paper's models
normalise the embedding, Llama checkpoints do not); both tables are the base's own and stay frozen.

Training (EAGLE sec. 4, "training of the draft models"), teacher-forced on the base's own features:

    L = L_reg + w_cls L_cls,    L_reg = SmoothL1(fhat_{t+1}, f_{t+1}),
                                L_cls = KL(p_base(. | t+1) || q(. | fhat_{t+1})),    w_cls = 0.1 (paper),

averaged over the positions whose target t + 1 is a real token. The paper's L_cls is the cross-entropy to
the base's distribution; we use the forward KL (the same gradient: the two differ by the teacher's entropy,
a constant) so that every drafter of this repo shares one teacher and one loss scale. The paper also adds
U(-0.1, 0.1) noise to the input features during training (its data augmentation against the draft's own
feature errors at depth > 1); `noise` does that, drawn from a seeded generator (exact resume).

How it differs from the other drafters. Medusa (drafters.py) decodes every depth from the same f_t with
independent heads: no head knows which token was drafted before it, so depth-d candidates do not depend on
the path. Hidden transfer (hidden_transfer.py) also predicts states, but as pseudo rows *inside* the base's
upper blocks, all depths in one (fused) base forward, again without the drafted tokens. EAGLE is a
separate small autoregressive network: it runs max_depth one-layer calls per round (cheap next to a base
forward), and each node's guess is conditioned on its own path -- the tokens and predicted features above
it -- like early exit / layer skip, but on a network that is one layer deep rather than part of the base.

Module layout. `EagleHead` (the trainable fc + decoder layer; the layer is the repo's own `model.Block`,
with its attention, RoPE tables and KV-cache views) and `eagle_forward`, the one teacher-forced pass used
by training and held-out evaluation. `EagleDrafter` drafts over a KV cache of its own (one layer, batch 1)
that holds the draft rows of the committed context; each round it appends the rows of the newly committed
positions (their features are the rows of `ctx.hidden`) and fills the tree level by level through
`drafters.draft_tree_autoregressive`, in scratch slots that are truncated afterwards. Cost: the first round
runs the prompt's rows through the draft layer (`prefill_features`: speculative_generate hands over every
prefill row's feature, so no extra base forward is needed); every later round costs the (1 + accepted) new
context rows plus one row per node above the last level (leaves are never run), all through the one
draft layer. (Without those features -- a caller that passes only the last row -- the drafter recomputes
them with one base forward.)

Initialisation (the paper does not say; ours): W_fc = [I | 0], b_fc = 0, the layer's output projections
(attention wo, FFN w2) zero, every other weight ~ N(0, init_std). An untrained head is then the identity on
the feature, fhat_{t+1} = f_t, i.e. it re-uses the base's own next-token prediction -- the same starting
point as an untrained Medusa head -- and training starts from a defined, in-distribution residual.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from midlayer.config import ModelConfig
from midlayer.engine.draft_vocab import draft_vocab, head_logits, teacher_logits, to_token_ids, vocab_topk
from midlayer.engine.decode_step import DecodeStep, round_layout
from midlayer.engine.generate import CachedStep
from midlayer.engine.quantization import compress_block, Q8Linear
from midlayer.model.attention import rope_half
from midlayer.model.kv_cache import KVCache, MaskedView, SlotView
from midlayer.model.transformer import Block, causal_step, Transformer
from midlayer.ops import kernels, tree_layout
from .drafting import (base_states, batch_stream, draft_tree_autoregressive, FrozenBase, gather_counted, kl_to_base,
                       model_device, optimise, placeholder_candidates, split_batch)
from .hidden_transfer import additive_mask, visible
from .protocol import Draft, DraftContext, Drafter
from .static import dynamic_candidates, tree_fields
from .tree import DraftTree
from .tree_cost import head_share

W_CLS = 0.1  # EAGLE sec. 4: L = L_reg + 0.1 L_cls
FEATURE_NOISE = 0.1  # EAGLE sec. 4: U(-0.1, 0.1) added to the input features during training


# ============================================================================================ the module
def rope_rows(model: Transformer, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's RoPE cos/sin rows at `index` for the head's own full-attention layer: the global half where the
    base's windowed blocks have their own base (Gemma 3: position_tables puts [global | local] side by side)."""
    cos, sin = model.rope_cos[index], model.rope_sin[index]
    return rope_half(cos, sin, 0, model.cfg.head_dim) if model.cfg.rope_theta_local else (cos, sin)


class EagleHead(nn.Module):
    """The EAGLE draft network: fc [f ; e] -> d, then one decoder layer (module docstring).

    The layer is a `model.Block` built from the base's dimensions (`for_model`): same width, heads, KV
    heads and SwiGLU hidden size as a base block, so it reads the base's RoPE tables. Its attention is
    SDPA (no gates: the draft layer is dense whatever the base)."""

    KIND = "eagle"

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, norm_eps: float = 1e-5,
                 norm_placement: str = "pre", qkv_bias: bool = False, init_std: float = 0.02,
                 head_size: int = 0) -> None:
        super().__init__()
        # vocab_size / max_seq_len are required by ModelConfig but unused by a Block
        self.block_cfg = ModelConfig(dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=1,
                                     ffn_hidden=ffn_hidden, norm_eps=norm_eps, norm_placement=norm_placement,
                                     gating=False, qkv_bias=qkv_bias, init_std=init_std, attn_backend="sdpa",
                                     head_size=head_size)
        self.dim = dim
        self.fc = nn.Linear(2 * dim, dim, bias=True)
        self.layer = Block(self.block_cfg)
        self.reset_parameters()

    @classmethod
    def for_model(cls, model: Transformer) -> "EagleHead":
        """A head shaped like one block of `model`."""
        c = model.cfg
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.ffn_hidden_dim, c.norm_eps, c.norm_placement, c.qkv_bias,
                   c.init_std, c.head_size)

    def reset_parameters(self) -> None:
        """The identity-on-the-feature start (module docstring)."""
        c = self.block_cfg
        with torch.no_grad():
            for name, p in self.layer.named_parameters():
                if name.endswith("norm.weight"):
                    nn.init.ones_(p)
                else:
                    nn.init.normal_(p, 0.0, c.init_std)
            # zero output projections: the block's residual branches add nothing until trained
            nn.init.zeros_(self.layer.attention.wo.weight)
            nn.init.zeros_(self.layer.feed_forward.w2.weight)
            self.fc.weight.zero_()
            self.fc.weight[:, :self.dim].copy_(torch.eye(self.dim))
            self.fc.bias.zero_()

    def config(self) -> dict[str, Any]:
        c = self.block_cfg
        return {"dim": c.dim, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "ffn_hidden": c.ffn_hidden,
                "norm_eps": c.norm_eps, "norm_placement": c.norm_placement, "qkv_bias": c.qkv_bias,
                **({"head_size": c.head_size} if c.head_size else {})}

    def check_model(self, model: Transformer) -> None:
        c = self.block_cfg
        if c.dim != model.cfg.dim or c.head_dim != model.cfg.head_dim:
            raise ValueError(f"EAGLE head of dim {c.dim} / head_dim {c.head_dim} for a model of dim "
                             f"{model.cfg.dim} / head_dim {model.cfg.head_dim} (it uses the base's RoPE tables)")

    def forward(self, features: torch.Tensor, emb: torch.Tensor, step: Callable[..., torch.Tensor],
                layer: Block | None = None, fc: nn.Module | None = None) -> torch.Tensor:
        """features f [B, M, d] and next-token embeddings e [B, M, d] -> predicted next features [B, M, d],
        in the head's dtype. `step(layer, block, h, gate, key_bias)` (a `model.BlockStep`: causal, cached or
        masked) decides how the M rows attend, exactly as for the base's own blocks. `layer`, `fc`: the
        decoder layer and input projection to run instead of `self.layer` and `self.fc` (the drafter's
        copies in a compressed format)."""
        dt = self.fc.weight.dtype
        x = (self.fc if fc is None else fc)(torch.cat([features.to(dt), emb.to(dt)], -1))
        return step(0, self.layer if layer is None else layer, x, None, None)


def embed(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """e_t: the embedding the base's first block reads (module docstring), at `positions` (default 0..T-1;
    they matter only for bases with absolute position embeddings)."""
    return model.embed(tokens, positions)


def feature(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    """The feature EAGLE works in: the base's final residual after its final norm, f = norm(h) -- the
    state its LM head reads (module docstring, "Features")."""
    return model.norm(h)


def feature_logits(model: Transformer, fhat: torch.Tensor, head: EagleHead | None = None) -> torch.Tensor:
    """The base's decoding of a predicted feature, LMHead(fhat) (fhat is already normalised), base dtype;
    over the head's draft vocabulary when it has one (draft_vocab.py)."""
    x = fhat.to(model.tok_embeddings.weight.dtype)
    return model.output(x) if head is None else head_logits(head, model, x)


# ===================================================================================== teacher-forced pass
def eagle_forward(model: Transformer, head: EagleHead, tokens: torch.Tensor, features: torch.Tensor,
                  n_steps: int = 1, noise: float = 0.0, generator: torch.Generator | None = None
                  ) -> list[torch.Tensor]:
    """Predicted features of every depth, teacher-forced on `tokens` [B, T] and their base features [B, T, d].

    Depth 1: the real rows t = 0..T-2, input (f_t, e_{t+1}) at RoPE position t + 1, causal; output [B, T-1, d]
    predicts f_{t+1} (anchor t, in `speculative` terms the last cached position, t + 1 the pending token).
    Depth i > 1 (held-out metrics, consistency tests): for anchor a = 0..T-1-i a row (fhat, e_{a+i}) at
    position a + i, fhat being the depth-(i-1) output of the same anchor, e the TRUE token (given the true
    prefix); it sees the real rows <= a and the earlier-depth rows of its own anchor -- what the drafter's
    chain row sees at inference. That is hidden transfer's `visible` rule (not masked), with real row a as
    step 0; the passes are run depth after depth (each needs the previous depth's outputs). Returns one
    tensor per depth, [B, T - i, d] in the head's dtype.
    `noise` > 0: U(-noise, noise) added to the real input features (EAGLE's training augmentation).
    """
    head.check_model(model)
    B, T = tokens.shape
    if T < 2:
        raise ValueError("EAGLE needs at least 2 tokens (a feature and the next token)")
    if not 1 <= n_steps <= T - 1:
        raise ValueError(f"n_steps must be in [1, {T - 1}] for {T} tokens, got {n_steps}")
    e = embed(model, tokens)
    f = feature(model, features[:, :T - 1])
    if noise > 0:
        f = f + (torch.rand(f.shape, generator=generator, device=f.device, dtype=torch.float32) * 2 - 1
                 ).mul_(noise).to(f.dtype)
    if n_steps == 1:  # training: one causal pass (SDPA's fused causal kernel)
        cos, sin = rope_rows(model, slice(1, T))
        return [head(f, e[:, 1:], causal_step(cos, sin))]
    dev = tokens.device
    anchor = torch.arange(T - 1, device=dev)
    step = torch.zeros(T - 1, dtype=torch.long, device=dev)
    inputs = [(f, e[:, 1:])]  # per depth: (input features, input embeddings)
    outs: list[torch.Tensor] = []
    for i in range(1, n_steps + 1):
        if i > 1:
            A = T - i  # anchors 0..T-1-i: their depth-i token a + i is in the sequence
            inputs.append((outs[-1][:, :A], e[:, i:]))
            anchor = torch.cat([anchor, torch.arange(A, device=dev)])
            step = torch.cat([step, torch.full((A,), i - 1, dtype=torch.long, device=dev)])
        mask = additive_mask(visible(anchor, step, anchor, step, masked=False))[None, None]
        pos = anchor + step + 1
        cos, sin = rope_rows(model, pos)
        x_f = torch.cat([a for a, _ in inputs], 1)
        x_e = torch.cat([b for _, b in inputs], 1)
        # rows of earlier depths never see the new ones, so re-running them gives their outputs unchanged
        y = head(x_f, x_e, lambda layer, block, h, gate, kb: block(h, cos, sin, None, None, MaskedView(mask)))
        outs.append(y[:, step == i - 1])
    return outs


def eagle_loss(model: Transformer, head: EagleHead, tokens: torch.Tensor,
               states: tuple[torch.Tensor, list[torch.Tensor]] | None = None, mask: torch.Tensor | None = None, *,
               w_cls: float = W_CLS, noise: float = 0.0, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, list[float]]:
    """L_reg + w_cls L_cls over the positions t + 1 < T whose target is real (module docstring).

    states: (base logits [B, T, V], hidden states whose last entry is the final residual), e.g. from
    `FrozenStates`; computed here when None. Returns (loss, [L_cls (the depth-1 KL, comparable with the other
    methods' step-1 KL), L_reg])."""
    logits, hs = states if states is not None else base_states(model, tokens)
    feats = hs[-1]
    fhat = eagle_forward(model, head, tokens, feats, 1, noise, generator)[0]  # predicts f_1..f_{T-1}
    # every row runs the draft layer (the later rows attend to it); only the counted ones pay for the head
    pair = torch.cat([fhat.float(), feature(model, feats[:, 1:]).detach().float()], -1)
    pair, teacher, valid = gather_counted(pair, teacher_logits(logits, head)[:, 1:],
                                          None if mask is None else mask[:, 1:])
    fhat, target = pair.split(fhat.shape[-1], -1)
    reg = F.smooth_l1_loss(fhat, target, reduction="none").mean(-1)
    if valid is None:
        reg = reg.mean()
    else:
        w = valid.to(reg.dtype)
        reg = (reg * w).sum() / w.sum().clamp_min(1.0)
    kl = kl_to_base(teacher, feature_logits(model, fhat, head), valid)
    return reg + w_cls * kl, [float(kl.detach()), float(reg.detach())]


def train_eagle(model: Transformer, head: EagleHead, batches: Any, steps: int, lr: float = 1e-3, *,
                w_cls: float = W_CLS, noise: float = FEATURE_NOISE, seed: int = 0, clip: float = 1.0,
                log: Callable[[int, float, list[float]], None] | None = None) -> list[dict[str, Any]]:
    """Train the head with `eagle_loss` on a frozen base (LongTensor batches [B, T] or (tokens, mask), cycled)."""
    head.check_model(model)
    dev = model_device(model)
    head.to(dev).train()
    gen = torch.Generator(device=dev).manual_seed(seed)
    with FrozenBase(model):
        def loss_fn(b: Any) -> tuple[torch.Tensor, list[float]]:
            tokens, mask = split_batch(b, dev)
            return eagle_loss(model, head, tokens, mask=mask, w_cls=w_cls, noise=noise, generator=gen)

        hist = optimise(list(head.parameters()), loss_fn, batch_stream(batches), steps, lr, clip, log)
    head.eval()
    return hist


# ============================================================================================ inference
def _top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probabilities of each row of `logits` [M, V] and their indices: one C pass (top k
    and logsumexp, kernels.topk) where it applies, else log_softmax + `vocab_topk`."""
    out = kernels.topk(logits, k, with_lse=True)
    if out is not None:
        vals, idx, lse = out
        return vals - lse[:, None], idx
    return vocab_topk(torch.log_softmax(logits, -1), k)


class EagleDrafter(Drafter):
    """Drafts `ctx.tree` autoregressively with an `EagleHead` (module docstring, "Module layout").

    State between rounds: the draft KV cache with the rows of positions 0..held-1 (the last of them the
    previous round's root row: its token was the base's own choice) and the tokens they were computed from.
    Every round checks the state against ctx.tokens and keeps only the rows whose tokens still match, so
    one drafter can serve any sequence of generations (a new prompt starts over).
    """

    prefill_features = True  # speculative_generate hands over the features of every prompt row
    static_step = True  # reads ctx.tokens and ctx.hidden; its draft cache is its own

    def __init__(self, model: Transformer, head: EagleHead, dynamic_k: int = 0) -> None:
        head.check_model(model)
        if dynamic_k < 0:
            raise ValueError(f"dynamic_k must be >= 0, got {dynamic_k}")
        self.model, self.head = model, head.to(model_device(model)).eval()
        # The draft layer in the base's weight format (quantization.compress_block, which in q4 also gives
        # its cached attention the C kernel: 0.75 ms a call for its 4 calls a round against 0.9 ms through
        # SDPA). At batch 1 each draft level reads the whole layer, so in fp32 beside a q4 base it read 17 MB
        # a level for SmolLM2 (4.2M weights) against ~2.4 MB in q4: 1.10x -> 1.20x plain on an AVX-512 Xeon
        # (docs/results/hidden-transfer-cpu.md, 26th session). In fp32 too its q|k|v and w1|w3 are joined: four
        # GEMMs a level where there were seven, and in the static step's device rounds RoPE and the K/V store
        # one kernel (kv_cache.SlotView; issue 42: a captured round pays per kernel). A copy: the head itself
        # stays trainable.
        fmt = getattr(model, "weight_format", None)
        self.layer: Block = compress_block(copy.deepcopy(head.layer), fmt or "fp32").eval()
        self.fc: nn.Module = head.fc
        if fmt == "q4" and kernels.available():
            # The fc (2d -> d) in Q8_0, the q4 format's 8-bit format (its LM head's): every draft-layer
            # call read its 2.7 MB in fp32 (SmolLM2), 0.16 ms a call on the 28th session's Xeon, where the
            # weights stream from L3 at ~20 GB/s; Q8_0 reads 0.7 MB. Q4_1 here lowered tau (2.36 -> 2.33,
            # 26th session); Q8_0 keeps it (docs/results/hidden-transfer-cpu.md, 28th session).

            self.fc = Q8Linear(head.fc).eval()
        self.dynamic_k = int(dynamic_k)  # > 0: EAGLE-2 dynamic trees, expanding the top-k nodes per depth
        self.cache: KVCache | None = None
        self.last_logits: torch.Tensor | None = None  # the last round's logits, one row per level row run
        self.reset()

    def reset(self) -> None:
        """Forget the draft rows of the context (the next round rebuilds them)."""
        self.held = 0
        self.held_tokens: list[int] = []  # tokens[:held + 1]: what rows 0..held-1 depend on
        if self.cache is not None:
            self.cache.truncate(0)

    # ------------------------------------------------------------------------------------ the state
    def _level_rows(self, tree: DraftTree) -> list[int]:
        """Draft rows run per tree level after the root (the root row rides the call that commits the
        context): the tree's level sizes (static), or the k expanded nodes of every depth but the last
        (dynamic)."""
        if not tree.max_depth:
            return []
        if self.dynamic_k:
            return [self.dynamic_k] * (tree.max_depth - 1)
        return tree.level_sizes()[1:]

    def _scratch_rows(self, tree: DraftTree) -> int:
        """Scratch slots one round needs after the root: every row run (dynamic), or every node (static: the
        leaves get slots too, though they are never run)."""
        return sum(self._level_rows(tree)) if self.dynamic_k else len(tree)

    def _ensure_cache(self, n_nodes: int) -> KVCache:
        need = self.model.cfg.max_seq_len + n_nodes + 1  # context rows (positions) + one tree in scratch slots
        if self.cache is None or self.cache.max_len < need:
            c = self.head.block_cfg
            w = self.head.fc.weight
            self.cache = KVCache(1, 1, c.n_kv_heads, c.head_dim, need, device=w.device, dtype=w.dtype)
            self.held, self.held_tokens = 0, []
        return self.cache

    def _valid_rows(self, tokens: list[int]) -> int:
        """How many held rows still belong to `tokens` (row t depends on tokens[:t + 2])."""
        n = len(self.held_tokens)
        if tokens[:n] == self.held_tokens:
            return self.held
        same = next((i for i, (a, b) in enumerate(zip(tokens, self.held_tokens)) if a != b), min(len(tokens), n))
        return max(0, min(self.held, same - 1))

    def _features(self, ctx: DraftContext, start: int, p: int) -> torch.Tensor:
        """Base features f_start..f_{p-1} [p - start, d] (normalised): from ctx.hidden (positions p-m..p-1),
        else recomputed by one base forward (a context the loop did not hand over)."""
        m = ctx.hidden.shape[0]
        if start >= p - m:
            return feature(self.model, ctx.hidden[start - (p - m):])
        toks = torch.tensor([ctx.tokens[:p]], device=model_device(self.model))
        out = self.model(toks, output_hidden_states=True, return_logits=False)
        return feature(self.model, out.hidden_states[-1][0, start:])

    def _run(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, start: int,
             extra: torch.Tensor | None) -> torch.Tensor:
        """The head over the draft cache: rows [1, M] at the (reserved) slots start..start+M-1."""
        cache = self.cache
        M = tokens.shape[1]
        cos, sin = rope_rows(self.model, positions)
        cos, sin = cos[:, None], sin[:, None]
        slots = torch.arange(start, start + M, device=cache.pos.device)[None]
        cache.pos[:, start:start + M] = positions
        step = CachedStep(cache, start, slots, cos, sin, skip=False, extra_mask=extra)
        return self.head(feats, embed(self.model, tokens, positions), step, self.layer, self.fc)

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[tuple]:
        """What one round drafts, for `tree_cost.round_forwards` (its (rows per base block, head rows) format):
        the draft layer has a base block's shape, so a level of r rows is costed as r rows through ONE block
        (the fc's 2d x d adds a little) plus r rows through the LM head (its draft vocabulary's share of it).
        The call that commits the context (1 + accepted rows, counted as 1, their minimum) also runs the
        root row and its head row."""
        share = head_share(self.head, self.model.cfg.vocab_size)  # a draft vocabulary reads part of the head
        out = [([1] + [0] * (n_layers - 1), 1 if tree.max_depth else 0, share)]
        out += [([r] + [0] * (n_layers - 1), r, share) for r in self._level_rows(tree)]
        return out

    # ------------------------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft | list[list[int]]:
        tree, model = ctx.tree, self.model
        p = len(ctx.tokens) - 1  # the pending root token's position
        if ctx.hidden.shape[0] == 0:  # 1-token prompt, first round: no feature yet
            return placeholder_candidates(tree.ranks_per_depth, model.cfg.vocab_size)
        cache = self._ensure_cache(self._scratch_rows(tree))
        dev = cache.pos.device
        valid = min(self._valid_rows(ctx.tokens), p - 1)  # row p - 1 is this round's root: always rebuilt
        feats = self._features(ctx, valid, p)  # f_valid..f_{p-1}
        cache.truncate(valid)
        # ONE call commits the draft rows of positions valid..p-2 -- (f_t, e_{t+1}) at RoPE position t + 1,
        # causal -- and runs the root row (f_{p-1}, e_p) after them. The root's token e_p is the base's own
        # choice, so its row is context for the next round, kept: a tree level saved per round (issue 11,
        # 28th session: ~0.4 ms of a ~15 ms round on a 2-core Xeon).
        M = p - valid
        cache.reserve(M)
        toks = torch.tensor([ctx.tokens[valid + 1:p + 1]], device=dev)
        out = self._run(feats[None], toks, torch.arange(valid + 1, p + 1, device=dev)[None], valid, None)[0]
        self.held, self.held_tokens = p, list(ctx.tokens[:p + 1])
        root_out = out[-1]
        if not len(tree):
            self.last_logits = None
            return Draft(node_tokens=torch.zeros(0, dtype=torch.long))
        root_logits = feature_logits(model, root_out[None], self.head)
        if self.dynamic_k:
            return self._dynamic(ctx, root_out, root_logits, p, cache)
        # The tree: level 0 is the root row (at slot p - 1, now cached); a node's row is (its parent's
        # predicted feature, its own token), so row r's input feature is row parent(r)'s output.
        s0 = cache.length - 1  # the root's slot
        n = len(tree)
        parent_row = [0] + [int(x) + 1 for x in tree.parent.tolist()]
        pred: list[torch.Tensor | None] = [root_out] + [None] * n
        level_logits: list[torch.Tensor] = [root_logits]

        def step(tok: torch.Tensor, pos: torch.Tensor, start: int, extra: torch.Tensor) -> torch.Tensor:
            a, m = start - s0, tok.shape[1]
            inp = torch.stack([pred[parent_row[r]] for r in range(a, a + m)])[None]
            out = self._run(inp, tok, pos, start, extra)[0]  # [m, d]
            for j in range(m):
                pred[a + j] = out[j]
            logits = feature_logits(model, out, self.head)
            level_logits.append(logits)
            return logits

        draft = draft_tree_autoregressive(dataclasses.replace(ctx, cache=cache), step, draft_vocab(self.head),
                                          root_logits=root_logits)
        self.last_logits = torch.cat(level_logits)
        return draft

    def _dynamic(self, ctx: DraftContext, root_out: torch.Tensor, root_logits: torch.Tensor, p: int,
                 cache: KVCache) -> Draft:
        """EAGLE-2's dynamic draft tree (Li et al. 2024b, arXiv 2406.16858, sec. 4): a node's score is the
        product of the draft probabilities along its path (its estimated acceptance). Expansion: at every
        depth the k highest-scoring new nodes are run through the draft layer, and each proposes its top-k
        children. Reranking: of all nodes proposed, the len(ctx.tree) highest-scoring ones form this round's
        tree (depth <= ctx.tree.max_depth). A child never scores above its parent, and ties go to the
        shallower, then lexicographically smaller path, so the chosen set is prefix-closed. The root row
        (its output `root_out`, logits `root_logits`) is the cache's last row, already run."""
        k, n_budget, D = self.dynamic_k, len(ctx.tree), ctx.tree.max_depth
        self.last_logits = None  # (the static path's per-level logits; not kept here)
        model, dev = self.model, cache.pos.device
        vocab = draft_vocab(self.head)
        s0 = cache.length  # the first scratch slot (the root sits at s0 - 1, with the context)
        R = self._scratch_rows(ctx.tree)
        run_paths: list[tuple[int, ...]] = []  # rows run, in the order of their scratch slots s0, s0 + 1, ...
        pred: dict[tuple[int, ...], torch.Tensor] = {(): root_out}
        cand: dict[tuple[int, ...], tuple[int, float]] = {}  # path -> (token, log score)
        level: list[tuple[int, ...]] = [()]
        logits = root_logits
        cache.reserve(R)
        try:
            for d in range(D):
                if d:  # run the level: each row sees the context (with the root) and its run ancestors
                    a = len(run_paths) - len(level)  # the level's first scratch row
                    mask = [[0.0 if path[:len(q)] == q else float("-inf") for q in run_paths] for path in level]
                    extra = torch.cat([torch.zeros(len(level), s0), torch.tensor(mask),
                                       torch.full((len(level), R - len(run_paths)), float("-inf"))], 1)
                    out = self._run(torch.stack([pred[x[:-1]] for x in level])[None],
                                    torch.tensor([[cand[x][0] for x in level]], device=dev),
                                    torch.full((1, len(level)), p + d, device=dev, dtype=torch.long), s0 + a,
                                    extra.to(dev)[None, None])[0]
                    for i, path in enumerate(level):
                        pred[path] = out[i]
                    logits = feature_logits(model, out, self.head)
                top_lp, top_ix = _top_logprobs(logits.float(), min(k, logits.shape[-1]))
                ids = to_token_ids(top_ix, vocab).tolist()
                for i, (path, row_lp) in enumerate(zip(level, top_lp.tolist())):
                    base = cand[path][1] if path else 0.0
                    for r, (tok, lp) in enumerate(zip(ids[i], row_lp)):
                        cand[path + (r,)] = (tok, base + lp)
                if d + 1 == D:
                    break
                level = sorted((x for x in cand if len(x) == d + 1), key=lambda x: (-cand[x][1], x))[:k]
                run_paths += level
        finally:
            cache.truncate(s0)
        self.last_scores = cand  # every proposed node's (token, log score), for inspection and tests
        chosen = sorted(cand, key=lambda x: (-cand[x][1], len(x), x))[:n_budget]
        tree = DraftTree(chosen)
        return Draft(node_tokens=torch.tensor([cand[x][0] for x in tree.paths], dtype=torch.long), tree=tree)


    def device_draft(self, step: DecodeStep, tree: DraftTree) -> "EagleRounds | None":
        """The draft on the device (EAGLE-2's dynamic tree, or a static tree), for the static step's device rounds
        (speculative/static.py); None for a tree without nodes."""
        return EagleRounds(self, step, tree) if tree.max_depth else None


class EagleRounds:
    """EAGLE's draft made on the device: `EagleDrafter`'s, in static shapes and with no host read, for the static
    step's device rounds (speculative/static.py, `DeviceDraft`). EAGLE-2's dynamic tree (`dynamic_k`, below) or
    a static tree (`_static_tree`).

    The draft cache is the drafter's own rule with fixed addresses: k, v [1, Hk, S, d], where slot t < S_ctx
    (the step's max_len) holds the entry of position t (input (f_t, e_{t+1}) at RoPE position t + 1), the
    next (D - 1) k slots hold the tree's expanded rows (depth d's k rows at S_ctx + (d - 1) k ..; a static tree:
    node i at S_ctx + i), and the last is where padding rows write. Visibility is positional (an entry below
    the root's position is committed text), so nothing but the slots is tracked.

    A round: (1) the D + 1 rows committed by the last round (the root and up to D accepted nodes, padded) go
    through the draft layer, each seeing the entries before it; the last real row predicts the root's feature.
    (2) Expansion (EAGLE-2 sec. 4): its top-k tokens are depth 1's candidates, scored by their draft
    log-probability; at every depth d < D the k best candidates of depth d (a stable sort: ties in
    candidate order) run through the draft layer, each seeing the context and its run ancestors, and each
    proposes its top k, scored by the sum of log-probabilities along the path. (3) Reranking: the n best of
    all k + (D - 1) k^2 candidates (stable: a child, never above its parent, comes after it) are the tree, in
    candidate order, which is by depth, so parents come first. (4) Its layout (`TreeTensors`' fields)
    follows from the parent of each node by D index steps. Ties aside, it is the host drafter's tree
    (tests/test_decode_step.py).

    Where the step attends through its kernel (attention="triton": a GPU), the draft layer's rows do too
    (`SlotView(rows=)`), each over the positions up to its own in position order: a committed entry at its own
    slot, a tree row's ancestors-or-self at their slots (`_keys`), the same keys as the slot mask names. On the
    H200 (62nd session, run 5) the mask's way was PyTorch's attention in fp32 with its casts: two fp32 GEMMs, a
    softmax and four copies a call, three calls a round."""

    def __init__(self, drafter: EagleDrafter, step: DecodeStep, tree: DraftTree) -> None:
        self.d, self.step = drafter, step
        self.k, self.D = k, D = drafter.dynamic_k, tree.max_depth
        self.dynamic = k > 0
        self.reach, self.pseudo = D, (0, 0)  # (no hidden-transfer rows)
        self.ctx = step.max_len
        dev = step.device
        if self.dynamic:
            self.C = dynamic_candidates(k, D)  # candidates proposed
            self.n = min(len(tree), self.C)
            self.tree_rows, self.N, self.head_rows = round_layout(self.n, 0, step.buckets)
            S = self.ctx + (D - 1) * k + 1
            self.cand_depth = torch.cat([torch.ones(k, dtype=torch.long)] +
                                        [torch.full((k * k,), d + 1, dtype=torch.long) for d in range(1, D)]).to(dev)
            ar = torch.arange(self.N, device=dev)
            self.real = ar < self.n + 1
            self.is_node = self.real & (ar > 0)
            self.zeros = torch.zeros(self.N, dtype=torch.long, device=dev)
            self.prow = torch.zeros(self.N, 1, dtype=torch.long, device=dev)
        else:  # a static tree: its layout once; node i's draft row at slot S_ctx + i
            self.n = len(tree)
            layout = step.tree_tensors(tree.parent.tolist(), tree.depth.tolist())
            self.fields = tree_fields(layout)
            self.tree_rows, self.N, self.head_rows = layout.tree_rows, layout.vis.shape[0], layout.head_rows
            S = self.ctx + self.n + 1
            levels = tree.levels()  # per depth: its nodes, their parents among the depth above, their ranks
            self.levels = [(a, b) for a, b, _, _ in levels]
            self.parent_at = [torch.tensor(parent, device=dev) for _, _, parent, _ in levels]
            self.rank_at = [torch.tensor(rank, device=dev) for _, _, _, rank in levels]
            self.kmax = [max(rank) + 1 for _, _, _, rank in levels]
            anc = torch.zeros(self.n, S, dtype=torch.bool)
            anc[:, self.ctx:self.ctx + self.n] = tree.ancestor_mask
            self.anc = anc.to(dev)
            self.slots_at = [self.ctx + torch.arange(a, b, device=dev) for a, b in self.levels]  # node i's: ctx + i
            # depth d's nodes' ancestors-or-self by depth, as slots [b - a, d] (the row attention's keys, `_keys`)
            par = tree.parent.tolist()
            chains = [[i] for i in range(self.n)]
            for i in range(self.n):
                if par[i] >= 0:
                    chains[i] = chains[par[i]] + [i]
            self.path_at = [self.ctx + torch.tensor(chains[a:b], device=dev) for a, b in self.levels]
        c, w = drafter.head.block_cfg, drafter.head.fc.weight
        self.kc = torch.zeros(1, c.n_kv_heads, S, c.head_dim, device=dev, dtype=w.dtype)
        self.vc = torch.zeros_like(self.kc)
        if step.graphs == "compile":  # written in place: static addresses keep CUDA graphs on (as the step's cache)
            for t in (self.kc, self.vc):
                torch._dynamo.mark_static_address(t)
        self.pad = S - 1
        self.slot_ids = torch.arange(S, device=dev)
        # constants of a round, made once: a captured round would replay each made inside it as a kernel (a
        # Python scalar in torch.where is one too: scalar_tensor)
        self.rows = torch.arange(D + 1, device=dev)
        self.pad_t = torch.tensor(self.pad, device=dev)  # (0: the step's own, `step.zero`)
        self.open, self.shut = torch.tensor(0.0, device=dev), torch.tensor(float("-inf"), device=dev)
        # the draft layer attends through the step's attention kernel where the step does (class docstring); its
        # operands' constants: every position up to a row's own is seen, so its kmask is all 0
        self.kernel = step.attention == "triton"
        rows = max([D + 1, k] + [b - a for a, b in getattr(self, "levels", [])])
        self.ident = self.slot_ids[None, None].expand(1, rows, S)  # keys: position p at slot p
        self.kzero = torch.zeros(1, rows, S, device=dev)
        self.cols = torch.arange(D, device=dev)
        # the launch's counters (row_attention): the step's, zero between launches, where they are enough
        self.counts = step.attn_counts if step.attn_counts.numel() >= rows * c.n_kv_heads else None
        if self.dynamic:
            ar = torch.arange(k, device=dev)
            self.no_parent = torch.full((k,), -1, dtype=torch.long, device=dev)
            self.first_parents = ar[:, None].expand(k, k).reshape(-1)  # depth 2's candidates': k each, in order
            # depth d's run rows' own slots (ctx + (d - 1) k ..), as a one-hot [k, S] per depth 1..D-1
            self.own = [self.ctx + (d - 1) * k + ar for d in range(1, D)]
            self.own_hot = [self.slot_ids[None, :] == own[:, None] for own in self.own]

    def _run(self, feats: torch.Tensor, toks: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
             visible: torch.Tensor | None, rows: tuple | None = None) -> torch.Tensor:
        """The draft layer over M rows: input features [M, d] (already in feature space), tokens, RoPE
        positions and slots [M], and the keys each row sees: visible [M, S] bool over the slots, or (with the
        step's kernel) `rows`, the row attention's operands (`_keys`). Returns the predicted features [M, d]."""
        model = self.d.model
        cos, sin = rope_rows(model, pos)
        cos, sin = cos[None, None], sin[None, None]
        mask = None if rows is not None else torch.where(visible, self.open, self.shut)[None, None]
        view = SlotView(self.kc, self.vc, slots, mask, rows)
        return self.d.head(feats[None], embed(model, toks[None], pos[None]),
                           lambda i, block, h, gate, kb: block(h, cos, sin, None, None, view), self.d.layer,
                           self.d.fc)[0]

    def _keys(self, last_pos: torch.Tensor, d: int, path: torch.Tensor) -> tuple:
        """The row attention's operands for m tree rows of depth d (RoPE position last_pos + d): a row sees the
        committed entries, position p < last_pos at slot p (read there directly: `start`), then its
        ancestors-or-self, position last_pos + j at slot path[:, j] (j < d), up to its own, last_pos + d - 1.
        (The entry of position p has RoPE position p + 1: class docstring.)"""
        m = path.shape[0]
        keys = self.ident[0, :m].scatter(1, (last_pos + self.cols[:d])[None].expand(m, d), path)
        return keys[None], self.kzero[:, :m], (last_pos + (d - 1)).expand(1, m), last_pos, self.counts

    def _top(self, out: torch.Tensor, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The k (default: the expansion width) best (log-probability, token id) of each predicted feature [m, d]."""
        logits = feature_logits(self.d.model, out, self.d.head).float()
        lp, ix = _top_logprobs(logits, min(k or self.k, logits.shape[-1]))
        return lp, to_token_ids(ix, draft_vocab(self.d.head))

    def first(self, tokens: list[int], hidden: torch.Tensor, draft_logits: torch.Tensor | None
              ) -> tuple[torch.Tensor, ...] | None:
        """Commit the entries of every position before the root's but the last D + 1 (one eager call); those
        are the first round's rows. None without a feature for every position (a 1-token prompt's start)."""
        p = len(tokens) - 1
        if p < 1 or hidden.shape[0] != p:
            return None
        M, dev, st = self.D + 1, self.step.device, self.step
        c = min(M, p)
        if p > c:
            i = torch.arange(p - c, device=dev)
            self._run(feature(self.d.model, hidden[:p - c]), torch.tensor(tokens[1:p - c + 1], device=dev), i + 1, i,
                      self.slot_ids[None, :] <= i[:, None])
        feats = hidden.new_zeros(M, hidden.shape[-1])
        feats[:c] = hidden[p - c:]
        toks = torch.zeros(M, dtype=torch.long, device=dev)
        toks[:c] = torch.tensor(tokens[p - c + 1:p + 1], device=dev)
        return feats, toks, st._scalar(p - c), st._scalar(c - 1)

    def draft(self, root: torch.Tensor, last_pos: torch.Tensor, feats: torch.Tensor, toks: torch.Tensor,
              first: torch.Tensor, last_row: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(node tokens [n], the tree's TreeTensors fields) from the rows committed last, rows 0..`last_row`:
        residuals `feats` [D + 1, d] of positions first.., with their next tokens `toks` (class docstring)."""
        k, D = self.k, self.D
        # (1) the committed rows; row `last_row` (the entry of position last_pos - 1) predicts the root's feature
        at = first + self.rows  # their slots, and RoPE positions one on
        real = self.rows <= last_row
        M = self.D + 1  # (a padding row reads the positions up to its place among them, harmlessly)
        if self.kernel:  # (the row attention's operands: each row over the positions up to its own slot)
            seen = (None, (self.ident[:, :M], self.kzero[:, :M], at[None], self.step.zero, self.counts))
        else:  # (the slot mask)
            seen = (self.slot_ids[None, :] <= at[:, None], None)
        out = self._run(feature(self.d.model, feats), toks, torch.where(real, at + 1, self.step.zero),
                        torch.where(real, at, self.pad_t), *seen)
        root_out = out.index_select(0, last_row.view(1))
        if not self.dynamic:
            return self._static_tree(root_out, last_pos), self.fields
        prev = root_out.expand(k, -1)
        lp, ids = self._top(root_out)
        toks_all, scores, parents = [ids[0]], [lp[0]], [self.no_parent]
        # (2) expansion: the k best of each depth run, each proposes its k best
        committed = None if self.kernel else (self.slot_ids < last_pos)[None, :]
        anc, base = None, 0  # the run rows' ancestors-or-self: a slot mask, or with the kernel their slots by depth
        for d in range(1, D):
            last = scores[-1]
            if d == 1:  # depth 1's k candidates all run, each from the root: nothing to select
                x, t, picked, par = prev, toks_all[-1], last, self.first_parents
                anc = self.own[0][:, None] if self.kernel else self.own_hot[0]
            else:
                picked, sel = (v[:k] for v in torch.sort(last, descending=True, stable=True))  # (scores, candidates)
                src = sel // k  # the previous level's run row of each
                if self.kernel:
                    anc = torch.cat([anc.index_select(0, src), self.own[d - 1][:, None]], 1)
                else:
                    anc = anc.index_select(0, src) | self.own_hot[d - 1]
                x, t = prev.index_select(0, src), toks_all[-1].index_select(0, sel)
                par = (base + sel)[:, None].expand(k, k).reshape(-1)  # (no repeat_interleave: no host read)
            prev = self._run(x, t, (last_pos + d).expand(k), self.own[d - 1], None if self.kernel else committed | anc,
                             self._keys(last_pos, d, anc) if self.kernel else None)
            lp, ids = self._top(prev)
            toks_all.append(ids.reshape(-1))
            scores.append((picked[:, None] + lp).reshape(-1))
            parents.append(par)
            base += last.shape[0]
        # (3) reranking: the n best, in candidate order (by depth: parents first); (4) the layout: ancestors-or-self
        # by D steps up the parents, path[r, depth] = the ancestor there (ops/tree_layout.py: each one kernel
        # where the step runs its kernels, else its PyTorch formula)
        kernels = self.step.attention == "triton"
        rerank = tree_layout.rows if kernels else tree_layout.reference_rows
        nodes, parent, depth = rerank(torch.cat(scores), torch.cat(toks_all), torch.cat(parents), self.cand_depth,
                                      self.n, self.N)
        vis, path = (tree_layout.layout if kernels else tree_layout.reference)(parent, depth, self.real, D)
        return nodes, (vis, parent, depth, self.real, self.is_node, path, self.zeros, self.zeros, self.prow)

    def _static_tree(self, root_out: torch.Tensor, last_pos: torch.Tensor) -> torch.Tensor:
        """A static tree's node tokens [n], level by level as `drafting.draft_tree_autoregressive` fills it: node
        (r_1..r_d) takes the rank-r_d token of its parent's draft distribution, and every node above the last
        depth runs the draft layer (its parent's predicted feature and its own token), seeing the context and its
        ancestors-or-self."""
        committed = None if self.kernel else (self.slot_ids < last_pos)[None, :]
        _, ids = self._top(root_out, self.kmax[0])
        toks = [ids[0].index_select(0, self.rank_at[0])]  # depth 1
        prev = root_out
        for d in range(1, self.D):
            a, b = self.levels[d - 1]  # depth d's nodes: run; their top tokens are depth d + 1's
            prev = self._run(prev.index_select(0, self.parent_at[d - 1]), toks[-1], (last_pos + d).expand(b - a),
                             self.slots_at[d - 1], None if self.kernel else committed | self.anc[a:b],
                             self._keys(last_pos, d, self.path_at[d - 1]) if self.kernel else None)
            _, ids = self._top(prev, self.kmax[d])
            toks.append(ids[self.parent_at[d], self.rank_at[d]])
        return torch.cat(toks)

    def after(self, packed: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, draft: torch.Tensor,
              last_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The next round's rows: the residuals of the root and the accepted nodes (positions last_pos..), with
        their next tokens (the accepted ones, then the bonus)."""
        M, i = self.D + 1, self.rows
        a = packed[0]
        feats = hidden[0].index_select(0, rows[:M].clamp_min(0))
        toks = torch.where(i < a, packed[1:1 + M], torch.where(i == a, packed[-1], self.step.zero))
        return feats, toks, last_pos, a  # (a: the next round's last real row)


class EagleRows:
    """EAGLE chains for the rows of a continuous batch (engine/batch.py, its `RowDrafter`): the draft KV cache
    of `EagleDrafter` with one row per batch row, each row with its own length, as the base's batch cache has.

    Slots. Row r's draft entry for position t -- the input (f_t, e_{t+1}) at RoPE position t + 1, as in
    `EagleDrafter` -- sits at slot t. The chain's entries follow the committed ones at the next slots; the
    next call writes the newly committed entries over them. Attention is causal by slot, and a row's slots
    below a query's are always its own latest entries (committed, or this chain's), so nothing else is needed
    to hide what earlier chains, earlier sequences of the row or padding left behind.

    One call per step: ONE draft-layer forward over every row's newly committed entries (rows right-aligned,
    shorter ones padded in front at a scratch slot past every row's entries, as `ContinuousBatch._forward`
    pads), whose last row per sequence predicts the feature at its pending position; then depth - 1 forwards
    of one row per sequence (the predicted feature and the token drafted from it, EAGLE's drafting phase).
    Each chain is the top-1 path of the drafter's tree, so in q4 (row-invariant kernels) it is the chain the
    one-sequence `EagleDrafter` drafts from the same context (tests/test_batch.py)."""

    keeps_rows = True  # a draft KV cache row per batch row (engine/batch.py, `RowDrafter`)

    def __init__(self, drafter: EagleDrafter, max_rows: int, initial_len: int = 256) -> None:
        self.d = drafter
        c, w = drafter.head.block_cfg, drafter.head.fc.weight
        self.ctx = drafter.model.cfg.max_seq_len
        self.cache = KVCache(1, max_rows, c.n_kv_heads, c.head_dim, min(initial_len, self.ctx + 1), device=w.device,
                             dtype=w.dtype)

    @property
    def rows(self) -> int:
        return self.cache.batch

    def _reserve(self, need: int) -> None:
        """At least `need` slots (doubling), keeping what the rows hold."""
        if need > self.cache.max_len:
            self.cache = self.cache.grown(max(need, 2 * self.cache.max_len))

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.copy_row(src, dst, length)

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        self.cache.swap_rows(a, b, length_a, length_b)

    def _run(self, rows: list[int], feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
        """The head over rows `rows` of the draft cache: entries [n, M] at their own slots."""
        view = self.cache.rows(rows[0], rows[-1] + 1)
        view.length = int(slots.max()) + 1
        view.pos.scatter_(1, slots, positions)
        cos, sin = rope_rows(self.d.model, positions)
        step = CachedStep(view, None, slots, cos[:, None], sin[:, None], skip=False)
        return self.d.head(feats, embed(self.d.model, tokens, positions), step, self.d.layer, self.d.fc)

    def _top1(self, out: torch.Tensor) -> torch.Tensor:
        """The draft token of each predicted feature [n, d]: the head's top-1 (over its draft vocabulary)."""
        logits = teacher_logits(feature_logits(self.d.model, out, self.d.head), self.d.head)
        return to_token_ids(logits.topk(1, -1).indices[:, 0], draft_vocab(self.d.head))

    @torch.no_grad()
    def chains(self, rows: list[int], starts: list[int], hidden: list[torch.Tensor], tokens: list[list[int]],
               depth: int) -> list[list[int]]:
        n = len(rows)
        if n == 0 or depth == 0:
            return [[] for _ in rows]
        if rows != list(range(rows[0], rows[0] + n)):  # the batch's drafting rows, taken as one stretch
            return self._scattered(rows, starts, hidden, tokens, depth)
        dev = self.cache.k.device
        counts = [h.shape[0] for h in hidden]
        M = max(counts)
        ends = [s + m for s, m in zip(starts, counts)]  # each row's pending position
        scratch = max(ends)  # padding's slot: past every row's entries
        self._reserve(max(scratch + 1, max(ends) + depth - 1))
        model = self.d.model
        feats = torch.zeros(n, M, hidden[0].shape[-1], dtype=hidden[0].dtype)
        toks = torch.zeros(n, M, dtype=torch.long)
        pos = torch.zeros(n, M, dtype=torch.long)
        slots = torch.full((n, M), scratch, dtype=torch.long)
        for i, (h, t, s, m) in enumerate(zip(hidden, tokens, starts, counts)):
            feats[i, M - m:] = h
            toks[i, M - m:] = torch.tensor(t)
            slots[i, M - m:] = torch.arange(s, s + m)
            pos[i, M - m:] = slots[i, M - m:] + 1
        feats, toks, pos, slots = (x.to(dev) for x in (feats, toks, pos, slots))
        out = self._run(rows, feature(model, feats), toks, pos, slots)[:, -1]  # [n, d]: the pending positions
        end = torch.tensor(ends, device=dev)[:, None]
        chain = [self._top1(out)]
        for j in range(1, depth):  # entry (fhat_{p+j-1}, e_{d_j}) at slot p + j - 1, RoPE position p + j
            # (a row near the context's end drafts past it here; the batch cuts its chain to what fits, and the
            # position is clamped only so that the RoPE table has it)
            pos = (end + j).clamp(max=self.ctx - 1)
            out = self._run(rows, out[:, None], chain[-1][:, None], pos, end + j - 1)[:, 0]
            chain.append(self._top1(out))
        return torch.stack(chain, 1).tolist()

    def _scattered(self, rows: list[int], starts: list[int], hidden: list[torch.Tensor], tokens: list[list[int]],
                   depth: int) -> list[list[int]]:
        """Rows that are not one stretch (some rows of the batch do not draft this step): each maximal run of
        consecutive rows in one call (every row's chain depends on its own row only)."""
        out: list[list[int]] = []
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            out += self.chains(rows[i:j], starts[i:j], hidden[i:j], tokens[i:j], depth)
            i = j
        return out


__all__ = ["EagleHead", "EagleDrafter", "EagleRounds", "EagleRows", "eagle_forward", "eagle_loss", "train_eagle", "embed",
           "feature_logits", "W_CLS", "FEATURE_NOISE"]
