"""Hidden transfer (Wu et al. 2024, "Parallel Decoding via Hidden Transfer for Lossless LLM Acceleration",
arXiv 2404.12022): training, the inference drafter, and the one attention mask both use.

Method (sec. 3.2-3.3). A frozen base of L blocks; k transfer steps; step i (1-based) owns a trainable
d x d map W_i applied at block t_i (t_1 <= t_2 <= ... <= t_k, 0 <= t_i <= L). For a real token at
position j ("the anchor") with residual h_j entering block t_i, the pseudo state

    hhat_{j,i} = W_i h_j                                          (sec. 3.3, first equation)

stands for position j + i: it gets RoPE position id j + i, joins the sequence at block t_i, runs through
blocks t_i..L-1 together with the real tokens, and the base's own final norm + LM head decode it. Its
output is a guess of the base distribution at position j + i, i.e. of token j + i + 1.

Indexing at inference. The anchor is the last committed token that is in the KV cache, at position
j = len(tokens) - 2 (the pending token tokens[-1] at j + 1 is not in the cache yet; `speculative`'s
invariant). The base logits at j predicted the pending token; step i predicts the token at j + i + 1,
which is depth i of the next draft tree. That matches the paper's fused round, where the anchor is the
last accepted node and its ordinary logits give the bonus token.

THE mask (one definition, `visible`, used verbatim by training and inference). Each row carries
(anchor, step): a real token at position p is (p, 0); the pseudo state of anchor j for step i is (j, i).
A query row q may attend to a key row k iff

    step_k == 0 and anchor_k <= anchor_q                        (real keys up to the anchor; for a real
                                                                 query this is ordinary causality)
 or step_q >= 1 and anchor_k == anchor_q and step_k >= 1 and
    (step_k == step_q  or  (not masked and step_k < step_q))    (itself, and in the default "not masked"
                                                                 setting the earlier steps of its anchor)

and only rows that exist at the block attend or are attended to (pseudo rows of step i exist from block
t_i up; since the t_i are non-decreasing, the earlier steps of an anchor exist wherever a later one does).
Consequences: real tokens never see pseudo states, so the real rows of the training pass are exactly the
base model's forward; pseudo states of different anchors never see each other. The `masked` variant
(sec. 4.5 ablation, "Masked") hides the earlier pseudo steps: a pseudo state sees real states <= j and
itself only. Gated bases: pseudo rows have gate 1 at every block (never skipped, key bias 0); real rows
keep their own gates, so their keys carry the usual ln(max(g, eps)) bias.

Why this mask and not the paper's training mask. Sec. 3.3 lets hhat_{j,i} see the real states 1..j+i-1
and itself. At inference (sec. 3.4, Fig. 2) the real states j+1..j+i-1 do not exist yet; there the earlier
pseudo states of the same anchor stand in for them (the "No masked" setting of sec. 4.5, which the paper
finds better than hiding them). Training with real j+1..j+i-1 but drafting with pseudo ones is a train /
test mismatch; we remove it by training with exactly the inference visibility: every anchor of the
training sequence is treated as if it were the last committed token. Teacher forcing then still covers
all anchors in one pass: the training sequence is [real 0..T-1 ; step-1 pseudo rows of anchors
0..T-2 ; step-2 pseudo rows of anchors 0..T-3 ; ...] (an anchor j is kept for step i only if its target
position j + i < T exists), one forward with this mask through SDPA. Consistency guarantee: (1) the same
`visible` function builds both masks; (2) the last anchor's pseudo rows in training see exactly the keys
the inference pass sees (the real context 0..j, which the KV cache holds as the same causal function of
the prefix, and the same pseudo rows), with the same positions, gates and weights, so their logits agree
to float rounding -- `tests/test_drafters.py` checks 1e-5 through a real speculative run. (Gated bases
with real skipping: a skipped real key has bias -inf in the cache instead of ln(1e-6) in the training
pass, an O(1e-6) difference.)

Initialisation of W_i: the identity (the paper does not say). The first pseudo state is then a copy of
h_j moved to position j + i -- the "copy mechanism" the paper discusses in sec. 3.2 (Elbayad et al. 2019)
as the natural untrained guess -- which the upper blocks already process as an in-distribution residual;
zero would feed RMSNorm a null vector (pure eps) and a random map an off-distribution state.

Training (sec. 3.3): loss = sum over steps i of KL(p_base(. | position j+i) || p_pseudo(i, anchor j)),
averaged over the anchors whose target exists; the teacher is the base model's own next-token distribution
at that real position (self-distillation), taken from the real rows of the same pass. The base is frozen.
`schedule='sequential'` trains W_1 alone, then W_2 with W_1 fixed, ... (the paper trains the k maps one
after another); 'joint' trains all k at once on the summed loss.

Inference (`HiddenTransferDrafter`), fused as in the paper (sec. 3.4: "verify the candidates and generate
new candidates at the same time"). Every verification forward over [root, tree nodes] also carries, from
block t_i up, the step-i pseudo rows W_i h of *every* tree row -- any of them may turn out to be the last
accepted token, the next anchor. Rows are [tree ; step 1 of each row ; step 2 ; ...]; `tree_visible` is
`visible` with "real key at a position <= the anchor" read as "real key on the anchor's root path" (the
same rule along a chain, tested). After acceptance only the rows of the actual anchor (last accepted
node, or the root) are kept as the next draft; all pseudo K/V slots are dropped with the rejected nodes.
Cost: (n_nodes + 1) * k extra rows from block t_1 up in each verification, instead of a second partial
forward. The first round after the prefill has no previous verification: it drafts with a separate
partial forward over the k pseudo rows of the last cached token (`pseudo_logits_cached`, scratch slots
truncated afterwards); `fused=False` drafts that way every round (same drafts, tested).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from midlayer.engine.decode_step import anchor_shifts
from midlayer.engine.draft_vocab import draft_vocab, head_logits, restrict_logits, to_token_ids
from midlayer.engine.generate import forward_cached, JoinedRows
from midlayer.model.attention import window_mask
from midlayer.model.kv_cache import KVCache, MaskedView
from midlayer.model.transformer import Transformer
from .drafting import (apply_linear, batch_stream, candidate_counts, FrozenBase, kl_to_base, model_device, optimise,
                       placeholder_candidates, split_batch, topk_lists)
from .protocol import DraftContext, Drafter, Forward
from .static import fused_per_step, TopkTreeDraft
from .tree import DraftTree
from .tree_cost import head_share



# ============================================================================================ the mask
def visible(q_anchor: torch.Tensor, q_step: torch.Tensor, k_anchor: torch.Tensor, k_step: torch.Tensor,
            masked: bool) -> torch.Tensor:
    """THE hidden-transfer visibility rule (module docstring): bool [Nq, Nk], True where query row q may
    attend to key row k. Rows are described by (anchor, step): real token at position p = (p, 0)."""
    qa, qs = q_anchor[:, None], q_step[:, None]
    ka, ks = k_anchor[None, :], k_step[None, :]
    real_key = (ks == 0) & (ka <= qa)
    earlier = torch.zeros_like(real_key) if masked else ks < qs
    same_anchor = (qs >= 1) & (ka == qa) & (ks >= 1) & ((ks == qs) | earlier)
    return real_key | same_anchor


def tree_visible(ancestor: torch.Tensor, k: int, masked: bool, anchors: torch.Tensor | None = None) -> torch.Tensor:
    """`visible` for the fused verify-and-draft pass over a draft tree: bool [R, R], R = N + A k.

    Rows: the N tree rows (root = 0, then the nodes in tree order) followed by the pseudo rows of step 1
    for the A anchors (tree rows, `anchors`; None: all N), then step 2, ... (row N + (i - 1) A + j is (anchor j,
    step i)). ancestor [N, N]: [a, b] True iff row b is row a or one of its ancestors (the root is
    everyone's). This is `visible` with "real key at a position <= the anchor" read as "real key on the
    anchor's root path": along a chain the two are the same rule (tested), and in a tree a node's path is
    exactly the real context it stands on."""
    N = ancestor.shape[0]
    dev = ancestor.device
    rows = torch.arange(N, device=dev) if anchors is None else anchors.to(dev)
    A = rows.shape[0]
    anchor = torch.cat([torch.arange(N, device=dev), rows.repeat(k)])
    step = torch.cat([torch.zeros(N, dtype=torch.long, device=dev),
                      torch.arange(1, k + 1, device=dev).repeat_interleave(A)])
    qa, qs, ka, ks = anchor[:, None], step[:, None], anchor[None, :], step[None, :]
    real_key = (ks == 0) & ancestor[qa, ka]
    earlier = torch.zeros_like(real_key) if masked else ks < qs
    same_anchor = (qs >= 1) & (ka == qa) & (ks >= 1) & ((ks == qs) | earlier)
    return real_key | same_anchor


def training_rows(T: int, k: int, all_anchors: bool = False, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, step) of the rows of the training sequence [real 0..T-1 ; step 1 ; ... ; step k].

    Step i has anchors 0..T-1-i (those whose target position j + i < T exists), or 0..T-1 with all_anchors.
    """
    anchors = [torch.arange(T, device=device)]
    steps = [torch.zeros(T, dtype=torch.long, device=device)]
    for i in range(1, k + 1):
        a, A = anchor_range(T, i, all_anchors)
        anchors.append(torch.arange(a, A, device=device))
        steps.append(torch.full((A - a,), i, dtype=torch.long, device=device))
    return torch.cat(anchors), torch.cat(steps)


def training_mask(T: int, k: int, masked: bool, all_anchors: bool = False) -> torch.Tensor:
    """bool [N, N] visibility of the full training sequence (every step present; for inspection/tests)."""
    a, s = training_rows(T, k, all_anchors)
    return visible(a, s, a, s, masked)


def additive_mask(vis: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill(~vis, float("-inf"))


def anchor_range(T: int, step: int, all_anchors: bool = False, first_anchor: int = 0) -> tuple[int, int]:
    """[a, A): the anchors of a training pass's step-`step` rows. A = T - step (the target position j + step
    must exist) or T with all_anchors; a = first_anchor (capped at A), the same for every step, because a
    pseudo row sees the earlier steps' rows of its anchor ("not masked"), which must then exist too."""
    A = T if all_anchors else max(T - step, 0)
    return min(first_anchor, A), A


class _TransferRows:
    """The rows of a training pass (real tokens, then pseudo rows joining at blocks t_i) and how they go
    through a block (a `Transformer.run_blocks` step): attention through the `visible` mask of their
    (anchor, step) pairs, plus eq. 3's key bias for gated bases. The mask is rebuilt only when rows join."""

    def __init__(self, model: Transformer, T: int, device: torch.device, masked: bool, split: bool = True) -> None:
        self.model, self.T, self.masked, self.split = model, T, masked, split
        self.anchor = torch.arange(T, device=device)
        self.step = torch.zeros(T, dtype=torch.long, device=device)
        self.mask: torch.Tensor | None = None  # rebuilt (with cos, sin) when rows join
        self.cos = self.sin = None

    def joiner(self, transfer: "HiddenTransfer", steps: list[int], all_anchors: bool, first_anchor: int = 0
               ) -> Callable:
        def join(x: torch.Tensor) -> torch.Tensor:
            """Step i's rows: W_i of the real rows entering block t_i, for anchors a_i..A-1 (`anchors`)."""
            dev, parts = x.device, []
            for i in steps:
                a, A = anchor_range(self.T, i, all_anchors, first_anchor)
                parts.append(transfer.transfer(x[:, a:A], i))
                self.anchor = torch.cat([self.anchor, torch.arange(a, A, device=dev)])
                self.step = torch.cat([self.step, torch.full((A - a,), i, dtype=torch.long, device=dev)])
            self.mask = None
            return torch.cat(parts, 1)
        return join

    def __call__(self, layer: int, block, x: torch.Tensor, gate: torch.Tensor | None,
                 key_bias: torch.Tensor | None) -> torch.Tensor:
        if self.mask is None:
            self.mask = additive_mask(visible(self.anchor, self.step, self.anchor, self.step, self.masked), x.dtype)[None, None]
            pos = self.anchor + self.step
            self.cos, self.sin = self.model.rope_cos[pos], self.model.rope_sin[pos]
            if self.model.cfg.sliding_window:  # by position, as the KV cache's mask does at inference
                self.mask = self.mask + window_mask(pos, pos, self.model.cfg.sliding_window).to(x.dtype)
            bias = self.model.position_bias(pos, pos)  # ALiBi / T5: [H, N, N]
            if bias is not None:
                self.mask = self.mask + bias[None].to(x.dtype)
        mask = self.mask if key_bias is None else self.mask + key_bias.to(self.mask.dtype)
        T = self.T
        if not (self.split and torch.is_grad_enabled() and x.shape[1] > T):
            return block(x, self.cos, self.sin, gate, None, MaskedView(mask))
        # Training: the real rows never see a pseudo row, so they are the frozen base's own forward and need no
        # gradient: run them without autograd, keep their K/V, and run the pseudo rows (the only ones a draft
        # weight reaches) against [real K/V ; their own]. The same attention, without backpropagating through
        # the real rows (~a third of the rows) -- `split=False` runs all rows together (the reference).
        g = (lambda rows: None) if gate is None else (lambda rows: gate[:, rows])
        real_view = MaskedView(mask[..., :T, :T], keep=True)
        with torch.no_grad():
            real = block(x[:, :T].detach(), self.cos[:T], self.sin[:T], g(slice(None, T)), None, real_view)
        pseudo = block(x[:, T:], self.cos[T:], self.sin[T:], g(slice(T, None)), None,
                       MaskedView(mask[..., T:, :], prefix=(real_view.k, real_view.v)))
        return torch.cat([real, pseudo], 1)


# ============================================================================================ the module
class HiddenTransfer(nn.Module):
    """k trainable d x d maps W_i at blocks t_i (identity init); `masked` selects the ablation mask."""

    KIND = "hidden_transfer"

    def __init__(self, dim: int, layers: Sequence[int], k: int | None = None, masked: bool = False) -> None:
        super().__init__()
        layers = [int(t) for t in layers]
        if k is None:
            k = len(layers)
        if len(layers) == 1 and k > 1:
            layers = layers * k  # one layer given: every step transfers there
        if k < 1 or len(layers) != k:
            raise ValueError(f"need k >= 1 transfer layers, one per step; got k={k}, layers={layers}")
        if any(t < 0 for t in layers) or any(b < a for a, b in zip(layers, layers[1:])):
            raise ValueError(f"transfer layers must be >= 0 and non-decreasing (t_1 <= ... <= t_k), got {layers}")
        self.dim, self.k, self.layers, self.masked = dim, k, layers, bool(masked)
        self.maps = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(k)])
        with torch.no_grad():
            for m in self.maps:
                m.weight.copy_(torch.eye(dim))

    def config(self) -> dict[str, Any]:
        return {"dim": self.dim, "layers": list(self.layers), "k": self.k, "masked": self.masked}

    def transfer(self, h: torch.Tensor, step: int) -> torch.Tensor:
        """hhat = W_step h (step is 1-based)."""
        return apply_linear(self.maps[step - 1], h)

    def steps_at(self, n_steps: int) -> dict[int, list[int]]:
        """Block t -> the steps i <= n_steps whose rows join there (t_i = t), in order."""
        out: dict[int, list[int]] = {}
        for i in range(1, n_steps + 1):
            out.setdefault(self.layers[i - 1], []).append(i)
        return out

    def check_model(self, model: Transformer) -> None:
        if self.dim != model.cfg.dim:
            raise ValueError(f"hidden transfer of dim {self.dim} for a model of dim {model.cfg.dim}")
        if max(self.layers) > model.cfg.n_layers:
            raise ValueError(f"transfer layers {self.layers} exceed the model's {model.cfg.n_layers} blocks")


