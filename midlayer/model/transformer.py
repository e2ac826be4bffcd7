"""The Transformer: Llama-3 style, with optional skip-middle gating (arXiv 2506.21103).

Architecture choices, the defaults (paper section 3 / Table 2, SPEC section 1); every part is a setting
(issue 13, docs/parts.md: LayerNorm, post-LN, QK-norm, NoPE / absolute / ALiBi / T5 positions and RoPE
scaling, GLU and MLP variants, mixture of experts, sliding windows, dropouts, a scaled init, state-space
mixers in chosen blocks):
  * decoder-only; token embedding -> RMSNorm (a norm after the embedding) -> L blocks -> RMSNorm -> LM head;
  * grouped-query attention with RoPE (theta 1e4, no scaling), through SDPA or FlexAttention;
  * SwiGLU FFN with hidden size ffn_dim_multiplier * dim rounded up to multiple_of;
  * RMSNorm (eps 1e-5, weight 1); every other parameter ~ N(0, 0.02);
  * norm placement `pre` (y = x + M(N(x))) or `sandwich`/peri-LN (y = x + N(M(N(x))), the paper's choice);
  * gated models (`gating=True`): routers on the first L/2 blocks; each block computes
        a = h + g * GatedAttn(h, g),   h' = a + g * FFN(a)
    with g the token's gate at that block (gating.py) and gated attention hiding keys with g = 0.

Names follow the Llama reference (tok_embeddings, layers, norm, output; attention.wq/wk/wv/wo,
feed_forward.w1/w2/w3, attention_norm, ffn_norm) so that checkpoints map by name.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from midlayer.config import ModelConfig
from .attention import Attention, key_gate_bias, PositionBias, rope_tables
from .gating import GateStats, MirroredGates, Routers
from .kv_cache import CacheView
from .layers import FeedForward, make_norm, MoEFeedForward, RMSNorm
from .ssm import SelectiveSSM
from midlayer.ops import fused_rows, kernels, row_linear


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        # the token mixer: attention, or a selective state-space mixer in the blocks of `ssm_layers`
        self.layer = layer
        if layer in cfg.ssm_layers:
            self.mixer = SelectiveSSM(cfg)
        else:
            self.attention = Attention(cfg, layer)
            self.mixer = None
        self.feed_forward = (FeedForward(cfg.dim, cfg.ffn_hidden_dim, cfg.ffn_type) if not cfg.moe_experts else
                             MoEFeedForward(cfg.dim, cfg.ffn_hidden_dim, cfg.ffn_type, cfg.moe_experts, cfg.moe_top_k))
        self.attention_norm = make_norm(cfg)
        self.ffn_norm = make_norm(cfg)
        self.placement = cfg.norm_placement
        self.sandwich = self.placement == "sandwich"
        if self.sandwich:  # peri-LN: also normalise each module's output before it joins the residual
            self.attention_out_norm = make_norm(cfg)
            self.ffn_out_norm = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout else None
        # set by quantization.compress_block: this block runs as ONE C call over a KV cache (kernels.block_q4)
        self.fused_q4: kernels.BlockQ4 | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                gate: torch.Tensor | None = None, key_bias: torch.Tensor | None = None,
                cache: CacheView | None = None, *, carry: torch.Tensor | None = None,
                defer: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """a = x + g * Attn(x), h = a + g * FFN(a), with the norm scheme inside (paper section 2):
        pre-LN x + M(N(x)); sandwich/peri-LN x + N(M(N(x))); post-LN N(x + M(x)) (Vaswani et al. 2017;
        refused for gated models, config.py). Dropout (training) on M's output before the residual add.

        defer: return (h, g * FFN(a)) with the last residual add left undone (None: nothing left, post-LN and
        q4's one C call), for the next block to take as `carry`: its input is then x + carry. The static
        step's kernels do that add and this block's first norm as one kernel (ops/fused_rows.add_rms_norm), or,
        where its linears run the row-linear kernel, that add, the norm, q|k|v, RoPE and the K/V store
        (Attention.project: ops/row_linear.norm_linear, as the FFN's add, norm and first projection);
        elsewhere it is the same add, one block later (the same bits)."""
        post = self.placement == "post"
        xin = q = None
        if (fused_rows.PROLOGUES and not post and self.mixer is None and isinstance(self.attention_norm, RMSNorm)
                and self.attention.projects(x, cache)):
            # the static step's kernels with its linears: the carried add, this norm, q|k|v, RoPE and the K/V
            # store, one kernel
            x, q = self.attention.project(x, carry, self.attention_norm, cos, sin, cache)
            xin, carry = x, None  # (xin: the shape and dtype Attention reads beside its ready queries)
        if carry is not None:
            if not post and fused_rows.applies(x) and isinstance(self.attention_norm, RMSNorm):
                x, xin = fused_rows.add_rms_norm(x, carry, self.attention_norm.weight, self.attention_norm.eps)
            else:
                x = x + carry
        if (self.fused_q4 is not None and q is None and gate is None and key_bias is None and cache is not None
                and cache.direct and x.device.type == "cpu" and x.dtype == torch.float32
                and not torch.is_grad_enabled() and cache.k_buffer.dtype in kernels.KV_DTYPES):
            out = self._forward_fused(x, cos, sin, cache)
            return (out, None) if defer else out
        if xin is None:
            xin = x if post else self.attention_norm(x)
        if self.mixer is None:
            a = self.attention(xin, cos, sin, key_bias, cache, q=q)
        elif cache is None:
            a = self.mixer(xin)
        else:  # the view hands out the mixer's state (generation) or refuses (explicit-mask passes)
            a = self.mixer(xin, *cache.ssm_inputs(self.layer, self.mixer, xin))
        if self.sandwich:
            a = self.attention_out_norm(a)
        if self.drop is not None:
            a = self.drop(a)
        if gate is not None:
            a = a * gate[..., None].to(a.dtype)
        if post:
            h = hn = self.attention_norm(x + a)
        elif (fused_rows.PROLOGUES and isinstance(self.ffn_norm, RMSNorm)
              and fused_rows.fuses_linear(x, getattr(self.feed_forward, "w13", None))):  # (a fused GLU's first)
            # the static step's kernels with its linears: the residual add, the FFN's norm and w13, one kernel
            h, ab = row_linear.norm_linear(x, a, self.ffn_norm.weight, self.ffn_norm.eps,
                                           self.feed_forward.w13.weight)
            hn = None
        elif fused_rows.applies(x) and isinstance(self.ffn_norm, RMSNorm):  # (the static step's kernels: one)
            h, hn = fused_rows.add_rms_norm(x, a, self.ffn_norm.weight, self.ffn_norm.eps)
        else:
            h = x + a
            hn = self.ffn_norm(h)
        f = self.feed_forward(hn) if hn is not None else self.feed_forward.down(ab)
        if self.sandwich:
            f = self.ffn_out_norm(f)
        if self.drop is not None:
            f = self.drop(f)
        if gate is not None:
            f = f * gate[..., None].to(f.dtype)
        if post:
            out = self.ffn_norm(h + f)
            return (out, None) if defer else out
        return (h, f) if defer else h + f

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view) -> torch.Tensor:
        """The pre-norm or sandwich path above for a q4 block over the KV cache, as one C call: bit-identical
        to it (the same kernels in the same order), without ~15 Python calls per block -- 4.5 of the 8.6 ms
        of a SmolLM2-135M decode step were that Python (benchmarks/step_parts.py, docs/results/decode-cpu.md)."""
        mask = view.finish(x.shape[1], x.device)  # records what the forward commits; the C call stores the K/V
        return kernels.block_q4(x, self.fused_q4, cos, sin, view.k_buffer, view.v_buffer, view.query_slots, mask,
                                view.length)


# step(layer, block, h, gate, key_bias) -> h: how one forward's rows go through a block (Transformer.run_blocks)
BlockStep = Callable[[int, "Block", torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


def causal_step(cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor | None = None) -> BlockStep:
    """The step of a forward without a cache: causal (gated, eq. 3) attention over the rows themselves;
    `bias` [1, H, T, T]: a relative position bias (ALiBi, T5) added to every block's logits."""
    def step(layer: int, block: Block, h: torch.Tensor, gate: torch.Tensor | None,
             key_bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None:
            key_bias = bias if key_bias is None else key_bias + bias
        return block(h, cos, sin, gate, key_bias)
    return step


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V] (None when only the loss was asked for)
    loss: torch.Tensor | None  # mean cross-entropy over target positions (targets == -100 ignored)
    gate_stats: GateStats | None  # per-block gate statistics, gated models only
    gates: torch.Tensor | None  # [L/2, B, T] first-half gates, gated models only
    hidden_states: list[torch.Tensor] | None  # residual entering each block, then the final residual
    moe_aux: torch.Tensor | None = None  # mixture-of-experts models: mean load-balancing loss of the blocks
    moe_load: torch.Tensor | None = None  # [L, E] share of the assignments per block and expert (detached)


def position_tables(cfg: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables every attention path rotates q and k by: RoPE's (with its scaling), or, for the
    schemes without RoPE (NoPE, absolute embeddings), cos = 1 and sin = 0, i.e. no rotation. With a local RoPE
    base (`rope_theta_local`), [global | local] side by side, [max_seq_len, 2 head_dim]: every step indexes
    the tables by position as before, and each block's attention takes its half (Attention.rope_half)."""
    if cfg.pos_encoding == "rope":
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device, cfg.rope_scaling, cfg.rope_scale)
        if cfg.rope_theta_local:
            lc, ls = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta_local, device, cfg.rope_scaling,
                                 cfg.rope_scale)
            cos, sin = torch.cat([cos, lc], -1), torch.cat([sin, ls], -1)
        return cos, sin
    shape = (cfg.max_seq_len, cfg.head_dim)
    return torch.ones(shape, device=device), torch.zeros(shape, device=device)


def sinusoidal_table(n: int, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017 sec. 3.5: PE[t, 2i] = sin(t / 10000^(2i/d)), PE[t, 2i+1] = cos(t / 10000^(2i/d))."""
    t = torch.arange(n, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pe = torch.zeros(n, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(t * freq)
    pe[:, 1::2] = torch.cos(t * freq[:dim // 2])
    return pe.float()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, init_weights: bool = True) -> None:
        """init_weights=False: a skeleton for a loader that assigns every parameter and then the position
        tables (`pretrained._skeleton`): parameters are left as allocated, no table is computed. On the meta
        device a normal_ draw or an arange imports torch._dynamo, ~0.6-1.3 s of a CLI call's start-up."""
        super().__init__()
        self.cfg = cfg

        def embedding(n: int) -> nn.Embedding:  # (with init_weights, nn.Embedding draws as it always has)
            return nn.Embedding(n, cfg.dim, _weight=None if init_weights else torch.empty(n, cfg.dim))

        self.tok_embeddings = embedding(cfg.vocab_size)
        self.emb_norm = make_norm(cfg) if cfg.embed_norm else nn.Identity()
        self.emb_drop = nn.Dropout(cfg.emb_dropout) if cfg.emb_dropout else nn.Identity()
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.routers = Routers(cfg.dim, cfg.n_layers) if cfg.gating else None
        cos, sin = position_tables(cfg) if init_weights else (None, None)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.pos_embeddings = embedding(cfg.max_seq_len) if cfg.pos_encoding == "learned" else None
        self.pos_bias = PositionBias(cfg) if cfg.pos_encoding in ("alibi", "t5") else None
        self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.dim)
                             if cfg.pos_encoding == "sinusoidal" and init_weights else None, persistent=False)
        self.check_inputs = True  # set False to skip the token-id range check (it syncs with the GPU)
        # where "sampled" gates draw their thresholds in training (ModelConfig.gate_values; None: the global RNG)
        self.gate_generator: torch.Generator | None = None
        if cfg.gating and cfg.gate_attention == "query":
            warnings.warn("gate_attention='query' adds each gate's log to its query's softmax row, a constant that "
                          "hides no token: the public reference code's indexing, for comparison with eq. 3 ('key')",
                          stacklevel=2)
        if init_weights:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Paper 3 / Table 2: norm weights 1 (LayerNorm biases 0), every other parameter (routers included)
        ~ N(0, init_std). init_scheme="scaled_residual" (GPT-2, Radford et al. 2019): the projections that
        write into the residual stream (attention.wo, a state-space mixer's out_proj, the FFN's -- or every
        expert's -- w2) get init_std / sqrt(2 n_layers), so
        the residual's variance does not grow with depth."""
        small = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("norm.bias"):
                nn.init.zeros_(p)
            elif self.cfg.init_scheme == "scaled_residual" and (
                    name.endswith(("attention.wo.weight", "mixer.out_proj.weight"))
                    or (".feed_forward." in name and name.endswith("w2.weight"))):  # experts' w2 too
                nn.init.normal_(p, mean=0.0, std=small)
            else:
                nn.init.normal_(p, mean=0.0, std=self.cfg.init_std)
        for block in self.layers:  # A, D and the step sizes of a state-space mixer have their own init
            if block.mixer is not None:
                block.mixer.reset_ssm_parameters()

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The residual entering block 0: token embedding (x sqrt(dim) with scale_embeddings; + the absolute position embedding of
        `positions`, [T] or [B, T], default 0..T-1), the embedding norm, embedding dropout. Every forward --
        training, cached, drafters' partial ones -- starts here."""
        x = self.tok_embeddings(tokens.long())
        if self.cfg.scale_embeddings:  # Vaswani et al. 2017 sec. 3.4: the embedding layers' weights x sqrt(d_model)
            x = x * math.sqrt(self.cfg.dim)
        table = self.pos_table if self.pos_embeddings is None else self.pos_embeddings.weight
        if table is not None:
            if positions is None:
                positions = torch.arange(tokens.shape[-1], device=tokens.device)
            x = x + table[positions].to(x.dtype)
        return self.emb_drop(self.emb_norm(x))

    def causal(self, T: int) -> BlockStep:
        """The step of a cache-free causal forward over positions 0..T-1: its RoPE tables and position bias."""
        t = torch.arange(T, device=self.rope_cos.device)
        bias = self.position_bias(t, t)
        return causal_step(self.rope_cos[:T], self.rope_sin[:T], None if bias is None else bias[None])

    def position_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """The relative position bias [..., H, Tq, Tk] of ALiBi / T5 between query and key positions, or None
        for the other schemes: every attention path (causal, KV cache, hidden transfer's rows) adds it."""
        return None if self.pos_bias is None else self.pos_bias(q_pos, k_pos)

    def _validate(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"tokens: expected a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"tokens: expected an integer tensor of token ids, got dtype {tokens.dtype}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected shape [batch, seq_len], got {tuple(tokens.shape)}")
        T = tokens.shape[1]
        if T == 0:
            raise ValueError("tokens: empty sequence (seq_len 0)")
        if T > self.cfg.max_seq_len:
            raise ValueError(f"tokens: sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        if self.check_inputs:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"tokens: ids must be in [0, {self.cfg.vocab_size}), got range [{lo}, {hi}]")

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                return_logits: bool = True, output_hidden_states: bool = False) -> ModelOutput:
        """tokens [B, T] -> logits [B, T, V]; with `targets` [B, T] also the mean cross-entropy.

        Gated models also return their first-half gates and per-block `GateStats` (from this same pass, so
        the training loop needs no second forward for the controller).
        """
        self._validate(tokens)
        cfg = self.cfg
        T = tokens.shape[1]
        h = self.embed(tokens)
        states: dict[int, torch.Tensor | None] | None = None
        if output_hidden_states:
            states = dict.fromkeys(range(cfg.n_layers + 1))
        gates = self.gate_walker()
        h = self.run_blocks(h, self.causal(T), gates=gates, capture=states)
        hidden = None if states is None else [states[layer] for layer in range(cfg.n_layers + 1)]
        h = self.norm(h)
        # the head is a third of a tiny model's forward: skipped when nobody reads the logits (the controller's
        # held-out gate statistics, train.py)
        logits = self.output(h) if (return_logits or targets is not None) else None
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1).long(),
                                   ignore_index=-100)
        stats = None
        first = None
        if gates is not None:
            stats = GateStats.from_gates(gates.first_half, cfg.n_layers, gates.router_reads, gates.gate_lin)
            first = torch.stack(gates.first_half)
        aux = load = None
        if cfg.moe_experts:  # every block ran its experts in this pass (gates scale outputs, never skip here)
            ffns = [block.feed_forward for block in self.layers]
            aux = torch.stack([f.aux for f in ffns]).mean()
            load = torch.stack([f.load for f in ffns])
        return ModelOutput(logits if return_logits else None, loss, stats, first, hidden, aux, load)

    def gate_walker(self) -> MirroredGates | None:
        """A fresh in-order gate walker for one forward (None for dense models)."""
        if self.routers is None:
            return None
        return MirroredGates(self.routers, self.cfg.n_layers, self.cfg.gate_grad, self.cfg.gate_values,
                             self.gate_generator)

    def run_blocks(self, h: torch.Tensor, step: BlockStep, *, start: int = 0, stop: int | None = None,
                   gates: MirroredGates | None = None, routed: int | None = None,
                   joins: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
                   capture: dict[int, torch.Tensor | None] | None = None,
                   run: Callable[[int], bool] | None = None) -> torch.Tensor:
        """THE block loop: every forward of this model -- training, prefill, decode, tree verification,
        rows joining mid-network, captures of middle layers, drafters' partial forwards -- runs its blocks
        here. Returns the residual leaving block stop - 1 (stop defaults to L), [B, M, d].

        h [B, M, d]: the residual entering block `start`. For each block l in start..stop-1, in order:
          * `joins[l](h)` -> rows [B, m, d] appended after the present ones (rows joining mid-network);
          * `capture[l]` (when l is a key) <- the residual entering block l (stop: the one leaving the loop);
          * gated models: the gate g of every row (eqs. 1-2) from `gates`, an in-order walker (default: a
            fresh one; pass your own to read its gates afterwards) that refuses to start mid-network. The
            routers read the first `routed` rows (None: the rows present at `start`; 0: no row is routed,
            no walker); later rows have gate 1 and are never skipped. And eq. 3's key bias ln(max(g, eps)),
            computed here and nowhere else;
          * unless `run(l)` is False (a drafter skipping the block: the residual passes unchanged), the
            block itself through `step(l, block, h, gate, key_bias)`, which decides how the rows attend
            (causally, over a KV cache with real skipping, or through an explicit mask).
        Blocks are skipped when no row is present (rows that all join later).
        """
        stop = self.cfg.n_layers if stop is None else stop
        if not 0 <= start <= stop <= self.cfg.n_layers:
            raise ValueError(f"blocks {start}..{stop} outside 0..{self.cfg.n_layers}")
        routed = h.shape[1] if routed is None else routed
        if gates is None and routed > 0:
            gates = self.gate_walker()
        # A cached step may run a stretch of q4 blocks as ONE C call (generate.CachedStep.run_fused): without
        # gates or filters, from a layer up to the next one where rows join or are captured, or to stop.
        fused = getattr(step, "run_fused", None) if gates is None and run is None else None
        marks = sorted(set(capture or ()) | set(joins or ()) | {stop})
        eps = self.cfg.gate_eps
        layer, retry = start, start  # after a refusal, block by block up to the next mark
        while True:
            if joins is not None and layer in joins:
                h = torch.cat([h, joins[layer](h).to(h.dtype)], 1)
            if capture is not None and layer in capture:
                capture[layer] = h
            if layer == stop:
                break
            if fused is not None and layer >= retry and h.shape[1]:
                upto = next(x for x in marks if x > layer)
                out = fused(self.layers, layer, upto, h)
                if out is not None:
                    h, layer = out, upto
                    continue
                retry = upto
            gate = key_bias = None
            if gates is not None:
                gate = gates(layer, h[:, :routed])
                # eq. 3: ln(max(g_j, eps)) per key. Inference with every gate 1 (ln 1 = 0, g * x = x; joined
                # rows have gate 1): the block runs as a dense one -- no bias, no multiply, no skipping test --
                # bit-identical to the dense model (fresh routers, skip_gates.py), on the dense attention
                # kernel and, in the KV cache, the unmasked decode step; and cheaper. Training keeps both:
                # their gradient reaches the gates.
                if gates.open:
                    gate = None
                else:
                    if h.shape[1] > routed:  # joined rows: gate 1
                        gate = torch.cat([gate, gate.new_ones(h.shape[0], h.shape[1] - routed)], 1)
                    key_bias = key_gate_bias(gate, eps, self.cfg.gate_attention)
            if (run is None or run(layer)) and h.shape[1]:
                h = step(layer, self.layers[layer], h, gate, key_bias)
            layer += 1
        return h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def nonfinite_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an infinity, in order. The one rule every weight
    loader applies before using weights (pretrained GGUF / Hugging Face files, drafts): such weights are a
    corrupt file, never something to compute with."""
    def bad(v: torch.Tensor) -> bool:
        # Fast path: a sum that is finite had no NaN or inf among its terms; only a non-finite sum (or an
        # overflow of a finite one) pays for the element-wise test.
        return not bool(torch.isfinite(v.sum())) and not bool(torch.isfinite(v).all())

    return [k for k, v in tensors.items() if v.is_floating_point() and bad(v)]
