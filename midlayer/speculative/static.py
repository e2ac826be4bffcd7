"""Speculative decoding on the static decode step (engine/decode_step.py): one captured round per bucket, the
greedy acceptance and the cache compaction on the device, one host read per round (issue 42).

The dynamic loop (`verify.speculative_generate`) stays the reference: for drafters that declare `static_step`
this loop's output equals it, and plain greedy decoding, token for token (tests/test_decode_step.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from midlayer.engine.decode_step import any_round_slots, BUCKET_CANDIDATES, DecodeStep, round_slots, step_for
from midlayer.engine.generate import validate_prompts
from midlayer.model.transformer import Transformer
from .protocol import DraftContext, Drafter
from .verify import draft_node_tokens, round_tree, SpecStats


def fused_steps(drafter: Drafter) -> int:
    """How many blocks of pseudo rows a drafter's rounds carry: hidden transfer's k when it drafts in the fused
    pass (its `fused` and `transfer`), else 0. What sizes a round (`round_slots`) for the loop and benchmarks."""
    return drafter.draft_steps() if drafter.fused else 0


@torch.no_grad()
def static_speculative_generate(model: Transformer, prompt_ids: Sequence[int], drafter: Drafter, tree,
                                max_new_tokens: int, stop_tokens: Sequence[int] = (), *,
                                step: DecodeStep | None = None, **step_kw):
    """`speculative.speculative_generate` at temperature 0 through the static step: every round is one
    bucketed forward over [root, nodes] with acceptance and compaction on the device and one host read.
    Where the step is row-invariant (`DecodeStep.row_invariant`: the CPU buckets in fp32, q4 anywhere) the
    output equals `static_generate`'s token for token. Drafters that declare `static_step` (they never read
    ctx.cache: Medusa, EAGLE / EAGLE-2, and hidden transfer's fused pass) draft here; the others are refused
    by name. Hidden transfer (a drafter with `fused` and `transfer`) rides every round: its pseudo rows join
    the verification forward (`DecodeStep.attach`) and the accepted anchor's rows are the next draft; its
    first round, with no draft yet, verifies the root alone. Returns (new tokens, speculative.SpecStats)."""
    if not drafter.static_step:
        raise ValueError(f"{type(drafter).__name__} reads the dynamic KV cache (or rides a fused pass) and does not "
                         "draft for the static step yet: use speculative.speculative_generate")
    prompt = validate_prompts(model, [list(prompt_ids)])[0]
    model.eval()
    P = len(prompt)
    stats = SpecStats(accept_hist=[0] * (tree.max_depth + 1))
    budget = min(max_new_tokens, model.cfg.max_seq_len - P + 1)
    if budget <= 0:
        return [], stats
    k = fused_steps(drafter)
    fused = k > 0
    if step is None:  # sized to the call: the committed text, then the largest round of any bucket set
        sets = [step_kw["buckets"]] if step_kw.get("buckets", "auto") != "auto" else BUCKET_CANDIDATES
        st = DecodeStep(model, max_len=P + budget + any_round_slots(len(tree), k, sets), **step_kw)
    else:
        st = step_for(model, P + budget + round_slots(len(tree), k, step.buckets), step)
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
    while len(new) < budget:
        # the first round of a fused drafter has no draft yet: the root alone (its pseudo rows draft the next)
        t = tree.prune(0 if fused and draft_logits is None else min(budget - len(new) - 1, tree.max_depth), len(tree))
        draft = drafter.propose(DraftContext(model, None, tokens, hidden, logits, {}, t, 0.0, None, draft_logits))
        t = round_tree(draft, t)  # (the step lays pseudo rows out for whichever tree it verifies)
        nodes, _ = draft_node_tokens(draft, t)
        # pseudo positions reach the root's + depth + k: inside the context, or no pseudo rows this round
        steps = k if len(tokens) - 1 + t.max_depth + k < model.cfg.max_seq_len else 0
        tt = st.tree_tensors(t.parent.tolist(), t.depth.tolist(), steps, masked)
        accepted, bonus, _, logits, hidden, draft_logits = st.verify(tokens[-1], nodes.tolist(), tt, len(tokens) - 1,
                                                                     len(tokens) - 1)
        tokens += accepted + [bonus]
        if stats.commit(accepted + [bonus], new, stop_tokens, budget):
            break
    return new, stats