# ========================================================================================= training pass
def transfer_forward(model: Transformer, transfer: HiddenTransfer, tokens: torch.Tensor, *,
                     n_steps: int | None = None, all_anchors: bool = False, collect: dict | None = None,
                     start: tuple[int, torch.Tensor] | None = None, full: bool = False, first_anchor: int = 0,
                     split: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward over [real tokens ; pseudo rows of steps 1..n_steps] with the `visible` mask.

    tokens [B, T]. Returns (real logits [B, T, V] -- the base model's own, the teacher -- and for each step
    i the pseudo logits [B, A_i, V] of anchors 0..A_i-1, A_i = T - i, or T with all_anchors). Blocks below
    t_1 run on the real rows only; at block t_i step i's rows are appended (W_i of the real rows entering
    block t_i) and the mask is rebuilt; gradients flow into the W_i only when the base is frozen.
    `collect` (a dict, for analysis): filled with the rows entering every block l (and l = L, the final
    residual) under key l, and the final "anchor" / "step" of each row (row indices never change once a
    row has joined).
    `start` = (s, h): the real rows' residual entering block s <= t_1, cached from an earlier pass of the
    frozen base (dense bases only: a gated base's gates need the blocks below); blocks < s are not run.
    `split` (training, with autograd on): the real rows run without autograd and the pseudo rows attend to
    their keys (`_TransferRows`); False runs every row together, the reference the split is tested against.
    `first_anchor`: pseudo rows only for anchors >= it (`anchor_range`; a loss that counts no earlier target
    need not build them); step i's logits are then those of anchors first_anchor..A_i-1.
    Logits of every row are over the transfer's draft vocabulary when it has one (draft_vocab.py: the
    teacher renormalised on it, as the training loss wants), over the full vocabulary with `full`.
    """
    transfer.check_model(model)
    cfg = model.cfg
    L = cfg.n_layers
    n_steps = transfer.k if n_steps is None else n_steps
    if not 1 <= n_steps <= transfer.k:
        raise ValueError(f"n_steps must be in [1, {transfer.k}], got {n_steps}")
    B, T = tokens.shape
    if all_anchors and T - 1 + n_steps >= cfg.max_seq_len:
        raise ValueError(f"pseudo positions up to {T - 1 + n_steps} exceed the context {cfg.max_seq_len}")
    first = 0
    if start is not None:
        first, x = start
        if model.routers is not None or first > min(transfer.layers[:n_steps]) or x.shape[:2] != (B, T):
            raise ValueError("start: needs a dense base, a block <= t_1 and states [B, T, d] of the tokens")
    else:
        x = model.embed(tokens)
    rows = _TransferRows(model, T, x.device, transfer.masked, split)
    joins = {t: rows.joiner(transfer, steps, all_anchors, first_anchor)
             for t, steps in transfer.steps_at(n_steps).items()}
    capture = None if collect is None else dict.fromkeys(range(first, L + 1))
    x = model.run_blocks(x, rows, start=first, routed=T, joins=joins, capture=capture)
    anchor, step = rows.anchor, rows.step
    if collect is not None:
        collect.update(capture)
        collect["anchor"], collect["step"] = anchor, step
    x = model.norm(x)
    logits = model.output(x) if full else head_logits(transfer, model, x)
    pseudo = [logits[:, step == i] for i in range(1, n_steps + 1)]
    return logits[:, :T], pseudo


def hidden_transfer_loss(model: Transformer, transfer: HiddenTransfer, tokens: torch.Tensor, *,
                         n_steps: int | None = None, only_step: int | None = None,
                         mask: torch.Tensor | None = None, start: tuple[int, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, list[float]]:
    """sum_i KL(p_base(. | j+i) || p_pseudo(i, j)) averaged over anchors j with j + i < T (sec. 3.3).

    `only_step` restricts the sum to one step (the sequential schedule); the per-step KLs are returned
    for every computed step. `mask` [B, T]: real (non-padding) tokens; an anchor counts for step i only if
    its target position j + i is real (right padding: then so is the anchor)."""
    # the first position any sequence counts: an anchor all of whose targets (j + 1 .. j + n) lie before it
    # gets no pseudo rows
    n = transfer.k if n_steps is None else n_steps
    first = 0 if mask is None or not bool(mask.any()) else max(int(mask.any(0).nonzero()[0]) - n, 0)
    real, pseudo = transfer_forward(model, transfer, tokens, n_steps=n_steps, start=start, first_anchor=first)
    T = tokens.shape[1]
    total = real.new_zeros((), dtype=torch.float32)
    per: list[float] = []
    for i, p in enumerate(pseudo, start=1):
        if p.shape[1] == 0:
            per.append(float("nan"))
            continue
        a = anchor_range(T, i, False, first)[0]  # p holds anchors a..T-1-i; their targets are a+i..T-1
        kl = kl_to_base(real[:, a + i:], p, None if mask is None else mask[:, a + i:])
        per.append(float(kl.detach()))
        if only_step is None or only_step == i:
            total = total + kl
    return total, per


def train_hidden_transfer(model: Transformer, transfer: HiddenTransfer, batches: Any, steps: int,
                          lr: float = 1e-3, schedule: str = "joint", *, clip: float = 1.0,
                          log: Callable[[int, float, list[float]], None] | None = None) -> list[dict[str, Any]]:
    """Train the W_i on `batches` (LongTensors [B, T], cycled) for `steps` optimiser steps in total.

    schedule 'joint': all steps on the summed KL. 'sequential' (the paper, sec. 3.3): phase i = 1..k trains
    W_i alone on step i's KL (rows of later steps are not even built: no earlier step can see them), the
    steps split as evenly as possible between phases. Returns one record per optimiser step:
    {'loss', 'per_step', 'phase'} (phase 0 for joint).
    """
    if schedule not in ("joint", "sequential"):
        raise ValueError(f"schedule must be 'joint' or 'sequential', got {schedule!r}")
    transfer.check_model(model)
    dev = model_device(model)
    transfer.to(dev).train()
    stream = batch_stream(batches)
    hist: list[dict[str, Any]] = []
    with FrozenBase(model):
        if schedule == "joint":
            def joint_loss(b: Any) -> tuple[torch.Tensor, list[float]]:
                tokens, mask = split_batch(b, dev)
                return hidden_transfer_loss(model, transfer, tokens, mask=mask)

            hist = optimise(list(transfer.parameters()), joint_loss, stream, steps, lr, clip, log)
            for h in hist:
                h["phase"] = 0
        else:
            k = transfer.k
            flags = [p.requires_grad for p in transfer.parameters()]
            try:
                for i in range(1, k + 1):
                    n = steps // k + (1 if i - 1 < steps % k else 0)
                    for j, m in enumerate(transfer.maps, start=1):
                        m.weight.requires_grad_(j == i)

                    def loss_fn(b: Any, i: int = i) -> tuple[torch.Tensor, list[float]]:
                        tokens, mask = split_batch(b, dev)
                        return hidden_transfer_loss(model, transfer, tokens, n_steps=i, only_step=i, mask=mask)

                    part = optimise([transfer.maps[i - 1].weight], loss_fn, stream, n, lr, clip, log)
                    for h in part:
                        h["phase"] = i
                    hist.extend(part)
            finally:
                for p, f in zip(transfer.parameters(), flags):
                    p.requires_grad_(f)
    transfer.eval()
    return hist


@torch.no_grad()
def draft_top1_accuracy(model: Transformer, transfer: HiddenTransfer, tokens: torch.Tensor) -> list[float]:
    """Per step i: fraction of anchors j whose pseudo argmax equals the base argmax at position j + i (the
    token greedy decoding emits at j + i + 1 given the true prefix; the sec. 4.4 draft-accuracy probe)."""
    with FrozenBase(model):
        real, pseudo = transfer_forward(model, transfer, tokens.to(model_device(model)), full=True)
    out, vocab = [], draft_vocab(transfer)
    for i, p in enumerate(pseudo, start=1):
        guess = to_token_ids(restrict_logits(p, vocab).argmax(-1), vocab)  # candidates: draft-vocabulary tokens
        out.append(float((guess == real[:, i:].argmax(-1)).float().mean()) if p.shape[1] else float("nan"))
    return out


# ============================================================================================ inference
@torch.no_grad()
def pseudo_logits_cached(model: Transformer, transfer: HiddenTransfer, cache: KVCache, anchor_pos: int,
                         anchor_hidden: dict[int, torch.Tensor], n_steps: int, draft_head: bool = False
                         ) -> torch.Tensor:
    """Final-layer pseudo logits [n_steps, V] of the anchor at `anchor_pos` = the last cached position; with
    `draft_head`, [n_steps, V'] over the transfer's draft vocabulary (its rows of the head only, `head_logits`).

    anchor_hidden[t]: the anchor's residual entering block t [d], for every t_i of the first n_steps steps.
    Step i's row is written to scratch slot s0 + i - 1 (s0 = cache.length) from block t_i up, attends
    through `visible` (context rows = (cache.pos, 0), pseudo rows = (anchor_pos, i)), and the cache is
    truncated back to s0 before returning (also on error).
    """
    if cache.batch != 1:
        raise ValueError("hidden-transfer drafting supports batch 1 only")
    s0 = cache.length
    if s0 == 0 or int(cache.pos[0, s0 - 1]) != anchor_pos:
        raise ValueError(f"the anchor (position {anchor_pos}) must be the last cached token")
    dev = cache.pos.device
    q_anchor = torch.full((n_steps,), anchor_pos, dtype=torch.long, device=dev)
    q_step = torch.arange(1, n_steps + 1, device=dev)
    k_anchor = torch.cat([cache.pos[0, :s0], q_anchor])
    k_step = torch.cat([torch.zeros(s0, dtype=torch.long, device=dev), q_step])
    extra = additive_mask(visible(q_anchor, q_step, k_anchor, k_step, transfer.masked))[None, None]  # [1,1,n,s0+n]
    at = {t: (lambda h, t=t, steps=steps:
              torch.cat([transfer.transfer(anchor_hidden[t].reshape(1, 1, -1), i) for i in steps], 1))
          for t, steps in transfer.steps_at(n_steps).items()}
    positions = anchor_pos + torch.arange(1, n_steps + 1, device=dev)[None]
    try:  # no token rows: the n pseudo rows join at their blocks t_i, at scratch slots s0..s0+n-1
        logits, hidden = forward_cached(model, torch.zeros(1, 0, dtype=torch.long, device=dev), cache, positions,
                                        extra_mask=extra, joins=JoinedRows(at, n_steps), return_hidden=True,
                                        head_rows=0 if draft_head else None)
        return head_logits(transfer, model, model.norm(hidden[0])) if draft_head else logits[0]
    finally:
        cache.truncate(s0)


class HiddenTransferDrafter(Drafter):
    """Per-depth top-k candidates from the pseudo states of the last committed anchor (step i -> depth i).

    fused=True (default): the pseudo rows ride along in every verification forward (`verify_tree(fused=)`,
    paper sec. 3.4) for every possible anchor of the tree -- the root and each node -- and the rows of the
    anchor that verification actually stops at are the next draft; only the first round, right after the
    prefill, drafts with a separate partial forward (`pseudo_logits_cached`). fused=False drafts every
    round with that separate forward. Both see the same mask, so they propose the same tokens (tested).

    anchors = m >= 1 (fused only; 0: every tree row): only the root and the m - 1 rows where the accepted path
    most likely ends (`DraftTree.likeliest_ends`, from `acc`, the draft's held-out accuracies, or without them
    the prior `PRIOR_ACC`) carry pseudo rows. A round that ends elsewhere drafts from its deepest anchor's later
    steps (`decode_step.anchor_shifts`): fewer rows a round (3 per anchor for k = 3), a weaker draft after
    such a round. Any draft is verified, so the output is the same. (`--tree auto` chooses m; a continuous
    batch's chains, `HiddenTransferRows`, carry every column's rows.)
    """

    # (a rank's accuracy halving with the rank: the guess behind the anchors when the draft gives none)
    PRIOR_ACC = [[0.5 ** (r + 1) for r in range(8)]] * 8

    def __init__(self, model: Transformer, transfer: HiddenTransfer, topk_per_depth: Sequence[int] | None = None,
                 fused: bool = True, anchors: int = 0, acc: Sequence[Sequence[float]] | None = None) -> None:
        if anchors < 0 or (anchors and not fused):
            raise ValueError(f"anchors must be 0 (every tree row) or a count >= 1 of a fused drafter's, got {anchors}")
        transfer.check_model(model)
        self.model, self.transfer = model, transfer.to(model_device(model)).eval()
        self.topk_per_depth = None if topk_per_depth is None else [int(k) for k in topk_per_depth]
        self.hidden_layers = tuple(sorted(set(transfer.layers)))  # what speculative_generate captures for us
        self.last_logits: torch.Tensor | None = None  # the last round's pseudo logits (for analysis)
        self.fused = bool(fused)
        self.anchors, self.acc = int(anchors), acc
        self._mask_memo: dict[tuple, torch.Tensor] = {}
        self._anchor_memo: dict[tuple, Any] = {}

    def anchor_rows(self, tree: DraftTree) -> tuple[int, ...] | None:
        """The tree rows whose pseudo rows ride a round (`anchors`), or None: every row."""
        if not self.anchors or self.anchors > len(tree):
            return None
        acc = self.acc or self.PRIOR_ACC
        key = (tree, self.anchors, tuple(map(tuple, acc)))
        if key not in self._anchor_memo:  # (asked every round)
            self._anchor_memo[key] = tree.likeliest_ends(acc, self.anchors)
        return self._anchor_memo[key]

    def _shifts(self, tree: DraftTree, anchors: tuple[int, ...]) -> list[tuple[int, int]]:
        key = ("shifts", tree, anchors)
        if key not in self._anchor_memo:
            self._anchor_memo[key] = anchor_shifts(tree.parent.tolist(), tree.depth.tolist(), anchors)
        return self._anchor_memo[key]

    def _per_step(self, tree: DraftTree) -> int:
        """Pseudo rows a step in a round on `tree` (`fused_per_step`, which is None for every tree row's)."""
        return fused_per_step(self, tree) or len(tree) + 1

    @property
    def static_step(self) -> bool:
        """Fused, it drafts for the static decode step too (decode_step.py): its rows ride the step's own
        verification forward. Separate drafting reads the dynamic cache (`pseudo_logits_cached`)."""
        return self.fused

    def device_draft(self, step, tree: DraftTree) -> TopkTreeDraft | None:
        """The fused pass's draft on the device, for the static step's device rounds (speculative/static.py):
        a round's pseudo rows give the next round's logits, which stay on the device. Its first round (no
        draft yet) runs on the host."""
        if not self.fused or not 0 < tree.max_depth <= self.transfer.k:
            return None
        D = tree.max_depth
        return TopkTreeDraft(step, tree, candidate_counts(tree, self.topk_per_depth), draft_vocab(self.transfer),
                             lambda logits: logits, lambda packed, rows, hidden, draft: (draft,),
                             lambda tokens, hidden, dl: (dl,) if dl is not None and dl.shape[0] >= D else None,
                             k_steps=self.transfer.k, masked=self.transfer.masked, anchors=self.anchor_rows(tree))

    def draft_steps(self) -> int:
        return self.transfer.k

    def verify_forward(self, tree: DraftTree, n_layers: int) -> Forward:
        """Fused: the pseudo rows of every anchor ride the blocks, each from the block it joins at."""
        N = len(tree) + 1
        if not self.fused:
            return ([N] * n_layers, N)
        layers, k, A = self.transfer.layers, self.transfer.k, self._per_step(tree)
        return ([N + A * sum(1 for t in layers[:k] if t <= b) for b in range(n_layers)], N)

    def draft_forwards(self, tree: DraftTree, n_layers: int) -> list[Forward]:
        """Fused: the LM head reads the k rows of the accepted anchor on the draft vocabulary (`fused_draft`).
        Separate: a partial forward over the pseudo rows of the tree's depth, each from its block."""
        share = head_share(self.transfer, self.model.cfg.vocab_size)
        if self.fused:
            return [([0] * n_layers, self.transfer.k, share)]
        layers, k = self.transfer.layers, tree.max_depth
        return [([sum(1 for t in layers[:k] if t <= b) for b in range(n_layers)], k, share)]

    # ------------------------------------------------------------------------------ fused pass
    def extra_slots(self, tree: DraftTree) -> int:
        return self._per_step(tree) * self.transfer.k

    def fused_rows(self, tree: DraftTree, last_pos: int, start: int
                   ) -> tuple[JoinedRows, torch.Tensor, torch.Tensor] | None:
        """JoinedRows (W_i of every anchor at block t_i), their positions and the tree+pseudo mask."""
        N, k = len(tree) + 1, self.transfer.k
        # Pseudo positions reach last_pos + depth + k: stay inside the RoPE table / context.
        k = min(k, self.model.cfg.max_seq_len - 1 - last_pos - tree.max_depth)
        if k < 1:
            return None
        anchors = self.anchor_rows(tree)
        rows = torch.arange(N) if anchors is None else torch.tensor(anchors)
        depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])[rows]  # root at depth 0
        positions = torch.cat([last_pos + depth + i for i in range(1, k + 1)])  # step-major, like the rows
        block = self._mask_memo.get((tree, k, anchors))  # the tree + pseudo block depends on the tree only
        if block is None:
            anc = torch.ones(N, N, dtype=torch.bool)
            anc[0, 1:] = False
            anc[1:, 1:] = tree.ancestor_mask
            block = self._mask_memo[(tree, k, anchors)] = additive_mask(
                tree_visible(anc, k, self.transfer.masked, None if anchors is None else rows))
        extra = torch.cat([block.new_zeros(block.shape[0], start), block], 1)[None, None]  # + every context key
        # The tree rows are the first N rows present at every block.
        pick = (lambda h: h[:, :N]) if anchors is None else (lambda h: h.index_select(1, rows.to(h.device)))
        at = {t: (lambda h, steps=steps: torch.cat([self.transfer.transfer(pick(h), i) for i in steps], 1))
              for t, steps in self.transfer.steps_at(k).items()}
        return JoinedRows(at, rows.numel() * k), positions, extra.to(model_device(self.model))

    def fused_draft(self, join_hidden: torch.Tensor, tree: DraftTree, anchor_row: int) -> torch.Tensor:
        """The pseudo rows the round's last accepted row `anchor_row` drafts from (its own steps 1..k, or its
        anchor's, `anchor_shifts`) of the joined rows' final residuals [A*k, d] -> their logits [k, V'] (V': the
        draft vocabulary's tokens, or all). Only these k rows are decoded: the LM head over all A*k pseudo rows
        was most of the fused pass's cost beyond verification (docs/results/hidden-transfer-cpu.md, 28th
        session)."""
        anchors = self.anchor_rows(tree)
        A = len(tree) + 1 if anchors is None else len(anchors)
        joined = join_hidden.reshape(-1, A, join_hidden.shape[-1])  # [k, A, d]
        k = joined.shape[0]
        j, delta = (anchor_row, 0) if anchors is None else self._shifts(tree, anchors)[anchor_row]
        rows = joined[[min(i + delta, k) - 1 for i in range(1, k + 1)], j]
        return head_logits(self.transfer, self.model, self.model.norm(rows))

    def pseudo_logits(self, ctx: DraftContext, n_steps: int | None = None) -> torch.Tensor:
        n = self.transfer.k if n_steps is None else n_steps
        anchor = {t: ctx.layer_hidden[t][-1] for t in set(self.transfer.layers[:n])}
        return pseudo_logits_cached(self.model, self.transfer, ctx.cache, len(ctx.tokens) - 2, anchor, n,
                                    draft_head=True)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> list[list[int]]:
        tree = ctx.tree
        if tree.max_depth > self.transfer.k:
            raise ValueError(f"the tree has depth {tree.max_depth} but hidden transfer drafts {self.transfer.k} steps")
        need = candidate_counts(tree, self.topk_per_depth)
        if tree.max_depth == 0:
            return []
        if ctx.draft_logits is not None and ctx.draft_logits.shape[0] >= tree.max_depth:
            logits = ctx.draft_logits[:tree.max_depth]  # drafted by the last verification forward
        elif ctx.hidden.shape[0] == 0:  # 1-token prompt, first round: no cached anchor yet
            return placeholder_candidates(need, self.model.cfg.vocab_size)
        else:
            logits = self.pseudo_logits(ctx, tree.max_depth)  # only the steps this (possibly pruned) tree uses
        self.last_logits = logits
        return topk_lists(logits, need, draft_vocab(self.transfer))


