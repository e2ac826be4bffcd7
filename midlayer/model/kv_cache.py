"""A static KV cache with explicit slots, per-layer occupancy and per-key gate bias.

Layout: preallocated buffers `k`, `v` [L, B, H_kv, S, d] and `bias` [L, B, S]. A *slot* is a column of
the buffers; slots are filled left to right, the same slot for every row of the batch (prompts of
different lengths are left-padded, their pad slots never written). `pos` [B, S] is the RoPE position of the
token in each slot, so a row's positions start at 0 at its first real token whatever its padding.

`bias[l, b, s]` is what the attention adds to the logit of key s at layer l:
  * -inf where layer l holds nothing at slot s: padding, a slot not yet written, a token that skipped
    block l (real skipping: it has no K/V there, and every other token gives it zero weight), or a slot
    dropped after speculative verification;
  * ln(max(g, eps)) for a held token with gate g (gated attention, eq. 3 of arXiv 2506.21103); 0 for dense.
So one additive mask carries causality-free occupancy, skipping and gating; the step adds causality.

`keep(slots)` compacts a chosen subset of slots to the front (tree verification keeps the accepted path);
`truncate(n)` forgets everything from slot n on.

Bounded windowed layers (`for_model(..., local_len=n)`, for windowed and global blocks mixed, Gemma 3): the
windowed layers keep their K/V in buffers of n slots of their own, holding slots `local_off`..length-1 at
columns 0..; `make_room` drops the slots every later query's window has passed by moving the rest to the
front (in slot order, so a query sees the same keys in the same order as in a full cache). The global layers,
the key biases and the positions keep every slot. `offset(layer)` says where a layer's column 0 lies. `keep`
and `truncate` work on slots the windowed layers still hold (speculative decoding); `evict_before`, which needs
every slot in every layer, refuses.

Bounded windowed layers with an offset per row (`row_offsets`, the continuous batch: rows of different lengths):
row b's column c of a windowed layer holds slot c + `row_offs[b]`, and `make_room_row` drops one row's passed keys.
A forward over rows whose offsets differ also has scratch slots past every row's own (a padding row's, a drafter's
rows): it names them `scratch` = (end, E), and slot end + j sits at column E + j of the windowed layers, E past
every row's real columns. The mapping keeps each row's keys in slot order, so a query sees the keys a full cache
would show it, in the same order (the C attention kernel reads only the visible keys, in column order: the q4
bits do not change).

The cache-view protocol (`CacheView`): what a block's attention is handed in one forward instead of a cache
type to check. `update(k, v)` stores this layer's new keys/values wherever the view keeps them and returns
(keys, values, additive mask) to attend over; `attention(module, q, k, v)` stores and attends (by default
through `update` and the module's masked attention). Three implementations: `LayerView` (this dynamic cache),
`MaskedView` (no cache: any explicit mask over the rows themselves, for training passes and drafters) and
`decode_step.StaticView` (the static-shape step, issue 42). A view that lets the C kernels write the cache
in place says so with `direct`; a view that holds a state-space mixer's state hands it out through
`ssm_inputs`. The model never asks which kind of view it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from midlayer.ops import fused_rows, row_attention
from .attention import window_mask


def kv_dtype(model) -> torch.dtype:
    """What a KV cache for `model` holds: the model's `kv_dtype` where one is set (the q4 format's fp16 K/V,
    engine/quantization.py), else its weights' dtype."""
    return getattr(model, "kv_dtype", None) or model.tok_embeddings.weight.dtype


