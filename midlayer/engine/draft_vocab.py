"""The draft vocabulary: drafters score only the N tokens the base model most often emits.

Why. A drafter's output layer is the base's LM head, V x d (SmolLM2: 49,152 x 576, 28M weights, a fifth of
the model). In training, every drafted row pays a V-wide matmul, softmax and KL, forward and backward:
on a 2-core CPU that was most of a Medusa or EAGLE step (docs/results/hidden-transfer-cpu.md). At decode,
each EAGLE / early-exit level and each Medusa round reads the whole head again. Yet the responses the
drafts are trained to guess use few tokens: SmolLM2-135M's greedy answers to our scaled prompt set (the
2.31M training response tokens of data/distill/smollm2-135m-q4-greedy.jsonl) use 20,938 distinct tokens;
the most frequent 16,384 of them cover 99.3% of the held-out response tokens, 8,192 cover 97.4%, 4,096
93.4% (docs/results/hidden-transfer-cpu.md has the command). FR-Spec (Zhao et al. 2025, arXiv 2502.14856) and EAGLE-3 (Li et al. 2025, arXiv
2503.01840, its 32k-of-128k "draft vocabulary") restrict the draft head to such a frequency-ranked subset.

What. `frequent_tokens(responses, n)` picks the n most frequent response tokens of the TRAINING split
(ties by token id, so the set is a pure function of the data), sorted by id. A draft module carries it as
the buffer `vocab` (saved with its weights; none or empty = the full vocabulary). Then

    draft logits   z = LMHead[vocab] x                               (|vocab| rows of the frozen head)
    teacher        p = softmax(LMHead[vocab] norm(h))                (the base's distribution renormalised
                                                                      on the subset: `restrict_logits`)
    loss           KL(p || softmax(z)) over the subset,

and a candidate of rank r is vocab[r-th largest z]: a draft can only propose subset tokens. Lossless
decoding does not depend on it (verification runs the full base model); acceptance loses at most the
share of base tokens outside the subset. Held-out accuracies (`draft_training.heldout_metrics`) compare
the mapped candidates with the base's argmax over the FULL vocabulary, so they include that loss.

Hidden transfer decodes its pseudo rows inside the base's own forward (full head); its candidates are
the top of those logits restricted to the subset (`restrict_logits`), the same rule as in its training.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from midlayer.engine.quantization import BlockQuantLinear


def frequent_tokens(responses: Iterable[Sequence[int]], n: int, vocab_size: int) -> torch.Tensor:
    """The n most frequent tokens of `responses` (ties: smaller id first), sorted by id, as a LongTensor.
    n >= the number of distinct tokens: every token that occurs (never padded with unseen ones)."""
    if n < 1:
        raise ValueError(f"a draft vocabulary needs n >= 1 tokens, got {n}")
    counts: Counter[int] = Counter()
    for r in responses:
        counts.update(int(t) for t in r)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"response tokens {sorted(bad)[:5]} outside the model's vocabulary of {vocab_size}")
    if not counts:
        raise ValueError("no response tokens to build a draft vocabulary from")
    top = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    return torch.tensor(sorted(top), dtype=torch.long)


def draft_vocab(module: nn.Module) -> torch.Tensor | None:
    """The module's draft vocabulary (token ids), or None for the full vocabulary."""
    v = getattr(module, "vocab", None)
    return v if isinstance(v, torch.Tensor) and v.numel() else None


def set_draft_vocab(module: nn.Module, ids: torch.Tensor | None) -> None:
    """Attach `ids` (or clear with None) as the persistent buffer `vocab`: saved in the draft's weights."""
    ids = torch.zeros(0, dtype=torch.long) if ids is None else ids.detach().to(torch.long).reshape(-1)
    if ids.numel() and (bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0):
        raise ValueError("a draft vocabulary must be distinct non-negative token ids in increasing order")
    dev = next((p.device for p in module.parameters()), ids.device)
    module.register_buffer("vocab", ids.to(dev))
    module.__dict__.pop("_sub_heads", None)