class HiddenTransferRows:
    """Hidden transfer inside a continuous batch (engine/batch.py, its `FusedDrafter`): the fused pass of
    sec. 3.4 with a chain per batch row. Each step's forward feeds row b its columns [pending token, draft
    tokens] (right-aligned: columns before off_b are padding); from block t_i up it also carries the step-i
    pseudo rows W_i h of every column (column-major within a step: joined row (i - 1) M + c is column c's step
    i), at scratch slots past every real one. Whichever column turns out to be the row's anchor (its last
    accepted token), its k pseudo rows are the row's next chain (`chains`), so no forward is spent on drafting.

    The mask is `tree_visible` on the row's chain: column c's ancestors are the real columns off_b..c, and a
    padding column is its own only ancestor (its pseudo rows see themselves: nothing reads them, but each
    query keeps a visible key). The cache's own rule shows every pseudo row the row's committed keys. So a
    pseudo row sees what the one-sequence drafter's fused rows see, in the same slot order, and in q4
    (row-invariant kernels) its chain is bit for bit the top-1 chain of `HiddenTransferDrafter` on the same
    context (tests/test_batch.py). A row's first step after its prefill has no chain yet: its pseudo rows are
    carried, its draft is empty (the one-sequence drafter spends a separate partial forward there instead)."""

    def __init__(self, drafter: HiddenTransferDrafter) -> None:
        self.d = drafter
        self.k = drafter.transfer.k
        L = drafter.model.cfg.n_layers
        # a column's pseudo rows, in rows of a full forward: step i's row runs blocks t_i..L-1 (the step cost line)
        self.rows_per_column = sum((L - t) / L for t in drafter.transfer.layers)
        self._memo: dict[tuple[int, int], torch.Tensor] = {}

    def joins(self, M: int) -> JoinedRows:
        """Step i's rows: W_i of the M token columns (the first M rows present at block t_i)."""
        t = self.d.transfer
        return JoinedRows({b: (lambda h, steps=steps: torch.cat([t.transfer(h[:, :M], i) for i in steps], 1))
                           for b, steps in t.steps_at(self.k).items()}, M * self.k)

    def visible(self, off: int, M: int) -> torch.Tensor:
        """bool [M (1 + k), M (1 + k)] over the forward's own rows of a batch row whose real columns are off..M-1."""
        vis = self._memo.get((off, M))
        if vis is None:
            anc = torch.eye(M, dtype=torch.bool)
            anc[off:, off:] = torch.ones(M - off, M - off, dtype=torch.bool).tril()
            vis = self._memo[(off, M)] = tree_visible(anc, self.k, self.d.transfer.masked)
        return vis

    @torch.no_grad()
    def chains(self, pseudo: torch.Tensor, columns: list[int]) -> list[list[int]]:
        """pseudo [n, M k, d]: the joined rows' final residuals; columns[b]: row b's anchor column. The top-1
        token of each anchor's k pseudo rows on the draft vocabulary (`fused_draft`'s rows, `topk_lists`)."""
        n, M = len(columns), pseudo.shape[1] // self.k
        rows = pseudo.view(n, self.k, M, -1)[torch.arange(n), :, torch.tensor(columns)]  # [n, k, d]
        logits = head_logits(self.d.transfer, self.d.model, self.d.model.norm(rows))
        vocab = draft_vocab(self.d.transfer)
        return [[c[0] for c in topk_lists(logits[b], [1] * self.k, vocab)] for b in range(n)]


__all__ = ["HiddenTransfer", "HiddenTransferDrafter", "HiddenTransferRows", "visible", "tree_visible",
           "training_rows", "training_mask", "transfer_forward", "hidden_transfer_loss", "train_hidden_transfer",
           "pseudo_logits_cached", "draft_top1_accuracy"]