class KVCache:
    # bounded windowed layers (module docstring): none unless for_model is given local_len
    local_layers: frozenset[int] = frozenset()
    local_len = local_window = local_off = local_spare = 0
    row_offs: list[int] | None = None  # with `row_offsets`: each row's slot at column 0 of the windowed layers
    scratch: tuple[int, int] | None = None  # a forward's (first scratch slot, its column in the windowed layers)
    layers_alike = False  # this forward's layers hold the same keys with the same biases (generate.CachedStep)

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 local: tuple[Sequence[int], int, int] | None = None, spare: int = 0,
                 row_offsets: bool = False) -> None:
        """`local` (layers, local_len, window): those layers keep only their last `local_len` slots (module
        docstring); `window`, the largest of their windows, says which slots every later query has passed.
        Their buffers have min(max_len, local_len + `spare`) columns (`spare`: the continuous batch's scratch
        columns). `row_offsets`: each row has its own offset (`make_room_row`), else one for all rows."""
        bias = torch.full((n_layers, batch, max_len), float("-inf"), device=device)
        pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        if local is None or not local[0]:
            shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
            self._bind(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                       bias, pos)
        else:
            layers, self.local_len, self.local_window = frozenset(local[0]), local[1], local[2]
            if not 0 < self.local_window <= self.local_len or spare < 0:
                raise ValueError(f"bounded windowed layers: need 0 < window <= local_len and spare >= 0, got "
                                 f"{local[2]}, {local[1]}, {spare}")
            self.local_layers, self.local_spare = layers, spare
            if row_offsets:
                self.row_offs = [0] * batch

            def buffers(n: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
                shape = (n, batch, n_kv_heads, length, head_dim)
                return (list(torch.zeros(shape, device=device, dtype=dtype).unbind(0)),
                        list(torch.zeros(shape, device=device, dtype=dtype).unbind(0)))

            gk, gv = buffers(n_layers - len(layers), max_len)
            lk, lv = buffers(len(layers), min(max_len, self.local_len + spare))
            ks, vs = [], []
            for layer in range(n_layers):
                src = (lk, lv) if layer in layers else (gk, gv)
                ks.append(src[0].pop(0))
                vs.append(src[1].pop(0))
            self._bind(None, None, bias, pos, ks, vs)
        self.window = 0  # sliding-window attention (> 0): keys `window` or more positions back are hidden
        self.layer_windows: list[int] | None = None  # per layer, where windowed and global layers mix

    def _bind(self, k: torch.Tensor | None, v: torch.Tensor | None, bias: torch.Tensor, pos: torch.Tensor,
              k_layers: list[torch.Tensor] | None = None, v_layers: list[torch.Tensor] | None = None) -> None:
        """Take these buffers as the cache's storage, empty (length 0, every layer dense). k, v None: the
        layers' buffers are separate (`k_layers`, `v_layers`: bounded windowed layers)."""
        self.k, self.v, self.bias, self.pos = k, v, bias, pos
        n_layers, max_len = bias.shape[0], bias.shape[2]
        self.length = 0  # slots in use
        self.max_len = max_len
        # Per-layer views, taken once: the decode step indexes no 5-d buffer.
        if k_layers is None:
            k_layers, v_layers = list(self.k.unbind(0)), list(self.v.unbind(0))
        self.k_layers, self.v_layers = k_layers, v_layers
        self.bias_layers = list(self.bias.unbind(0))
        # Per layer: True while every slot < length is held by that layer with bias 0 (dense, no padding,
        # nothing skipped there): its attention then needs no mask at all in a decode step, the fast path of
        # batch-1 decoding. Per layer, so that a layer no token skips keeps it while others lose it.
        self.dense_layers = [True] * n_layers
        self.mask_memo: dict[tuple, torch.Tensor] = {}  # this forward's masks that layers share (LayerView.finish)
        self.key_memo: tuple | None = None  # (key, slots, hidden): `key_slots`'s answer for this forward
        self.ssm: dict[int, object] = {}  # layer -> ssm.SSMState of a state-space mixer (created on first use)

    def rows(self, first: int, stop: int) -> "KVCache":
        """A cache over rows first..stop-1 of this one's buffers (shared memory, no copy), empty and dense:
        the continuous batch (engine/batch.py) fills one row through it and steps a prefix of rows. Its
        length and dense flags are its own; what it writes lands in this cache's buffers. Bounded windowed
        layers with an offset per row: the view's rows share one offset if they have the same, else keep theirs
        (a forward over them then names its `scratch`)."""
        if not 0 <= first < stop <= self.batch:
            raise ValueError(f"rows {first}..{stop} outside 0..{self.batch}")
        view = KVCache.__new__(KVCache)
        if self.k is not None:
            view._bind(self.k[:, first:stop], self.v[:, first:stop], self.bias[:, first:stop], self.pos[first:stop])
        else:
            view._bind(None, None, self.bias[:, first:stop], self.pos[first:stop],
                       [t[first:stop] for t in self.k_layers], [t[first:stop] for t in self.v_layers])
        view.window, view.layer_windows = self.window, self.layer_windows
        view.local_layers, view.local_len, view.local_window = self.local_layers, self.local_len, self.local_window
        view.local_off, view.local_spare = self.local_off, self.local_spare
        if self.row_offs is not None:
            offs = self.row_offs[first:stop]
            if len(set(offs)) == 1:
                view.local_off = offs[0]
            else:
                view.row_offs = offs
        return view

    def row_offset(self, row: int) -> int:
        """The slot at column 0 of `row`'s windowed layers (0 without bounded windowed layers)."""
        return self.row_offs[row] if self.row_offs is not None else self.local_off

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Slots 0..length-1 of row src (K, V, key biases, positions) become row dst's: a continuous batch moving
        a sequence to another row, or a joining prompt taking a shared prefix (engine/batch.py; EAGLE's rows).
        Bounded windowed layers: what src holds of them (from its offset on), and with it its offset."""
        off = self._held_from(src, length)
        if self.k is not None:  # one copy per buffer
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        else:
            for n, kl, vl in zip(self._row_columns(length, off), self.k_layers, self.v_layers):
                kl[dst, :, :n], vl[dst, :, :n] = kl[src, :, :n], vl[src, :, :n]
        self._set_offset(dst, off)
        self.bias[:, dst, :length] = self.bias[:, src, :length]
        self.pos[dst, :length] = self.pos[src, :length]

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Rows a and b trade their first slots: row a's 0..length_a-1 become row b's and row b's 0..length_b-1 row
        a's (K, V, key biases, positions). A continuous batch freeing row a moves its last running sequence (row
        b) into it and keeps the leaving sequence's K/V in row b for a follow-up prompt (engine/batch.py)."""
        held = self._row_state(b, length_b)
        self.copy_row(a, b, length_a)
        self._put_row(a, held)

    def _held_from(self, row: int, length: int) -> int:
        """`row`'s offset, checked to lie within the `length` slots a copy of the row takes."""
        off = self.row_offset(row)
        if self.local_layers and off > length:
            raise ValueError(f"row {row}: its windowed layers hold slots {off}.. only, not 0..{length - 1}")
        return off

    def _row_columns(self, length: int, off: int) -> list[int]:
        """Per layer, the columns that a row's slots 0..length-1 fill when its windowed layers start at `off`."""
        return [length - (off if layer in self.local_layers else 0) for layer in range(len(self.k_layers))]

    def _set_offset(self, row: int, off: int) -> None:
        if self.row_offs is not None:
            self.row_offs[row] = off
        elif off != self.local_off:
            raise ValueError(f"row {row}: offset {off} differs from the cache's {self.local_off}")

    def _row_state(self, row: int, length: int) -> tuple:
        """Row `row`'s slots 0..length-1, copied out: (length, offset, per layer (K, V) of what it holds, bias, pos)."""
        off = self._held_from(row, length)
        kv = [(k[row, :, :n].clone(), v[row, :, :n].clone())
              for n, k, v in zip(self._row_columns(length, off), self.k_layers, self.v_layers)]
        return length, off, kv, self.bias[:, row, :length].clone(), self.pos[row, :length].clone()

    def _put_row(self, row: int, state: tuple) -> None:
        length, off, kv, bias, pos = state
        self._set_offset(row, off)
        for (k, v), kl, vl in zip(kv, self.k_layers, self.v_layers):
            kl[row, :, :k.shape[1]], vl[row, :, :v.shape[1]] = k, v
        self.bias[:, row, :length], self.pos[row, :length] = bias, pos

    def grown(self, max_len: int, keep_length: bool = False) -> "KVCache":
        """A cache of `max_len` slots (at least this one's) holding what this one holds, in the same rows, with
        the same windows: where a cache that outgrew its slots moves (a continuous batch, EAGLE's batch rows).
        Its length and dense flags start afresh, as a new cache's do, or carry over with `keep_length` (a
        sequence that goes on in the new cache: `LLM.logprobs`'s prefix reuse). Bounded windowed layers keep
        their offsets; their buffers grow up to local_len + spare columns."""
        if max_len < self.max_len:
            raise ValueError(f"grown: {max_len} slots is fewer than the {self.max_len} held")
        kl = self.k_layers[0]
        local = None
        if self.local_layers:
            local = (self.local_layers, self.local_len, self.local_window)
        new = KVCache(self.bias.shape[0], self.batch, kl.shape[1], kl.shape[-1], max_len, device=kl.device,
                      dtype=kl.dtype, local=local, spare=self.local_spare, row_offsets=self.row_offs is not None)
        new.window, new.layer_windows = self.window, self.layer_windows
        new.local_off = self.local_off
        if self.row_offs is not None:
            new.row_offs = list(self.row_offs)
        for src, dst in zip(self.k_layers + self.v_layers, new.k_layers + new.v_layers):
            dst[:, :, :src.shape[2]] = src
        n = self.max_len
        new.bias[..., :n], new.pos[:, :n] = self.bias, self.pos
        if keep_length:
            new.length, new.dense_layers = self.length, list(self.dense_layers)
        return new

    @classmethod
    def for_model(cls, cfg, batch: int, max_len: int | None = None, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32, local_len: int | None = None, spare: int = 0,
                  row_offsets: bool = False) -> "KVCache":
        """A cache for `cfg`'s model. `local_len`: with windowed and global blocks mixed, the windowed blocks
        keep only that many slots (at least their window; 2 W - 1 lets a chunk of W new tokens in beside the W - 1
        kept keys); None or >= max_len: every layer keeps every slot. `row_offsets` (the continuous batch): an
        offset per row, and the windowed blocks' buffers grow with the cache up to local_len + `spare` columns
        (its scratch), bounded whatever max_len is now."""
        if max_len is None:
            max_len = cfg.max_seq_len
        elif max_len < 1:  # never silently the default: 0 is a caller's bug
            raise ValueError(f"KV cache max_len must be >= 1, got {max_len}")
        local = None
        layers = [layer for layer in range(cfg.n_layers) if cfg.window_of(layer)]
        if local_len is not None and cfg.mixed_windows and (local_len < max_len or row_offsets) and layers:
            local = (layers, local_len, max(cfg.window_of(layer) for layer in layers))
        cache = cls(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, max_len, device, dtype, local, spare,
                    row_offsets)
        # one window for the whole cache, which may then drop keys every block is done with (make_room); with
        # windowed and global blocks mixed nothing can be dropped, and each layer masks by its own window
        cache.window = 0 if cfg.mixed_windows else cfg.sliding_window
        cache.layer_windows = [cfg.window_of(layer) for layer in range(cfg.n_layers)] if cfg.mixed_windows else None
        return cache

    @property
    def batch(self) -> int:
        return self.bias.shape[1]

    def reserve(self, n: int) -> torch.Tensor:
        """Claim the next n slots; returns their indices. Refuses to overflow with a clear message."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache full: {self.length} slots used + {n} new > max_len {self.max_len} "
                             "(the model's context length)")
        if self.local_len and self.length - self.local_off + n > self.local_len:
            raise ValueError(f"the bounded windowed layers hold {self.local_len} slots: call make_room({n}) before "
                             f"reserving {n} more (they hold {self.length - self.local_off})")
        slots = torch.arange(self.length, self.length + n, device=self.pos.device)
        self.length += n
        return slots

    def ssm_state(self, layer: int, mixer, batch: int, dtype: torch.dtype = torch.float32):
        """The state of the state-space mixer at `layer` for this cache's sequences (zero at first)."""
        st = self.ssm.get(layer)
        if st is None:
            st = self.ssm[layer] = mixer.new_state(batch, self.pos.device, dtype)
        return st

    def offset(self, layer: int) -> int | None:
        """The slot held in column 0 of `layer`'s K/V buffers (> 0 only for bounded windowed layers); None where
        the rows have offsets of their own (`row_offs`: `key_slots` maps the columns)."""
        if layer not in self.local_layers:
            return 0
        return self.local_off if self.row_offs is None else None

    def scratch_columns(self) -> tuple[int, int]:
        """`scratch`, which a forward over rows with offsets of their own must have named."""
        if self.scratch is None:
            raise ValueError("a forward over rows with windowed-layer offsets of their own must name its scratch "
                             "slots (KVCache.scratch = (first scratch slot, its column))")
        return self.scratch

    def key_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with offsets of their own, in a forward that named its `scratch` (end, E): (slots, hidden), both
        [B, columns]. Column c of row b holds slot c + row_offs[b] for c < E and scratch slot end + c - E after;
        `hidden` marks the columns c < E whose slot would be a scratch slot or later (stale: nothing of the row's
        own). The slots of hidden columns are clamped into the cache (they are masked)."""
        end, E = self.scratch_columns()
        key = (self.length, end, E, tuple(self.row_offs))
        if self.key_memo is None or self.key_memo[0] != key:
            dev = self.pos.device
            col = torch.arange(self.length - (end - E), device=dev)[None]
            offs = torch.tensor(self.row_offs, device=dev)[:, None]
            real = col < E
            slots = torch.where(real, col + offs, col + (end - E))
            hidden = real & (slots >= end)
            self.key_memo = (key, slots.clamp(max=self.length - 1), hidden)
        return self.key_memo[1], self.key_memo[2]

    def _whole(self, what: str) -> None:
        if self.k is None:
            raise ValueError(f"{what}: not supported by a cache whose windowed layers are bounded (it drops keys "
                             "from every layer; the windowed layers drop theirs with make_room)")

    def chunk(self, n: int) -> int:
        """How many of n new tokens fit in one forward: all of them, unless a bounded window (the whole cache's
        or the windowed layers') needs the prompt in chunks of at most the window (the same logits: each query
        sees the W - 1 keys before it either way)."""
        if self.window and n > self.max_len - self.length:
            return self.window
        if self.local_len and n > self.local_len - (self.length - self.local_off):
            return self.local_window
        return n

    def evict_before(self, first: int) -> None:
        """Forget slots 0..first-1 and move the rest to the front (a bounded sliding-window cache: those keys
        lie outside every later query's window). Unlike `truncate`, nothing later is undone, so a state-space
        mixer's state stays valid."""
        self._whole("evict_before")
        if not 0 <= first <= self.length:
            raise ValueError(f"evict_before: {first} not in [0, {self.length}]")
        if first == 0:
            return
        n = self.length - first
        self.k[:, :, :, :n] = self.k[:, :, :, first:self.length].clone()
        self.v[:, :, :, :n] = self.v[:, :, :, first:self.length].clone()
        self.bias[:, :, :n] = self.bias[:, :, first:self.length].clone()
        self.pos[:, :n] = self.pos[:, first:self.length].clone()
        self.bias[:, :, n:self.length] = float("-inf")
        self.length = n
        self.mask_memo = {}

    def make_room(self, n_new: int) -> None:
        """With a sliding window W: before n_new slots are reserved, evict the keys no query from the next
        slot on can see (all but the last W - 1) if the new slots would not fit."""
        if self.window and self.length + n_new > self.max_len:
            self.evict_before(max(self.length - (self.window - 1), 0))
        if self.local_len and self.length - self.local_off + n_new > self.local_len:
            if self.row_offs is not None:
                raise ValueError("make_room: this cache's rows have offsets of their own: make_room_row")
            self.local_off = self._slide(slice(None), self.length, self.local_off, n_new)

    def make_room_row(self, row: int, start: int, n_new: int) -> None:
        """`make_room` for one row with an offset of its own (`row_offs`, the continuous batch): n_new tokens go
        to its slots start.. (start: its committed length; what it held from there on is dropped)."""
        off = self.row_offs[row]
        if start + n_new - off > self.local_len:
            self.row_offs[row] = self._slide(row, start, off, n_new)

    def _slide(self, rows: int | slice, start: int, off: int, n_new: int) -> int:
        """Drop the bounded windowed layers' keys that no query from slot `start` on sees (those before start - (W
        - 1)) from `rows`, whose column 0 holds slot `off`: the kept ones move to the front, in slot order. Returns
        the new offset; refuses if n_new new slots still do not fit."""
        first = max(start - (self.local_window - 1), off)
        drop, n = first - off, start - first
        if n + n_new > self.local_len:  # (checked first: nothing is dropped for a forward that cannot run)
            raise ValueError(f"{n_new} new tokens do not fit beside the {n} kept keys of the bounded windowed "
                             f"layers ({self.local_len} slots): feed at most chunk() tokens per forward")
        for layer in self.local_layers:
            for buf in (self.k_layers[layer], self.v_layers[layer]):
                buf[rows, :, :n] = buf[rows, :, drop:drop + n].clone()
        self.mask_memo = {}
        return first

    def _no_rollback(self, what: str) -> None:
        if self.ssm:
            raise ValueError(f"{what}: a state-space mixer's state cannot be rolled back to earlier tokens "
                             "(speculative decoding and drafters are not supported with ssm_layers)")

    def truncate(self, length: int) -> None:
        if not self.local_off <= length <= self.length:
            raise ValueError(f"truncate: length {length} not in [{self.local_off}, {self.length}]")
        if length < self.length:
            self._no_rollback("truncate")
        self.bias[:, :, length:self.length] = float("-inf")
        self.length = length

    def truncate_row(self, row: int, length: int) -> None:
        """`truncate` for one row of a cache whose rows have lengths of their own (the continuous batch): its slots
        from `length` on are hidden at every layer; a row cut to nothing holds no windowed-layer key either, so
        its offset starts again at slot 0."""
        self.bias[:, row, length:] = float("-inf")
        if length == 0 and self.row_offs is not None:
            self.row_offs[row] = 0

    def keep(self, slots: torch.Tensor, start: int) -> None:
        """Move slots `slots` [B, n] (per row, increasing, all >= start) to start..start+n-1 and drop every
        other slot from `start` on. Used after verifying a draft tree: only the accepted path stays."""
        self._no_rollback("keep")
        n = slots.shape[1]
        if self.k is None and start < self.local_off:
            raise ValueError(f"keep: slot {start} was dropped from the bounded windowed layers (they hold slots "
                             f"{self.local_off}.. now)")
        for b in range(self.batch):  # B is small; per-row copies keep the indexing obvious
            src = slots[b]
            if self.k is not None:
                self.k[:, b, :, start:start + n] = self.k[:, b, :, src].clone()
                self.v[:, b, :, start:start + n] = self.v[:, b, :, src].clone()
            else:  # bounded windowed layers: each layer's column c holds slot c + offset(layer)
                for layer, (kl, vl) in enumerate(zip(self.k_layers, self.v_layers)):
                    off = self.offset(layer)
                    kl[b, :, start - off:start - off + n] = kl[b, :, src - off].clone()
                    vl[b, :, start - off:start - off + n] = vl[b, :, src - off].clone()
            self.bias[:, b, start:start + n] = self.bias[:, b, src].clone()
            self.pos[b, start:start + n] = self.pos[b, src].clone()
        self.bias[:, :, start + n:self.length] = float("-inf")
        self.length = start + n


class CacheView:
    """The protocol every cache view implements (module docstring). Defaults: not direct, no SSM state.

    A `direct` view lets the q4 C kernels store the new rows' K/V and attend in place (attention.Attention.
    _forward_kernels, model.Block._forward_fused), through: `k_buffer` / `v_buffer`, this layer's cache
    [B, Hk, S_max, d]; `query_slots` [B, M], where the rows go; `finish(M, device)`, which records what the
    forward commits and returns the additive mask [B, 1, M, length]; and `length`, the slots read. The q4
    format's attention takes them wherever the view is direct; another model's where the view's `c_attention`
    says so (decode_step.StaticView, a step with attention="c")."""

    direct = False
    c_attention = False
    query_slots: torch.Tensor

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v [B, Hk, M, d]; return (keys, values [B, Hk, S, d], additive mask [B, 1|H, M, S] or None)."""
        raise NotImplementedError

    def attention(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention output [B, H, M, d] of queries q over this view's keys once k, v [B, Hk, M, d] are
        stored: by default `update`, then the module's masked attention (attention.Attention.attend_masked).
        A view may compute it otherwise (decode_step.StaticView: in position order, for batch invariance)."""
        k, v, mask = self.update(k, v)
        return module.attend_masked(q, k, v, mask)

    def fuses_rope(self, x: torch.Tensor) -> bool:
        """Whether `rope_attention` takes the rows x's fused q|k|v projection before RoPE (default: no)."""
        return False

    def rope_attention(self, module, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention output [B, H, M, d] from the fused projection qkv [B, M, H + 2 Hk, d] and the rows'
        cos, sin [B, M, d] (where `fuses_rope`): RoPE and the store as one kernel (ops/fused_rows.rope_store),
        then `attend_rotated`."""
        kc, vc, slots = self.rope_targets(qkv.shape[0])
        return self.attend_rotated(module, fused_rows.rope_store(qkv, cos, sin, module.n_heads, kc, vc, slots))

    def rope_targets(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, slots): the cache layer [B, Hk, S, d] that the rows' rotated keys and values are stored in,
        at slots [B, M] (where `fuses_rope`: by rope_store, or by the q|k|v projection's own kernel,
        ops/row_linear.norm_linear)."""
        raise NotImplementedError

    def attend_rotated(self, module, q: torch.Tensor) -> torch.Tensor:
        """The attention output [B, H, M, d] of the rotated queries q [B, M, H, d] whose keys and values are
        stored at `rope_targets`."""
        raise NotImplementedError

    def ssm_inputs(self, layer: int, mixer, x: torch.Tensor) -> tuple:
        """(state, valid) for a state-space mixer at `layer` over the rows x [B, M, d]."""
        raise ValueError("a state-space mixer runs over its own state only: draft training passes, drafters "
                         "(explicit attention masks over draft rows) and the static decode step are not "
                         "supported with ssm_layers")


class MaskedView(CacheView):
    """A view that stores nothing: attention runs over the rows' own keys (and, with `prefix` (k, v), other
    rows' keys placed before them) through an explicit additive `mask`. It lets the base model's own blocks
    run any mask (hidden transfer's training rows, EAGLE's training pass). `keep`: remember this call's k, v."""

    def __init__(self, mask: torch.Tensor, keep: bool = False,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.mask, self.keep, self.prefix = mask, keep, prefix
        self.k = self.v = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.keep:
            self.k, self.v = k, v
        if self.prefix is not None:
            k, v = torch.cat([self.prefix[0], k], 2), torch.cat([self.prefix[1], v], 2)
        return k, v, self.mask


class SlotView(CacheView):
    """A view over preallocated buffers k, v [B, Hk, S, d] that writes the rows' K/V at `slots` [M] (device
    indices; any padding rows all at one spare slot) and reads every slot through the additive `mask`
    [B, 1, M, S]: static shapes, no host read (speculative/eagle.py's draft cache in the static step's device
    rounds). `rows` = (keys [B, M, S], kmask [B, M, S], positions [B, M], start, counts): the rows attend instead
    through the static step's attention kernel (ops/row_attention.py), each over the positions up to its own in
    position order (`keys`: the slot of each), where the step runs its kernels: one launch, fp32 inside, where
    `attend_masked` on a GPU is PyTorch's fp32 attention and the casts around it."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None,
                 rows: tuple | None = None) -> None:
        self.k, self.v, self.slots, self.mask, self.rows = k, v, slots, mask, rows

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.slots, k.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v.to(self.v.dtype))
        return self.k, self.v, self.mask

    def fuses_rope(self, x: torch.Tensor) -> bool:
        # inside the static step's kernels (a device round): RoPE and the store as one kernel, as the step's own
        # cache takes them (ops/fused_rows.py, decode_step.StaticView)
        return fused_rows.stores_into(x, self.k)

    def rope_targets(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k, self.v, self.slots.view(1, -1).expand(batch, -1)

    def attention(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return super().attention(module, q, k, v)
        self.update(k, v)
        return self._attend_rows(q)

    def attend_rotated(self, module, q: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return module.attend_masked(q.transpose(1, 2), self.k, self.v, self.mask)
        return self._attend_rows(q.transpose(1, 2))

    def _attend_rows(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, M, d] over the buffers through the row attention (`rows`): [B, H, M, d], attend_masked's."""
        keys, kmask, positions, start, counts = self.rows
        return row_attention.row_attention(q, self.k, self.v, keys, kmask, positions, dtype=q.dtype, counts=counts,
                                           start=start).transpose(1, 2)


@dataclass
class LayerView(CacheView):
    """What one layer's attention needs in one step: where to write, and the mask to read with.

    Dense step (`valid` None): the M new tokens of every row go to the contiguous slots start..start+M-1.
    Sparse step: row b's M entries are padded (rows have different numbers of active tokens); `valid`
    [B, M] says which are real, `query_slots` [B, M] where each goes. `gate_bias` [B, M] or None:
    ln(max(g, eps)) of the new tokens (0 when None). `extra_mask` [B, 1, M, S] or None: an additional
    additive mask (tree attention). `position_bias(q_pos, k_pos)`: the model's relative position bias
    (ALiBi, T5), added from the cache's positions.
    """

    cache: KVCache
    layer: int
    query_slots: torch.Tensor  # [B, M] slot of each query (for causality and for sparse writes)
    start: int | None = None  # dense step: first slot of the contiguous block
    valid: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    extra_mask: torch.Tensor | None = None
    position_bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None  # ALiBi / T5

    @property
    def direct(self) -> bool:
        # the C kernels address a layer's buffers by slot: a bounded windowed layer whose columns have moved
        # (offset > 0) stores and attends through `update` instead
        return self.cache.offset(self.layer) == 0

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.cache.k_layers[self.layer]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.cache.v_layers[self.layer]

    @property
    def length(self) -> int:
        return self.cache.length

    def ssm_inputs(self, layer: int, mixer, x: torch.Tensor) -> tuple:
        """Generation: the mixer's state lives in the KV cache, per layer; `valid` marks real rows."""
        return self.cache.ssm_state(layer, mixer, x.shape[0], x.dtype), self.valid

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v [B, Hk, M, d] at this step's slots; return (keys, values [B, Hk, S, d], mask)."""
        self.store(k, v)
        mask = self.finish(k.shape[2], k.device)
        n = self._columns()  # the columns this layer's buffers hold
        return self.cache.k_layers[self.layer][:, :, :n], self.cache.v_layers[self.layer][:, :, :n], mask

    def _columns(self) -> int:
        """How many columns of this layer's buffers the step reads: the slots it holds (module docstring)."""
        c = self.cache
        off = c.offset(self.layer)
        if off is None:
            end, E = c.scratch_columns()
            off = end - E  # (the scratch slots' shift)
        return c.length - off

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        c, l = self.cache, self.layer
        off = c.offset(l)
        if self.valid is None and off is not None:
            c.k_layers[l].narrow(2, self.start - off, k.shape[2]).copy_(k)
            c.v_layers[l].narrow(2, self.start - off, k.shape[2]).copy_(v)
            return
        if self.valid is None:
            b_idx, m_idx = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device).nonzero(as_tuple=True)
        else:
            b_idx, m_idx = self.valid.nonzero(as_tuple=True)
        slots = self.query_slots[b_idx, m_idx]
        if off is not None:
            cols = slots - off
        else:  # rows with offsets of their own: slot s of row b at column s - row_offs[b]; scratch slots from E on
            end, E = c.scratch_columns()
            offs = torch.tensor(c.row_offs, device=slots.device)[b_idx]
            cols = torch.where(slots >= end, slots - (end - E), slots - offs)
        # Mixed advanced indexing: both sides come out as [N, H_kv, d].
        kl, vl = c.k_layers[l], c.v_layers[l]
        kl[b_idx, :, cols] = k[b_idx, :, m_idx].to(kl.dtype)  # (an fp16 cache rounds, as copy_ does)
        vl[b_idx, :, cols] = v[b_idx, :, m_idx].to(vl.dtype)

    def finish(self, M: int, device: torch.device) -> torch.Tensor | None:
        """After this layer's K/V of the step are stored (by `store` or by a kernel that writes the cache
        itself): record each written key's bias and return the additive mask [B, 1, M, S] the M queries
        read the cache with, or None when every held key is visible (the dense decode step)."""
        c, l = self.cache, self.layer
        if self.gate_bias is not None or self.valid is not None:
            c.dense_layers[l] = False  # some key is gated or missing here: from now on this layer needs the mask
        dense = c.dense_layers[l]
        bias_l = c.bias_layers[l]
        if self.valid is None:
            if self.gate_bias is None:
                bias_l.narrow(1, self.start, M).zero_()
            else:
                bias_l.narrow(1, self.start, M).copy_(self.gate_bias)
        else:
            b_idx, m_idx = self.valid.nonzero(as_tuple=True)
            s_idx = self.query_slots[b_idx, m_idx]
            bias_l[b_idx, s_idx] = 0.0 if self.gate_bias is None else self.gate_bias[b_idx, m_idx].float()
        S, off = c.length, c.offset(l)  # this layer holds slots off..S-1 (off > 0: a bounded windowed layer)
        window = c.window if c.layer_windows is None else c.layer_windows[l]
        # sliding window: keys far enough back are hidden too (rows with offsets of their own: always masked)
        local = 0 < window and (off is None or window < S - off)
        # a decode step: one query in the last slot, so causality hides nothing from it, and nothing else adds
        decode = (M == 1 and self.valid is None and self.start == S - 1 and self.extra_mask is None and not local
                  and self.position_bias is None and off is not None)
        if decode and dense:
            return None  # every held key is visible to the one new query
        if decode:
            # the mask is this layer's key biases as they are (skipped slots -inf, gated keys ln g) -- a view
            # on the CPU, no tensor built; contiguous elsewhere (GPU attention kernels want an aligned bias,
            # and the view's batch stride is the cache's max_len)
            mask = bias_l[:, None, None, off:S]
            return mask if mask.device.type == "cpu" else mask.contiguous()
        # Every held key has bias 0 at this layer (dense), or every layer holds the same keys with the same biases
        # (`layers_alike`: a model without routers): the mask is the same for all such layers of this forward with
        # the same window and offset, so it is built once and reused (keyed on what it depends on)
        shared = dense or (c.layers_alike and self.gate_bias is None)
        if shared:
            em, qs = self.extra_mask, self.query_slots

            def ident(t: torch.Tensor | None) -> tuple | None:
                return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            key = (dense, self.start, M, S, off, window, ident(em), None if dense else ident(qs))
            if key in c.mask_memo:
                return c.mask_memo[key]
        if off is not None:  # columns 0.. hold slots off..S-1
            key_slots, hidden = torch.arange(off, S, device=device)[None], None

            def keys(x: torch.Tensor) -> torch.Tensor:  # x [..., S] by slot -> [..., columns]
                return x[..., off:S]
        else:  # rows with offsets of their own: each row's column c holds its own slot (KVCache.key_slots)
            key_slots, hidden = c.key_slots()

            def keys(x: torch.Tensor) -> torch.Tensor:
                B, n = key_slots.shape
                return x.gather(-1, key_slots.view(B, *[1] * (x.dim() - 2), n).expand(*x.shape[:-1], n))
        causal = torch.where(key_slots[:, None, :] <= self.query_slots[:, :, None], 0.0, float("-inf"))
        mask = (causal + keys(bias_l)[:, None])[:, None]  # [B, 1, M, columns]
        if local or self.position_bias is not None:  # by position: left padding, trees, joined rows alike
            q_pos, k_pos = c.pos.gather(1, self.query_slots), keys(c.pos)
            if local:
                mask = mask + window_mask(q_pos, k_pos, window)[:, None]
            if self.position_bias is not None:  # [B, H, M, S]: a per-head relative position bias
                mask = mask + self.position_bias(q_pos, k_pos)
        if self.extra_mask is not None:
            mask = mask + keys(self.extra_mask)
        if hidden is not None:
            mask = mask.masked_fill(hidden[:, None, None, :], float("-inf"))
        if shared:
            c.mask_memo[key] = mask
        return mask