def restrict_logits(logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Full-vocabulary logits [..., V] -> the subset's [..., |vocab|] (unchanged without a subset)."""
    return logits if vocab is None else logits.index_select(-1, vocab.to(logits.device))


def teacher_logits(logits: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """The teacher's logits on the module's draft vocabulary: full-vocabulary logits are restricted,
    logits already over the subset (e.g. from `head_logits`) pass unchanged."""
    vocab = draft_vocab(module)
    return logits if vocab is None or logits.shape[-1] == vocab.numel() else restrict_logits(logits, vocab)


SEGMENT = 1024  # `vocab_topk`'s first pass: the k best of each SEGMENT entries


def vocab_topk(x: torch.Tensor, k: int, split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x [..., V], largest first, as torch.topk gives
    them. split (None: where x is on CUDA): in two passes, the k best of each segment of SEGMENT entries (the
    last padded with -inf), then the k best of those. Why: torch.topk runs a row in one thread block, and on an
    H200 a top-4 over SmolLM2's vocabulary took 49-66 us (`gatherTopK`): an EAGLE-2 round of 1.68 ms ran three,
    182 us, and a Medusa or hidden-transfer round one (docs/results/static-step-h200/run5/profile.md); the
    segments run in parallel. The k largest of a row are among the k largest of their segments, so the values
    are topk's; where values tie, the indices may be other tied ones (torch.topk does not fix their order either).
    A draft's candidates only (verification decides what is committed)."""
    V = x.shape[-1]
    k = min(k, V)
    S = -(-V // SEGMENT)
    if not (x.is_cuda if split is None else split) or S < 4 or k > SEGMENT:
        return x.topk(k, -1)
    rows = x.reshape(-1, V)
    if V % SEGMENT:
        rows = torch.nn.functional.pad(rows, (0, S * SEGMENT - V), value=float("-inf"))
    v1, i1 = rows.view(rows.shape[0], S, SEGMENT).topk(k, -1)  # [M, S, k]
    v, j = v1.reshape(rows.shape[0], S * k).topk(k, -1)  # [M, k]: j indexes the segments' candidates
    idx = i1.reshape(rows.shape[0], S * k).gather(1, j) + torch.div(j, k, rounding_mode="floor") * SEGMENT
    return v.view(*x.shape[:-1], k), idx.view(*x.shape[:-1], k)


def to_token_ids(indices: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Indices into the subset (e.g. a topk of restricted logits) -> token ids."""
    return indices if vocab is None else vocab.to(indices.device)[indices]


def head_logits(module: nn.Module, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LMHead(x) over the module's draft vocabulary: x is what the base's head reads (after its final norm).

    The sub-head holds only the subset's rows, in the base head's own format (an nn.Linear's rows, or a
    compressed head's `select_rows`: `quantization.Q8Linear` copies the rows' codes and scales, exactly the
    head's own weights on those rows). Built once per base head and kept on the module (not
    saved). Gradients flow to x, never to the frozen head."""
    vocab = draft_vocab(module)
    head = model.output
    if vocab is None:
        return head(x)
    cache: dict[tuple, Any] = module.__dict__.setdefault("_sub_heads", {})
    key = _head_key(head, vocab)
    sub = cache.get(key)
    if sub is None:
        cache.clear()  # one base head at a time: a stale sub-head is never kept
        sub = cache[key] = _sub_head(head, vocab)
    if isinstance(sub, torch.Tensor):
        return F.linear(x, sub)
    return sub(x)


def _head_key(head: nn.Module, vocab: torch.Tensor) -> tuple:
    """What a sub-head is a function of: the head's weight storage (identity, device, dtype) and the subset.
    A head moved to another device or dtype, or replaced (compress_weights), gets a fresh sub-head."""
    w = head.weight if isinstance(head, nn.Linear) else getattr(head, "codes", None)
    if w is None:
        return (id(head), vocab.data_ptr(), vocab.numel())
    return (id(head), w.data_ptr(), str(w.device), w.dtype, vocab.data_ptr(), vocab.numel(), str(vocab.device))


def _sub_head(head: nn.Module, vocab: torch.Tensor) -> nn.Module | torch.Tensor:
    if isinstance(head, nn.Linear):
        if head.bias is not None:
            raise ValueError("a draft vocabulary needs a bias-free LM head")
        return head.weight.detach().index_select(0, vocab.to(head.weight.device)).contiguous()

    if isinstance(head, BlockQuantLinear):
        return head.select_rows(vocab)
    raise ValueError(f"no draft-vocabulary head for an LM head of type {type(head).__name__}")


__all__ = ["frequent_tokens", "draft_vocab", "set_draft_vocab", "restrict_logits", "teacher_logits", "to_token_ids",
           "head_logits", "vocab_topk"]
