"""The draft tree: which candidates a speculative round verifies, and where each one sits.

Trees. A `DraftTree` is a list of root-to-node paths of top-k *ranks* (Medusa "choices"), e.g.
[(0,), (1,), (0, 0)]: node (0, 1) holds the rank-1 candidate of depth 2 under the rank-0 candidate of
depth 1. The root -- the last committed token, not yet in the cache -- is NOT a node: nodes are numbered
0..n-1 breadth-first (by depth, then by path), `parent[i] == -1` for depth-1 nodes, and node i sits at
RoPE position `last_pos + depth[i]` (the root at offset 0). During verification the forward runs over
[root, node_0, ..., node_{n-1}], i.e. node i is row i + 1.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import torch

Path = tuple[int, ...]  # a root-to-node path of top-k ranks


class DraftTree:
    """A static draft tree given by root-to-node paths of top-k ranks (see the module docstring).

    Attributes (n = number of nodes, the root excluded):
      paths          tuple of the n paths, breadth-first (by depth, then lexicographically by rank);
      parent         LongTensor [n], index of the parent node, -1 for depth-1 nodes (parent = root);
      depth          LongTensor [n], >= 1; also the RoPE position offset from the root;
      ancestor_mask  BoolTensor [n, n], [i, j] True iff node j is node i or one of its ancestors;
      retrieve_paths LongTensor [n_leaves, max_depth], node indices from depth 1 down to each leaf
                     (leaves in node order), padded with -1;
      ranks_per_depth list[int], how many top-k candidates depth d + 1 uses (max rank + 1).
    """

    def __init__(self, paths: Iterable[Sequence[int]]) -> None:
        norm: list[Path] = []
        for p in paths:
            t = tuple(p)
            if len(t) == 0:
                raise ValueError("empty path: the root (last committed token) is implicit, not a node")
            for r in t:
                if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                    raise ValueError(f"path {t}: ranks must be non-negative ints")
            norm.append(t)
        seen: set[Path] = set()
        for t in norm:
            if t in seen:
                raise ValueError(f"duplicate path {t}")
            seen.add(t)
        for t in norm:
            for k in range(1, len(t)):
                if t[:k] not in seen:
                    raise ValueError(f"path {t} needs its prefix {t[:k]} in the tree (every node's parent)")
        # Breadth-first order: parents precede children, so the causal mask of the flattened sequence is
        # compatible with the tree mask and any BFS prefix of the nodes is itself a valid tree (pruning).
        self.paths: tuple[Path, ...] = tuple(sorted(norm, key=lambda t: (len(t), t)))
        index = {t: i for i, t in enumerate(self.paths)}
        n = len(self.paths)
        self.parent = torch.tensor([index[t[:-1]] if len(t) > 1 else -1 for t in self.paths], dtype=torch.long)
        self.depth = torch.tensor([len(t) for t in self.paths], dtype=torch.long)
        self.max_depth = int(self.depth.max()) if n else 0
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(n):  # parents come first, so their rows are complete when a child copies them
            if self.parent[i] >= 0:
                anc[i] |= anc[int(self.parent[i])]
        self.ancestor_mask = anc
        # children in the root-included numbering (root = 0, node i = i + 1), used by the verification walk
        self._children: list[list[int]] = [[] for _ in range(n + 1)]
        for i in range(n):
            self._children[int(self.parent[i]) + 1].append(i + 1)
        leaves = [i for i in range(n) if not self._children[i + 1]]
        rp = torch.full((len(leaves), self.max_depth), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            chain = anc[leaf].nonzero().flatten()  # ancestors-or-self, increasing index == increasing depth
            rp[row, :len(chain)] = chain
        self.retrieve_paths = rp
        self.ranks_per_depth = [1 + max(t[-1] for t in self.paths if len(t) == d)
                                for d in range(1, self.max_depth + 1)]
        self._mask_cache: dict[tuple[str, int], torch.Tensor] = {}

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def chain(cls, k: int) -> "DraftTree":
        """The top-1 chain of depth k (k = 0: no draft, plain decoding)."""
        if k < 0:
            raise ValueError(f"chain depth must be >= 0, got {k}")
        return cls([(0,) * d for d in range(1, k + 1)])

    @classmethod
    def from_topk(cls, k_per_depth: Sequence[int]) -> "DraftTree":
        """The full product tree: every combination of the top-k_d candidates at each depth d."""
        if any(k <= 0 for k in k_per_depth):
            raise ValueError(f"every depth needs k >= 1, got {list(k_per_depth)}")
        paths: list[Path] = []
        level: list[Path] = [()]
        for k in k_per_depth:
            level = [p + (r,) for p in level for r in range(k)]
            paths.extend(level)
        return cls(paths)

    @classmethod
    def greedy_from_accuracies(cls, acc: Sequence[Sequence[float]], n_nodes: int) -> "DraftTree":
        """The n_nodes nodes with the highest estimated acceptance probability (Medusa's sparse tree).

        acc[d][r] = probability that the rank-r candidate (0-based) of depth d + 1 is the token the base
        model accepts there (the *per-rank* top-r accuracy, measured on calibration data), for a drafter
        whose depths are treated as independent. The estimate for the node with path (r_1, ..., r_D) is

            P(node accepted) = prod_{d=1..D} acc[d-1][r_d],

        because the node is accepted iff every node on its path is (verification walks down from the
        root). The expected number of accepted draft tokens of a tree is the sum of this over its nodes,
        so taking the n best nodes maximises it for n nodes. Since acc <= 1 a child never scores above its
        parent, so the best-first expansion below yields a prefix-closed set (ties go to the shallower,
        then lexicographically smaller path, which keeps parents ahead of equal-scoring children). If fewer
        than n_nodes paths exist, all of them are taken.
        """
        if n_nodes < 0:
            raise ValueError(f"n_nodes must be >= 0, got {n_nodes}")
        for d, row in enumerate(acc):
            if len(row) == 0:
                raise ValueError(f"acc[{d}] is empty: give at least one rank per depth")
            for a in row:
                if not 0.0 <= a <= 1.0:
                    raise ValueError(f"acc[{d}] holds {a}, not a probability in [0, 1]")
        chosen: list[Path] = []
        heap: list[tuple[float, int, Path]] = []  # max-heap on the estimate via negation
        if acc:
            for r, a in enumerate(acc[0]):
                heapq.heappush(heap, (-a, 1, (r,)))
        while heap and len(chosen) < n_nodes:
            neg, depth, path = heapq.heappop(heap)
            chosen.append(path)
            if depth < len(acc):
                for r, a in enumerate(acc[depth]):
                    heapq.heappush(heap, (neg * a, depth + 1, path + (r,)))
        return cls(chosen)

    # ------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.paths)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftTree) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"DraftTree(n_nodes={len(self)}, max_depth={self.max_depth}, paths={list(self.paths)})"

    @property
    def position_offsets(self) -> torch.Tensor:
        """RoPE position of each node relative to the root: its depth (sec. 3.4.1: original positions)."""
        return self.depth

    @property
    def is_chain(self) -> bool:
        """True when every depth has exactly one node (a single root-to-leaf path)."""
        return len(self) == self.max_depth

    def level_sizes(self) -> list[int]:
        """Rows an autoregressive drafter runs per level to fill the tree: the root, then all nodes of every
        depth below the deepest (each proposes its children; the last level's nodes are never run)."""
        return [1] + [b - a for a, b, _, _ in self.levels()[:-1]] if self.max_depth else []

    def levels(self) -> list[tuple[int, int, list[int], list[int]]]:
        """Per depth d = 1..max_depth, how an autoregressive drafter fills it (level by level):
        (a, b, parent, rank), the nodes of depth d being a..b-1 (breadth-first: each depth is a contiguous
        range), parent[j] node a + j's parent as an index among depth d - 1's nodes (0: the root, for
        depth 1) and rank[j] its rank among its parent's candidates (node (r_1..r_d) takes the r_d-th most
        likely token of its parent's draft distribution)."""
        depth, parent = self.depth.tolist(), self.parent.tolist()
        first = [depth.index(d) for d in range(1, self.max_depth + 1)]
        out = []
        for d in range(1, self.max_depth + 1):
            a, b = first[d - 1], first[d] if d < self.max_depth else len(self)
            above = first[d - 2] if d > 1 else 0
            out.append((a, b, [max(parent[i], 0) - above for i in range(a, b)],
                        [self.paths[i][-1] for i in range(a, b)]))
        return out

    def child_rows(self, row: int) -> list[int]:
        """The children of verification row `row` (0: the root, i + 1: node i), as rows."""
        return self._children[row]

    def children(self, node: int) -> list[int]:
        """Child node indices of node `node` (-1: of the root)."""
        return [c - 1 for c in self._children[node + 1]]

    def prune(self, max_depth: int, max_nodes: int) -> "DraftTree":
        """The sub-tree of nodes with depth <= max_depth, cut to its first max_nodes nodes (BFS order keeps
        it prefix-closed). Used near the end of generation and of the context."""
        key = (max_depth, max_nodes)
        memo = self.__dict__.setdefault("_pruned", {})  # the loops ask for the same few cuts every round
        if key not in memo:
            keep = [t for t in self.paths if len(t) <= max_depth][:max(max_nodes, 0)]
            memo[key] = self if len(keep) == len(self) else DraftTree(keep)
        return memo[key]

    def end_probabilities(self, acc: Sequence[Sequence[float]]) -> list[float]:
        """P(a round's accepted path ends at row r), r = 0 the root and i + 1 node i, under
        `greedy_from_accuracies`' model (depths independent; acc[d][r] the rank-r candidate's accuracy at depth
        d + 1; a rank or depth past acc counts 0): the path to r is accepted and none of r's children is. At
        most one child can be (one token is the base's), so

            P(end = r) = P(r accepted) (1 - sum over r's children c of acc[depth(c) - 1][rank(c)]).

        They sum to 1 over the rows."""
        def a(d: int, r: int) -> float:
            return acc[d][r] if d < len(acc) and r < len(acc[d]) else 0.0

        reach = [1.0]  # P(row accepted), the root's 1
        for p, up in zip(self.paths, self.parent.tolist()):
            reach.append(reach[up + 1] * a(len(p) - 1, p[-1]))
        return [reach[r] * (1.0 - sum(a(len(self.paths[c - 1]) - 1, self.paths[c - 1][-1])
                                      for c in self._children[r])) for r in range(len(self) + 1)]

    def likeliest_ends(self, acc: Sequence[Sequence[float]], m: int) -> tuple[int, ...]:
        """The root and the m - 1 other rows where a round's accepted path most likely ends
        (`end_probabilities`; ties: the earlier row), sorted: hidden transfer's anchors when only m rows of a
        round carry pseudo rows (`decode_step.anchor_shifts`)."""
        if m < 1:
            raise ValueError(f"anchors: at least the root (m >= 1), got {m}")
        p = self.end_probabilities(acc)
        rest = sorted(range(1, len(p)), key=lambda r: (-p[r], r))[:m - 1]
        return tuple(sorted([0, *rest]))

    def verify_mask(self, start: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive extra_mask [1, 1, n+1, start+n+1] for `forward_cached` over [root, nodes] written at slots
        start..start+n: every row sees all committed slots < start; among the new rows a node sees only its
        ancestors, the root and itself (tree attention, sec. 3.4.1). The engine adds causality on top."""
        key = (str(device), start)
        m = self._mask_cache.get(key)
        if m is None:
            n = len(self)
            full = torch.ones(n + 1, n + 1, dtype=torch.bool)  # root row / column: root sees itself, all see root
            full[0, 1:] = False
            full[1:, 1:] = self.ancestor_mask
            block = torch.zeros(n + 1, n + 1).masked_fill(~full, float("-inf"))
            m = torch.cat([torch.zeros(n + 1, start), block], 1)[None, None].to(device)
            if len(self._mask_cache) > 64:  # start changes every round; keep the memo bounded
                self._mask_cache.clear()
            self._mask_cache[key] = m
        return m


def candidates_from_topk(per_depth_topk: Sequence[Sequence[int]], tree: DraftTree) -> torch.Tensor:
    """Node tokens [n] from per-depth candidate lists: node (r_1..r_D) gets per_depth_topk[D-1][r_D].

    The Medusa / hidden-transfer layout: a depth's candidates do not depend on the path above them.
    """
    if len(per_depth_topk) < tree.max_depth:
        raise ValueError(f"the tree has depth {tree.max_depth} but only {len(per_depth_topk)} depths of candidates")
    for d, need in enumerate(tree.ranks_per_depth):
        if len(per_depth_topk[d]) < need:
            raise ValueError(f"depth {d + 1} uses ranks up to {need - 1} but only {len(per_depth_topk[d])} "
                             "candidates were given")
    return torch.tensor([int(per_depth_topk[len(t) - 1][t[-1]]) for t in tree.paths], dtype=torch.long)
