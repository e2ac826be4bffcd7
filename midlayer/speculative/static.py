"""Speculative decoding on the static decode step (engine/decode_step.py): one captured round per bucket, the
greedy acceptance and the cache compaction on the device, one host read per round (issue 42).

The dynamic loop (`verify.speculative_generate`) stays the reference: for drafters that declare `static_step`
this loop's output equals it, and plain greedy decoding, token for token (tests/test_decode_step.py).

Device rounds. A drafter that can draft on the device (its `device_draft`: EAGLE-2's dynamic tree, Medusa's
heads, hidden transfer's fused pass, and the self-speculative drafters, early exit and layer skip, through the
step's own blocks: `LevelTreeDraft`) runs each round as ONE capturable function (`DeviceRounds.round`): its
draft from what the last round left on the device (EAGLE-2: the draft layer over the newly committed rows,
the tree's expansion and reranking; Medusa: its heads on the last accepted row; hidden transfer: the pseudo
rows' logits of the last round), the node tokens and the tree's layout as index tensors, the verification
forward, the acceptance and the compaction, and what the next round drafts from. The host reads one tensor
per round, [accepted count, path tokens, bonus], and nothing else: no draft crosses to the host and back, so
on a GPU the whole round is one graph replay (issue 42: the drafting between captured verifications cost
host time every round). The per-round loop (`propose` on the host) stays the reference: both draft the same
trees (tests/test_decode_step.py). The self-speculative drafters' `propose` runs the model on the dynamic
cache (`reads_cache`), so on the static step they draft in device rounds only, and their reference is the
dynamic loop: the same trees round by round.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from midlayer.engine.decode_step import (any_round_slots, BUCKET_CANDIDATES, DecodeStep, round_slots, step_for,
                                        TreeTensors)
from midlayer.engine.draft_vocab import restrict_logits, to_token_ids, vocab_topk
from midlayer.engine.generate import check_max_new_tokens, validate_prompts
from midlayer.model.transformer import Transformer
from .protocol import DraftContext, Drafter
from .tree import DraftTree
from .verify import draft_node_tokens, round_tree, SpecStats


def dynamic_candidates(k: int, depth: int) -> int:
    """The candidates a dynamic tree of width k proposes to `depth` (EAGLE-2 sec. 4): k at depth 1, then k
    children for each of the k best nodes of every depth above."""
    return k + (depth - 1) * k * k


def round_nodes(drafter: Drafter, tree: DraftTree) -> int:
    """The nodes a round verifies: the tree's, or for a drafter that expands a dynamic tree (EAGLE-2, width k =
    `dynamic_k`) the best min(|tree|, its candidates) of them. What sizes the step (a dynamic:256 step was sized
    as if no round could run and the round then wrote past the cache)."""
    k = drafter.dynamic_k or 0
    return min(len(tree), dynamic_candidates(k, tree.max_depth)) if k else len(tree)


def fused_steps(drafter: Drafter) -> int:
    """How many blocks of pseudo rows a drafter's rounds carry: hidden transfer's k when it drafts in the fused
    pass (its `fused` and `transfer`), else 0. What sizes a round (`round_slots`) for the loop and benchmarks."""
    return drafter.draft_steps() if drafter.fused else 0


def fused_per_step(drafter: Drafter, tree: DraftTree) -> int | None:
    """The pseudo rows a step of a round of `drafter` on `tree` carries: its anchors' count, or None for every
    tree row's (or no pseudo rows). With `fused_steps`, what sizes the round (`round_slots`)."""
    rows = drafter.anchor_rows(tree) if fused_steps(drafter) else None
    return None if rows is None else len(rows)


@torch.no_grad()
def static_speculative_generate(model: Transformer, prompt_ids: Sequence[int], drafter: Drafter, tree,
                                max_new_tokens: int, stop_tokens: Sequence[int] = (), *,
                                step: DecodeStep | None = None, device_rounds: bool = True, **step_kw):
    """`speculative.speculative_generate` at temperature 0 through the static step: every round is one
    bucketed forward over [root, nodes] with acceptance and compaction on the device and one host read.
    Where the step is row-invariant (`DecodeStep.row_invariant`: the CPU buckets in fp32, q4 anywhere) the
    output equals `static_generate`'s token for token. Drafters that declare `static_step` (they never read
    ctx.cache: Medusa, EAGLE / EAGLE-2, and hidden transfer's fused pass; early exit and layer skip, which
    draft here in device rounds only) draft here; the others are refused by name. Hidden transfer (a drafter
    with `fused` and `transfer`) rides every round: its pseudo rows join the verification forward
    (`DecodeStep.attach`) and the accepted anchor's rows are the next draft; its first round, with no draft
    yet, verifies the root alone. `device_rounds`: a drafter with a `device_draft` drafts on the device, each
    round one capturable call (module docstring), once it has what to draft from (a 1-token prompt's first
    round, and hidden transfer's, run here); False: every round drafts on the host (the reference; refused
    for a drafter that `reads_cache`). Returns (new tokens, speculative.SpecStats)."""
    name = type(drafter).__name__
    if not drafter.static_step:
        raise ValueError(f"{name} reads the dynamic KV cache (or rides a fused pass) and does not "
                         "draft for the static step yet: use speculative.speculative_generate")
    if drafter.reads_cache and not device_rounds:
        raise ValueError(f"{name} drafts on the static step in device rounds only (its propose runs the model on "
                         "the dynamic KV cache): device_rounds=True, or speculative.speculative_generate")
    prompt = validate_prompts(model, [list(prompt_ids)])[0]
    model.eval()
    P = len(prompt)
    stats = SpecStats(accept_hist=[0] * (tree.max_depth + 1))
    budget = min(check_max_new_tokens(max_new_tokens), model.cfg.max_seq_len - P + 1)
    if budget <= 0:
        return [], stats
    k = fused_steps(drafter)
    fused = k > 0
    if step is None:  # sized to the call: the committed text, then the largest round of any bucket set
        sets = [step_kw["buckets"]] if step_kw.get("buckets", "auto") != "auto" else BUCKET_CANDIDATES
        room = any_round_slots(round_nodes(drafter, tree), k, sets, fused_per_step(drafter, tree))
        st = DecodeStep(model, max_len=P + budget + room, **step_kw)
    else:
        room = round_slots(round_nodes(drafter, tree), k, step.buckets, fused_per_step(drafter, tree))
        st = step_for(model, P + budget + room, step)
    stats.row_invariant = st.invariant
    if fused:
        st.attach(drafter)
    else:
        st.detach()
    masked = bool(fused and drafter.transfer.masked)
    dev = st.device
    if P > 1:
        logits, hidden = st.prefill(torch.tensor([prompt[:-1]], device=dev))
        every = drafter.prefill_features
        logits, hidden = logits[0, -1:], (hidden[0] if every else hidden[0, -1:])
        stats.prefill_forwards = 1
    else:
        dtype = model.tok_embeddings.weight.dtype
        hidden = torch.zeros(0, model.cfg.dim, device=dev, dtype=dtype)
        logits = torch.zeros(0, model.cfg.vocab_size, device=dev, dtype=dtype)
    tokens, new = list(prompt), []
    draft_logits = None
    rounds = DeviceRounds.for_step(st, drafter, tree) if device_rounds else None
    if rounds is None and drafter.reads_cache:
        raise ValueError(f"{name} drafts with another model than the static step runs (its device_draft gave none): "
                         "use speculative.speculative_generate")
    while len(new) < budget:
        carry = None if rounds is None else rounds.draft.first(tokens, hidden, draft_logits)
        if carry is not None:  # every later round on the device (the context's last tokens plainly)
            rounds.run(tokens, new, stats, budget, stop_tokens, carry)
            break
        # the first round of a fused drafter has no draft yet: the root alone (its pseudo rows draft the next)
        t = tree.prune(0 if fused and draft_logits is None else min(budget - len(new) - 1, tree.max_depth), len(tree))
        draft = drafter.propose(DraftContext(model, None, tokens, hidden, logits, {}, t, 0.0, None, draft_logits))
        t = round_tree(draft, t)  # (the step lays pseudo rows out for whichever tree it verifies)
        nodes, _ = draft_node_tokens(draft, t)
        # pseudo positions reach the root's + depth + k: inside the context, or no pseudo rows this round
        steps = k if len(tokens) - 1 + t.max_depth + k < model.cfg.max_seq_len else 0
        tt = st.tree_tensors(t.parent.tolist(), t.depth.tolist(), steps, masked,
                             drafter.anchor_rows(t) if fused else None)
        accepted, bonus, _, logits, hidden, draft_logits = st.verify(tokens[-1], nodes.tolist(), tt, len(tokens) - 1,
                                                                     len(tokens) - 1)
        tokens += accepted + [bonus]
        if stats.commit(accepted + [bonus], new, stop_tokens, budget):
            break
    return new, stats


# ======================================================================================= device rounds
class DeviceDraft(Protocol):
    """What a drafter gives `DeviceRounds` (its `device_draft(step, tree)`): a draft made on the device.

    `tree_rows`, `head_rows`: the round's layout (`round_layout`); `pseudo`: its hidden-transfer rows
    (`TreeTensors.pseudo`; (0, 0): none); `reach`: how far past the root a round's positions go (its depth,
    plus hidden transfer's pseudo steps). `first(tokens, hidden, draft_logits)`
    (eager, once): what the first device round drafts from, given the host loop's state after the prefill or
    a round (hidden: the final residuals of the rows committed last, draft_logits: hidden transfer's), or
    None when that is not enough yet (the host loop runs one more round). `draft(root, last_pos, *carry)`
    (captured): (node tokens [n], the round's TreeTensors fields from vis to prow). `after(packed, rows,
    hidden, draft, last_pos)` (captured): the next round's carry, from `DecodeStep.verify_round`'s outputs."""

    tree_rows: int
    head_rows: int
    pseudo: tuple[int, int]
    reach: int

    def first(self, tokens: list[int], hidden: torch.Tensor, draft_logits: torch.Tensor | None
              ) -> tuple[torch.Tensor, ...] | None: ...

    def draft(self, root: torch.Tensor, last_pos: torch.Tensor, *carry: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...

    def after(self, packed: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, draft: torch.Tensor,
              last_pos: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


def round_kinds(step: DecodeStep, drafter: Drafter, tree: DraftTree) -> tuple[bool, ...]:
    """The rounds a benchmark or check runs a drafter in, as `device_rounds` values: on the device and, beside
    them, drafted on the host (the reference) where it drafts on the device and `propose` can draft for the
    step; else on the host alone."""
    if drafter.reads_cache:  # (device rounds only: where it cannot, the loop says why)
        return (True,)
    return (False,) if DeviceRounds.for_step(step, drafter, tree) is None else (True, False)


def tree_fields(t: TreeTensors) -> tuple[torch.Tensor, ...]:
    """The fields of a tree layout that `DecodeStep.verify_round` reads, in its argument order."""
    return (t.vis, t.parent, t.depth, t.real, t.is_node, t.path, t.join_src, t.join_step, t.prow)


class TopkTreeDraft:
    """A fixed tree filled from per-depth logits on the device (Medusa's heads, hidden transfer's pseudo
    rows): node (r_1..r_d) takes the rank-r_d candidate of depth d (`tree.candidates_from_topk`), the top-k
    of `drafting.topk_lists` gathered by index tensors. `logits_of(*carry)` gives the [depth, V'] logits,
    `carry_after(packed, rows, hidden, draft)` the next carry; `start(tokens, hidden, draft_logits)` the
    first carry or None. `need`: the candidates per depth the host path takes (the same top-k call). k_steps,
    masked, anchors: hidden transfer's pseudo rows (`DecodeStep.tree_tensors`)."""

    def __init__(self, step: DecodeStep, tree: DraftTree, need: Sequence[int], vocab: torch.Tensor | None,
                 logits_of, carry_after, start, k_steps: int = 0, masked: bool = False,
                 anchors: Sequence[int] | None = None) -> None:
        self.layout = step.tree_tensors(tree.parent.tolist(), tree.depth.tolist(), k_steps, masked, anchors)
        self.fields = tree_fields(self.layout)
        self.tree_rows, self.head_rows, self.pseudo = self.layout.tree_rows, self.layout.head_rows, self.layout.pseudo
        self.reach = self.layout.reach
        self.D, self.kmax, self.vocab = tree.max_depth, max(need), vocab
        dev = step.device
        self.depth_ix = (tree.depth - 1).to(dev)
        self.rank_ix = torch.tensor([p[-1] for p in tree.paths], dtype=torch.long, device=dev)
        self.logits_of, self.carry_after, self.start = logits_of, carry_after, start

    def first(self, tokens: list[int], hidden: torch.Tensor, draft_logits: torch.Tensor | None):
        return self.start(tokens, hidden, draft_logits)

    def draft(self, root: torch.Tensor, last_pos: torch.Tensor, *carry: torch.Tensor):
        logits = self.logits_of(*carry)[:self.D]
        if self.vocab is not None and logits.shape[-1] != self.vocab.numel():
            logits = restrict_logits(logits, self.vocab)
        ids = to_token_ids(vocab_topk(logits, self.kmax)[1], self.vocab)  # [D, kmax]
        return ids[self.depth_ix, self.rank_ix], self.fields

    def after(self, packed, rows, hidden, draft, last_pos):
        return self.carry_after(packed, rows, hidden, draft)


class LevelTreeDraft:
    """A fixed tree filled level by level through the step's own blocks: the self-speculative drafters (early
    exit: the blocks below its exit layer and its exit head; layer skip: the blocks outside its span and the
    base's head), as `drafting.draft_tree_autoregressive` fills the tree over the dynamic cache. Level d (the
    root for d = 0; the leaves never run) is one partial forward (`DecodeStep.blocks`, `stop` and `run` its
    blocks) in the smallest bucket that holds it. Its rows sit at the slots the verification of the round then
    overwrites (the root's slot + its row), at position root + d, and see the committed text (the base's own
    K/V, as the dynamic drafter reads the base's cache) and their ancestors-or-self, whose K/V the levels
    before wrote. The rank-r child of a node takes the r-th most likely token of its draft distribution. A
    round needs only its root, so every round drafts here, the first one included (`first` gives no carry)."""

    def __init__(self, step: DecodeStep, tree: DraftTree, stop: int, run, head, vocab: torch.Tensor | None) -> None:
        self.layout = step.tree_tensors(tree.parent.tolist(), tree.depth.tolist())
        self.fields = tree_fields(self.layout)
        self.tree_rows, self.head_rows, self.reach = self.layout.tree_rows, self.layout.head_rows, self.layout.reach
        self.pseudo = self.layout.pseudo
        self.step, self.stop, self.run, self.head, self.vocab = step, stop, run, head, vocab
        D, dev = tree.max_depth, step.device
        path = self.layout.path.cpu()
        levels = tree.levels()
        self.levels = []
        for d, (a, b, parent, rank) in enumerate(levels):  # level d runs; its draft fills depth d + 1
            rows = [0] if d == 0 else list(range(levels[d - 1][0] + 1, levels[d - 1][1] + 1))  # (root: row 0)
            N, m = step.bucket_for(len(rows)), len(rows)
            row_ix = torch.tensor(rows + [0] * (N - m))
            keys = torch.full((N, D + 1), -1, dtype=torch.long)  # a row's keys: its ancestors-or-self by depth
            keys[:m] = path[rows, :D + 1]
            real = torch.arange(N) < m
            self.levels.append(tuple(x.to(dev) for x in (
                row_ix, keys, real, torch.where(real, d, 0), torch.arange(a, b) + 1, torch.tensor(parent),
                torch.tensor(rank))) + (d, m, max(rank) + 1))

    def first(self, tokens: list[int], hidden: torch.Tensor, draft_logits: torch.Tensor | None):
        return ()

    def draft(self, root: torch.Tensor, last_pos: torch.Tensor, *carry: torch.Tensor):
        st = self.step
        toks = torch.cat([root.view(1), st.pad_zeros[0, :self.layout.n_nodes]])  # the root, then the nodes so far
        for row_ix, keys, real, depth, kid_rows, kid_src, kid_rank, d, m, k in self.levels:
            slots = torch.where(real, last_pos + row_ix, st.scratch_at)[None]
            positions = torch.where(real, last_pos + d, st.zero)[None]
            h = st.blocks(toks.index_select(0, row_ix)[None], positions, slots, last_pos,
                          torch.where(keys >= 0, last_pos + keys, st.none)[None], depth, real, stop=self.stop,
                          run=self.run)
            logits = self.head(h[0, :m])
            if self.vocab is not None and logits.shape[-1] != self.vocab.numel():
                logits = restrict_logits(logits, self.vocab)
            top = to_token_ids(vocab_topk(logits, k)[1], self.vocab)  # [m, k]
            toks = toks.index_copy(0, kid_rows, top[kid_src, kid_rank])
        return toks[1:], self.fields

    def after(self, packed, rows, hidden, draft, last_pos):
        return ()


def last_accepted(packed: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The final residual [d] of a round's last accepted row (the root when none was), on the device."""
    return hidden[0].index_select(0, rows.gather(0, packed[:1]))[0]


class DeviceRounds:
    """Speculative rounds made whole on the device (module docstring): `round` is the one capturable call
    (`DecodeStep.capture`: eager, a CUDA graph, or torch.compile), `run` the host loop that reads one tensor
    a round. Built once per step, drafter and tree (`for_step`), so a captured round is replayed across
    prompts."""

    def __init__(self, step: DecodeStep, draft: DeviceDraft) -> None:
        if draft.reach >= step.window:  # (as `DecodeStep.verify` refuses a host round: `attend`'s window)
            raise ValueError(f"a round's rows reach {draft.reach} positions past its root; the step's attention "
                             f"window holds {step.window - 1}: give a shallower tree")
        self.step, self.draft = step, draft
        self.runner = step.capture(self.round)

    @classmethod
    def for_step(cls, step: DecodeStep, drafter: Drafter, tree: DraftTree) -> "DeviceRounds | None":
        """The rounds of `drafter` on `tree` for this step (memoised on the step), or None where the drafter
        cannot draft on the device."""
        make = getattr(drafter, "device_draft", None)
        if make is None:
            return None
        memo = step.device_rounds
        # (an EAGLE drafter's width, hidden transfer's anchors may be set between calls)
        key = (id(drafter), tree.paths, drafter.dynamic_k, drafter.anchors)
        hit = memo.get(key)
        if hit is None or hit[0] is not drafter:
            draft = make(step, tree)
            hit = memo[key] = (drafter, None if draft is None else cls(step, draft))
        return hit[1]

    def round(self, root: torch.Tensor, last_pos: torch.Tensor, *carry: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One round, no host read: the draft, then `verify_round` over [root, nodes, padding] at slots
        last_pos.. (slot p holds position p). Returns (packed [accepted count a, path tokens, bonus], the next
        root (the bonus), its position, the next carry...)."""
        with self.step.kernels():  # (the draft's own norms and FFNs through the step's kernels too)
            return self._round(root, last_pos, *carry)

    def _round(self, root: torch.Tensor, last_pos: torch.Tensor, *carry: torch.Tensor) -> tuple[torch.Tensor, ...]:
        st, dd = self.step, self.draft
        nodes, fields = dd.draft(root, last_pos, *carry)
        vis, _, depth, real = fields[:4]
        N = vis.shape[0]
        # (the step's constants, not tensors made here: a captured round would replay each as a kernel)
        tokens = torch.cat([root.view(1), nodes, st.pad_zeros[0, :N - 1 - nodes.shape[0]]])[None]
        positions = torch.where(real, last_pos + depth, st.zero)[None]
        slots = torch.where(real, last_pos + st.row_ids[:N], st.scratch_at)[None]
        packed, rows, _, hidden, draft = st.verify_round(tokens, positions, slots, last_pos, *fields,
                                                         tree_rows=dd.tree_rows, head_rows=dd.head_rows,
                                                         pseudo=dd.pseudo)
        nxt = last_pos + packed[0]
        return (packed, packed[-1], nxt + 1, *dd.after(packed, rows, hidden, draft, last_pos))

    def run(self, tokens: list[int], new: list[int], stats: SpecStats, budget: int, stop: Sequence[int],
            carry: tuple[torch.Tensor, ...]) -> None:
        """Rounds until the budget, a stop token, or the context's end; the last tokens that no round fits
        are decoded plainly through the same step (plain decoding's bits: the step is row-invariant where the
        probe passed). Appends to `tokens` and `new` and counts in `stats`."""
        st = self.step
        ctx, reach = st.model.cfg.max_seq_len, self.draft.reach

        def fits(n_tokens: int, n_new: int) -> bool:  # a round from a text of n_tokens stays inside the context
            return n_new < budget and n_tokens - 1 + reach < ctx

        def launch(state: tuple) -> tuple:  # (packed, the next state), cloned: a captured round's are overwritten
            out = self.runner(*state)
            return out[0].clone(), tuple(t.clone() for t in out[1:])

        state = (st._scalar(tokens[-1]), st._scalar(len(tokens) - 1), *carry)
        queued = None
        while fits(len(tokens), len(new)):
            packed, state = queued or launch(state)
            # run-ahead (`DecodeStep.run_ahead`): queue the next round before this one's read, where it fits
            # even if this round commits the most a round can (reach + 1 tokens); it is undone if this round ends
            most = reach + 1
            queued = launch(state) if st.run_ahead and fits(len(tokens) + most, len(new) + most) else None
            host = packed.tolist()  # the one read of the round
            got = host[1:1 + host[0]] + [host[-1]]
            tokens += got
            if stats.commit(got, new, stop, budget):
                if queued is not None:  # its root's slot on: what it committed
                    st.held[0, len(tokens) - 1:] = False
                return
        while len(new) < budget:
            logits = st.decode(torch.tensor([tokens[-1]], device=st.device), len(tokens) - 1)[0]
            t = int(logits.argmax(-1)[0])
            tokens.append(t)
            if stats.commit([t], new, stop, budget):
                return
