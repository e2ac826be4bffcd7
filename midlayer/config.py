"""Configuration: one dataclass per concern, defaults are the paper's numbers.

`ModelConfig` defaults are Table 2 of Lawson & Aitchison, *Learning to Skip the Middle Layers of
Transformers* (arXiv 2506.21103): a Llama-3-style model of GPT-2-small size. `SparsityConfig` holds the
gate-sparsity controller of section 2.4 (gamma, delta from the text below eq. 6). `TrainConfig` holds the
optimiser, schedule and batch of section 3.1 / Table 2.

Named presets (`PRESETS`) are overrides of these three; `get_preset(name)` builds the configs. Every field
is also a command-line flag (see `midlayer.cli`), so this file is the single source of truth for both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any
from midlayer.data.tokenizer import MAX_VOCAB, MIN_VOCAB

NORM_PLACEMENTS = ("pre", "sandwich", "post")
NORM_TYPES = ("rmsnorm", "layernorm", "layernorm_nobias")
FFN_TYPES = ("swiglu", "geglu", "geglu_tanh", "reglu", "relu", "gelu", "silu")  # GLU variants first, then plain MLPs
INIT_SCHEMES = ("normal", "scaled_residual")
POS_ENCODINGS = ("rope", "none", "sinusoidal", "learned", "alibi", "t5")
ROPE_SCALINGS = ("none", "linear", "ntk")
ATTN_BACKENDS = ("auto", "sdpa", "flex")
GATE_ATTENTION = ("key", "query", "none")
# Gradient of the gates (gating.straight_through): eq. 2 as written, or straight through ReLU and clamp.
GATE_GRADS = ("exact", "straight_through")
# what the controller's regulariser differentiates (SparsityConfig.reg_grad): a gate gradient, or the
# straight-through one with the residual stream detached, so that only the routers' weights feel it, or the
# straight-through one only where it points a saturated gate back into (0, 1) (gating.inward_straight_through)
REG_GRADS = (*GATE_GRADS, "straight_through_routers", "straight_through_inward")
# Values of the gates (gating.MirroredGates): eq. 2 as written, or eq. 2's gate rounded to 0 or 1 (issue 15).
GATE_VALUES = ("soft", "hard", "sampled")
CONTROLLERS = ("none", "sparsity", "sparsity_variance", "adaptive", "proportional", "sparsity_variance_l2")
DTYPES = ("auto", "float32", "bfloat16")
PARALLEL = ("ddp", "fsdp")  # TrainConfig.parallel: data-parallel strategies under torchrun


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def check_finite(cfg: Any) -> None:
    """Every float field must be a finite number: argparse's float() accepts 'nan', 'inf' and '1e999', and a
    range check such as `lr > 0` lets inf through (a run that diverges on its first step)."""
    for f in dataclasses.fields(cfg):
        if f.type in ("float", float):
            v = getattr(cfg, f.name)
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), f.name,
                   f"must be a finite number, got {v!r}")


@dataclass
class ModelConfig:
    """Architecture. Defaults: paper Table 2 (the gated 12-layer model, sandwich/peri-LN)."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 12
    head_size: int = 0  # per-head width; 0: dim / n_heads (Qwen3 has wider heads: n_heads * head_size != dim)
    vocab_size: int = 50257
    ffn_dim_multiplier: float = 4.0  # hidden = multiplier * dim, rounded up to `multiple_of`
    multiple_of: int = 256
    ffn_hidden: int = 0  # explicit SwiGLU hidden size (pretrained checkpoints); 0 derives it from the two above
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    pos_encoding: str = "rope"  # rope | none (NoPE) | sinusoidal / learned absolute, added to the embedding |
    #                             alibi / t5: a per-head bias of the query-key distance on the attention logits
    t5_buckets: int = 32  # T5 relative bias: distance buckets (half exact, half log-spaced) ...
    t5_max_distance: int = 128  # ... up to this distance (farther keys share the last bucket)
    rope_scaling: str = "none"  # longer contexts: linear position interpolation (Chen et al. 2023) or
    #                             NTK-aware base scaling (bloc97 2023)
    rope_scale: float = 1.0  # the factor s of rope_scaling: positions / s (linear), theta * s^(d/(d-2)) (ntk)
    max_seq_len: int = 1024
    init_std: float = 0.02  # every non-norm parameter ~ N(0, init_std); norm weights start at 1
    norm_placement: str = "sandwich"  # "pre": x + M(N(x)); "sandwich" (peri-LN): x + N(M(N(x)));
    #                                   "post" (the 2017 Transformer): N(x + M(x))
    norm_type: str = "rmsnorm"  # rmsnorm | layernorm (with bias) | layernorm_nobias, for every norm of the model
    qk_norm: bool = False  # normalise each head's query and key (the norm_type, over head_dim) before RoPE
    ffn_type: str = "swiglu"  # GLU: swiglu | geglu | geglu_tanh (Gemma: GELU's tanh form) | reglu
    #                           (w2(act(w1 x) * w3 x)); MLP: relu | gelu | silu
    #                           (w2 act(w1 x)); the hidden size is the same rule for both (ffn_hidden_dim)
    init_scheme: str = "normal"  # normal: N(0, init_std) everywhere; scaled_residual: the projections that
    #                              write into the residual (wo, w2) get init_std / sqrt(2 n_layers) (GPT-2)
    moe_experts: int = 0  # > 0: every FFN is a mixture of this many experts (each an ffn_type FFN); 0: dense
    moe_top_k: int = 2  # experts per token (Mixtral: 2 of 8; Switch: 1), gates renormalised over them (k=1: raw p_e)
    moe_aux_coef: float = 0.01  # the load-balancing loss's weight in training (Switch Transformer: 0.01)
    ssm_layers: tuple[int, ...] = ()  # blocks whose attention is a selective state-space mixer (ssm.py; hybrids)
    ssm_state: int = 16  # N, state dimensions per inner channel (Mamba: 16)
    ssm_expand: int = 2  # inner channels = ssm_expand * dim (Mamba: 2)
    ssm_conv: int = 4  # the causal depthwise convolution's width (Mamba: 4)
    ssm_dt_rank: int = 0  # rank of the step-size projection; 0: ceil(dim / 16) (Mamba)
    sliding_window: int = 0  # > 0: a query sees only the keys of the last `sliding_window` positions
    #                          (itself included; Mistral / Longformer-style local attention); 0: all
    full_attention_layers: tuple[int, ...] = ()  # with sliding_window: these blocks see every key (Gemma 3:
    #                                             every sixth block global, the others local)
    rope_theta_local: float = 0.0  # RoPE base of the sliding-window blocks when they differ (Gemma 3: 10^4
    #                                locally, rope_theta 10^6 globally); 0: rope_theta everywhere
    dropout: float = 0.0  # on each module's output before it joins the residual (training only)
    attn_dropout: float = 0.0  # on the attention probabilities (training only)
    emb_dropout: float = 0.0  # on the embedding (training only)
    gating: bool = True  # skip-middle routers and gated attention; False is the dense baseline
    gate_eps: float = 1e-6  # floor on g before ln(g) in gated attention (paper 2.2)
    gate_attention: str = "key"  # how gates enter attention: "key" (eq. 3: + ln g_j on key j's logits, hides
    #                              skipped tokens), "query" (+ ln g_i on query i's row, as the public reference
    #                              code does: a row constant, it hides nothing; for comparison), "none"
    gate_grad: str = "exact"  # backward through the gates: "exact" (eq. 2) or "straight_through" (ReLU and
    #                           clamp as identity, gating.straight_through; same forward values; issue 14)
    gate_values: str = "soft"  # "soft": eq. 2's g in [0, 1]; "hard": g = 1 while S < 1/2, else 0 (eq. 2's g
    #                            rounded): every block either runs undamped or is skipped, so all of the
    #                            sparsity is real skipping. Its exact gradient is 0: train it with
    #                            gate_grad="straight_through" (issue 15, docs/results/pretrained-skipping-cpu.md).
    #                            "sampled": in training g = 1 while S < u, u ~ U(0, 1] drawn once per token
    #                            and forward, so E[g] = eq. 2's soft gate and closed states are visited in
    #                            proportion to S; without autograd it is "hard" (u = 1/2). gating.MirroredGates
    attn_backend: str = "auto"  # "auto": FlexAttention on CUDA when available, else SDPA with a key bias
    tie_embeddings: bool = False
    scale_embeddings: bool = False  # token embeddings x sqrt(dim) (Vaswani et al. 2017 sec. 3.4; Gemma): with
    #                                 absolute positions, keeps the token signal on the scale of the position
    #                                 table (unscaled N(0, 0.02) rows are ~1/35 of a sinusoid's RMS 1/sqrt(2))
    embed_norm: bool = True  # RMSNorm after the embedding (the paper's models); Llama checkpoints have none
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2); Llama has none

    def __post_init__(self) -> None:
        """Refuse a bad value by field name.

        Long: one check per field of the model config, in the order of the fields; splitting them would only
        scatter the rules that say which settings combine."""
        check_finite(self)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "multiple_of"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive int, got {v!r}")
            _check(v < 2**31, name, f"must be < 2**31 (a tensor dimension), got {v}")
        _check(self.head_size >= 0, "head_size", f"must be >= 0 (0 = dim / n_heads), got {self.head_size}")
        _check(self.head_size > 0 or self.dim % self.n_heads == 0, "n_heads",
               f"must divide dim={self.dim} (or set head_size), got {self.n_heads}")
        _check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
               f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        _check(self.head_dim % 2 == 0, "n_heads", f"head_dim={self.head_dim} must be even for RoPE")
        _check(self.ffn_hidden >= 0, "ffn_hidden", f"must be >= 0 (0 = derived), got {self.ffn_hidden}")
        _check(self.ffn_dim_multiplier > 0, "ffn_dim_multiplier", f"must be > 0, got {self.ffn_dim_multiplier}")
        _check(self.ffn_hidden_dim > 0, "ffn_dim_multiplier",  # (int(multiplier * dim) rounds 0 up to 0)
               f"{self.ffn_dim_multiplier} x dim {self.dim} gives an FFN of no hidden units; raise it")
        _check(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        _check(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        _check(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")
        _check(0 < self.gate_eps < 1, "gate_eps", f"must be in (0, 1), got {self.gate_eps}")
        _check(self.norm_placement in NORM_PLACEMENTS, "norm_placement",
               f"must be one of {NORM_PLACEMENTS}, got {self.norm_placement!r}")
        _check(self.attn_backend in ATTN_BACKENDS, "attn_backend",
               f"must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        _check(self.pos_encoding in POS_ENCODINGS, "pos_encoding",
               f"must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}")
        _check(self.t5_buckets >= 2 and self.t5_max_distance > self.t5_buckets // 2, "t5_buckets",
               f"needs >= 2 buckets and t5_max_distance > t5_buckets / 2 (the exact buckets; log-spaced ones "
               f"cover the rest), got {self.t5_buckets}, {self.t5_max_distance}")
        _check(not (self.rope_scaling == "ntk" and self.head_dim <= 2), "rope_scaling",
               f"ntk scaling needs head_dim > 2 (base theta * s^(d/(d-2))), got head_dim={self.head_dim}")
        _check(not (self.pos_encoding in ("alibi", "t5") and self.attn_backend == "flex"), "attn_backend",
               f"the FlexAttention path has no {self.pos_encoding} bias; use 'sdpa' or 'auto'")
        _check(self.rope_scaling in ROPE_SCALINGS, "rope_scaling",
               f"must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        _check(self.rope_scale >= 1.0, "rope_scale", f"must be >= 1 (a context s times longer), got {self.rope_scale}")
        _check(self.rope_scaling == "none" or self.pos_encoding == "rope", "rope_scaling",
               f"scales RoPE, but pos_encoding={self.pos_encoding!r}")
        _check(self.rope_scaling != "none" or self.rope_scale == 1.0, "rope_scale",
               f"needs rope_scaling='linear' or 'ntk' to mean anything, got {self.rope_scale} with 'none'")
        _check(self.norm_type in NORM_TYPES, "norm_type", f"must be one of {NORM_TYPES}, got {self.norm_type!r}")
        _check(self.ffn_type in FFN_TYPES, "ffn_type", f"must be one of {FFN_TYPES}, got {self.ffn_type!r}")
        _check(self.init_scheme in INIT_SCHEMES, "init_scheme",
               f"must be one of {INIT_SCHEMES}, got {self.init_scheme!r}")
        self.ssm_layers = tuple(int(i) for i in self.ssm_layers)  # a JSON list from a checkpoint, too
        _check(all(0 <= i < self.n_layers for i in self.ssm_layers) and len(set(self.ssm_layers)) == len(self.ssm_layers),
               "ssm_layers", f"must be distinct block indices in [0, {self.n_layers}), got {list(self.ssm_layers)}")
        _check(not (self.ssm_layers and self.gating), "ssm_layers",
               "skip-middle gating needs every block's skipped tokens to leave no trace, but a state-space mixer's "
               "state absorbs every token it sees: use gating=False with ssm_layers")
        for name in ("ssm_state", "ssm_expand", "ssm_conv"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.ssm_dt_rank >= 0, "ssm_dt_rank", f"must be >= 0 (0 = ceil(dim / 16)), got {self.ssm_dt_rank}")
        _check(self.moe_experts >= 0, "moe_experts", f"must be >= 0 (0 = a dense FFN), got {self.moe_experts}")
        _check(self.moe_top_k >= 1 and (self.moe_experts == 0 or self.moe_top_k <= self.moe_experts), "moe_top_k",
               f"must be in [1, moe_experts={self.moe_experts}], got {self.moe_top_k}")
        _check(self.moe_aux_coef >= 0, "moe_aux_coef", f"must be >= 0, got {self.moe_aux_coef}")
        _check(type(self.sliding_window) is int and self.sliding_window >= 0, "sliding_window",
               f"must be an int >= 0 (0 = full attention), got {self.sliding_window!r}")
        # a window of the whole context is full attention (what a loaded checkpoint's becomes); the engines that
        # refuse windows refused it by name. (Gemma 3's local blocks keep theirs: their RoPE base differs.)
        _check(self.sliding_window < self.max_seq_len or self.rope_theta_local or self.full_attention_layers,
               "sliding_window", f"{self.sliding_window} holds the whole context of {self.max_seq_len}: that is "
               "full attention, 0")
        self.full_attention_layers = tuple(int(i) for i in self.full_attention_layers)
        _check(not self.full_attention_layers or self.sliding_window > 0, "full_attention_layers",
               "names blocks exempt from the sliding window: set sliding_window > 0 too")
        _check(all(0 <= i < self.n_layers for i in self.full_attention_layers)
               and len(set(self.full_attention_layers)) == len(self.full_attention_layers), "full_attention_layers",
               f"must be distinct block indices in [0, {self.n_layers}), got {self.full_attention_layers}")
        _check(self.rope_theta_local >= 0, "rope_theta_local", f"must be >= 0 (0 = rope_theta), got {self.rope_theta_local}")
        _check(not self.rope_theta_local or (self.sliding_window > 0 and self.pos_encoding == "rope"),
               "rope_theta_local", "a local RoPE base needs sliding-window blocks and pos_encoding='rope'")
        for name in ("dropout", "attn_dropout", "emb_dropout"):
            v = getattr(self, name)
            _check(0.0 <= v < 1.0, name, f"a dropout probability must be in [0, 1), got {v}")
        _check(not (self.attn_dropout and self.attn_backend == "flex"), "attn_dropout",
               "FlexAttention has no attention dropout; use attn_backend='sdpa' or attn_dropout=0")
        _check(self.gate_attention in GATE_ATTENTION, "gate_attention",
               f"must be one of {GATE_ATTENTION}, got {self.gate_attention!r}")
        _check(self.gate_grad in GATE_GRADS, "gate_grad", f"must be one of {GATE_GRADS}, got {self.gate_grad!r}")
        _check(self.gate_values in GATE_VALUES, "gate_values",
               f"must be one of {GATE_VALUES}, got {self.gate_values!r}")
        _check(not (self.gate_attention == "query" and self.attn_backend == "flex"), "attn_backend",
               "the FlexAttention path takes key-indexed gate biases only; use 'sdpa' or 'auto' with "
               "gate_attention='query'")
        if self.gating:
            # Block l mirrors block L-1-l (eq. 2), so the layer count must split into two equal halves.
            _check(self.n_layers % 2 == 0, "n_layers",
                   f"a gated model needs an even number of layers (block l mirrors L-1-l), got {self.n_layers}")
            # A skipped block must hand its input on unchanged (g = 0 => h' = h, what real skipping does);
            # post-LN normalises the residual itself, N(h + 0) != h, so skipping would change the token.
            _check(self.norm_placement != "post", "norm_placement",
                   "post-LN normalises the residual after every block, so a skipped block (gate 0) would still "
                   "change the token; gating needs 'pre' or 'sandwich'")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def window_of(self, layer: int) -> int:
        """Block `layer`'s sliding window (0: it sees every key)."""
        return 0 if layer in self.full_attention_layers else self.sliding_window

    @property
    def mixed_windows(self) -> bool:
        """Some blocks are windowed and some global (Gemma 3): no cache can drop a key all blocks are done with."""
        return bool(self.sliding_window and self.full_attention_layers)

    @property
    def ssm_inner(self) -> int:
        """A state-space mixer's inner channels, d_in = ssm_expand * dim."""
        return self.ssm_expand * self.dim

    @property
    def ssm_rank(self) -> int:
        """A state-space mixer's step-size rank R: ssm_dt_rank, or ceil(dim / 16) (Mamba)."""
        return self.ssm_dt_rank or math.ceil(self.dim / 16)

    @property
    def ffn_glu(self) -> bool:
        """The FFN is a gated linear unit (three matrices: w1 gate, w3 up, w2 down), else a two-matrix MLP."""
        return self.ffn_type in ("swiglu", "geglu", "geglu_tanh", "reglu")

    @property
    def ffn_hidden_dim(self) -> int:
        """FFN hidden size: multiplier * dim, rounded up to a multiple of `multiple_of` (Llama). The same rule
        for GLU and MLP types: a GLU FFN then has 3/2 the parameters of an MLP at the same multiplier (set
        ffn_dim_multiplier to 2/3 of the MLP's for equal parameters, as Shazeer 2020 does)."""
        if self.ffn_hidden:
            return self.ffn_hidden
        h = int(self.ffn_dim_multiplier * self.dim)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)

    @property
    def n_routers(self) -> int:
        return self.n_layers // 2 if self.gating else 0


@dataclass
class SparsityConfig:
    """Gate-sparsity controller (paper 2.4, Table 1). Only used by gated models.

    Mean targets run linearly from `mu0` (block 0) to `mu_final` (block L/2-1) and are mirrored over the
    second half; variance targets are mu (1 - mu). The paper sweeps `mu_final` from 1 to 0 (Figure 2);
    0.5 is our default, not a number the paper singles out.
    """

    controller: str = "proportional"
    mu0: float = 1.0
    mu_final: float = 0.5
    gamma: float = 1e-3  # coefficient step (eq. 6)
    delta: float = 1e-2  # dead band: no update while |diff| <= delta (two-sided, as the authors' code)
    alpha: float = 1e-2  # fixed mean coefficient for the non-adaptive `sparsity*` controllers
    beta: float = 1e-2  # fixed variance coefficient for the non-adaptive `sparsity*` controllers
    kp: float = 0.0  # proportional gain (beyond the paper; 0 = eq. 6 alone): the loss coefficient is alpha + kp e
    beta_max: float = 0.0  # bound on |beta| (anti-windup, beyond the paper; 0 = unbounded, eq. 6): soft gates
    #                        cannot reach the variance target mu (1 - mu), the variance of 0/1 gates, so eq. 6
    #                        integrates beta without end, a ramp the mean's integral must keep chasing
    reg_grad: str = "exact"  # what the regulariser differentiates: eq. 4 on the model's gates ("exact"; with
    #                          gate_grad straight_through those are already straight-through) or on their
    #                          straight-through twins (same values; reaches saturated tokens; gating.py);
    #                          "straight_through_routers": the twins with each router's input h detached, so
    #                          the regulariser moves the routers' weights only, never the residual stream;
    #                          "straight_through_inward": eq. 2's gradient, plus the straight-through one
    #                          only for saturated gates the loss would move back into (0, 1)

    def __post_init__(self) -> None:
        check_finite(self)
        _check(self.controller in CONTROLLERS, "controller",
               f"must be one of {CONTROLLERS}, got {self.controller!r}")
        for name in ("mu0", "mu_final"):
            v = getattr(self, name)
            _check(0.0 <= v <= 1.0, name, f"a mean gate target must be in [0, 1], got {v}")
        for name in ("gamma", "delta", "alpha", "beta", "kp", "beta_max"):
            v = getattr(self, name)
            _check(v >= 0, name, f"must be >= 0, got {v}")
        _check(self.reg_grad in REG_GRADS, "reg_grad", f"must be one of {REG_GRADS}, got {self.reg_grad!r}")
        _check(self.kp == 0 or self.controller in ("adaptive", "proportional"), "kp",
               f"the proportional term needs an adaptive controller (adaptive, proportional), got {self.controller!r}")
        _check(self.beta_max == 0 or self.controller in ("adaptive", "proportional"), "beta_max",
               f"bounds an adaptive controller's beta (adaptive, proportional), got {self.controller!r}")


@dataclass
class TrainConfig:
    """Optimisation and run settings. Defaults: paper section 3.1 / Table 2 (FineWeb, 10B tokens)."""

    lr: float = 1e-3
    beta1: float = 0.8
    beta2: float = 0.95
    adam_eps: float = 1e-10
    weight_decay: float = 0.0
    warmup_frac: float = 0.1  # linear warmup over this fraction of steps ...
    warmup_start_factor: float = 0.1  # ... starting at this fraction of lr, then cosine decay to 0
    router_lr_floor: float = 0.0  # after warm-up the routers' lr multiplier stays >= this (1: constant lr), so
    #                               that they can still follow the controller's coefficients in the cosine tail,
    #                               where the paper's schedule leaves them no step to take (issue 14; beyond the
    #                               paper, whose routers share the schedule: 0)
    control_holdout: float = 0.0  # share of the training tokens (the end of every shard) never trained on, from
    #                               which the sparsity controller's update (eq. 6) takes its gate statistics:
    #                               a batch of `control_batch_size` sequences per step, eval mode. 0: the
    #                               training batches, as the paper. Beyond the paper (issue 14): targets then hold
    #                               on unseen tokens; on Shakespeare it does not close the gap to the validation
    #                               works, which is between texts (docs/results/controller-cpu.md, item 14)
    control_batch_size: int = 4  # sequences per step for the held-out statistics (global, over all ranks)
    batch_size: int = 512  # global batch, in sequences (data parallel x grad accumulation)
    micro_batch_size: int = 32  # sequences per forward on one device ("device_batch_size")
    seq_len: int = 1024
    steps: int = 19073  # 10B tokens / (512 x 1024)
    grad_clip: float = 0.0  # 0 disables clipping
    dtype: str = "auto"  # "auto": bf16 autocast on CUDA, fp32 on CPU
    data: str = "shakespeare"  # "shakespeare" (embedded) or a glob of .bin shards, e.g. data/fineweb10B/*.bin
    val_data: str = ""  # glob of validation shards when `data` is a glob
    tokenizer_vocab: int = 4096  # BPE vocab trained on the embedded corpus (ignored for .bin shards)
    eval_tokens: int = 1_000_000  # validation tokens per evaluation (0 = the whole split)
    eval_every: int = 0  # 0: only at the end
    log_every: int = 10
    ckpt_every: int = 0  # 0: only at the end
    keep_last: int = 2
    seed: int = 0
    init_perturb: float = 0.0  # > 0: every initial weight w becomes w (1 + init_perturb z), z ~ N(0, 1) from its own
    #                            generator (data order unchanged): a stand-in for another CPU's rounding (issue 14)
    out_dir: str = "runs/default"
    compile: bool = False
    parallel: str = "ddp"  # how N torchrun processes split the work: "ddp" (each holds the whole model and its
    #                        Adam moments, gradients all-reduced) or "fsdp" (FSDP2: each holds 1/N of every
    #                        parameter, gradient and moment between steps, a block gathered while it runs).
    #                        Ignored in one process. Checkpoints are the same either way: free to change on resume
    grad_norm_spike: float = 0.0  # warn when the grad norm exceeds this multiple of its running mean (0 = off)
    tensorboard: bool = False
    wandb: str = ""  # wandb project name; empty disables

    def __post_init__(self) -> None:
        check_finite(self)
        for name in ("batch_size", "micro_batch_size", "seq_len", "steps", "log_every", "keep_last"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, name, f"must be a positive int, got {v!r}")
        for name in ("eval_tokens", "eval_every", "ckpt_every"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check(0 <= self.seed < 2**64, "seed", f"must be in [0, 2**64), got {self.seed}")  # torch's seed range
        _check(0 <= self.init_perturb < 1, "init_perturb", f"must be in [0, 1), got {self.init_perturb}")
        _check(self.eval_tokens == 0 or self.eval_tokens >= self.seq_len, "eval_tokens",
               f"must be 0 (the whole split) or at least one window of seq_len={self.seq_len} tokens, "
               f"got {self.eval_tokens}")
        _check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "beta1/beta2", "must be in [0, 1)")
        for name in ("adam_eps", "weight_decay", "grad_norm_spike"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _check(0 <= self.warmup_frac < 1, "warmup_frac", f"must be in [0, 1), got {self.warmup_frac}")
        _check(0 < self.warmup_start_factor <= 1, "warmup_start_factor",
               f"must be in (0, 1], got {self.warmup_start_factor}")
        _check(0 <= self.router_lr_floor <= 1, "router_lr_floor", f"must be in [0, 1], got {self.router_lr_floor}")
        _check(0 <= self.control_holdout < 1, "control_holdout", f"must be in [0, 1), got {self.control_holdout}")
        _check(isinstance(self.control_batch_size, int) and self.control_batch_size >= 1, "control_batch_size",
               f"must be a positive int, got {self.control_batch_size!r}")
        _check(self.grad_clip >= 0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.parallel in PARALLEL, "parallel", f"must be one of {PARALLEL}, got {self.parallel!r}")
        _check(bool(self.out_dir.strip()), "out_dir", "must name a folder, got ''")  # '' would mean the cwd

        v = self.tokenizer_vocab
        _check(isinstance(v, int) and not isinstance(v, bool) and MIN_VOCAB <= v <= MAX_VOCAB, "tokenizer_vocab",
               f"must be an int in [{MIN_VOCAB}, {MAX_VOCAB}] (256 bytes + end-of-text + at least one merge; ids "
               f"must fit uint16 shards), got {v!r}")
        _check(self.batch_size % self.micro_batch_size == 0, "batch_size",
               f"must be a multiple of micro_batch_size={self.micro_batch_size}, got {self.batch_size}")

    @property
    def warmup_steps(self) -> int:
        return int(self.warmup_frac * self.steps)


# Presets: name -> overrides of each config. `paper-*` follow Table 2; dense baselines keep the gated
# model's sandwich norm so that the only difference from the gated model is the gating itself.
_TINY_MODEL = dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=4, vocab_size=4096, max_seq_len=256,
                   multiple_of=32)
_TINY_TRAIN = dict(lr=3e-3, batch_size=16, micro_batch_size=16, seq_len=256, steps=250, eval_tokens=200_000,
                   log_every=20, out_dir="runs/tiny")

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # (each preset's runs go to runs/<preset> unless --out-dir says otherwise: README, "Where results go")
    "paper-12l": {"model": {}, "train": {"out_dir": "runs/paper-12l"}},
    **{f"paper-dense-{n}": {"model": {"n_layers": n, "gating": False}, "train": {"out_dir": f"runs/paper-dense-{n}"}}
       for n in range(2, 13)},
    # Trains on a 2-core CPU at several thousand tokens/s (see `midlayer bench train`).
    "tiny": {"model": dict(_TINY_MODEL), "train": dict(_TINY_TRAIN)},
    "tiny-dense": {"model": dict(_TINY_MODEL, gating=False), "train": dict(_TINY_TRAIN, out_dir="runs/tiny-dense")},
    # For unit tests: seconds on a CPU.
    "debug": {"model": dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64,
                            multiple_of=16),
              "train": dict(batch_size=4, micro_batch_size=2, seq_len=32, steps=20, eval_tokens=2048,
                            tokenizer_vocab=512, log_every=5, out_dir="runs/debug")},
}


def get_preset(name: str, **sections: dict[str, Any]) -> tuple[ModelConfig, SparsityConfig, TrainConfig]:
    """Build (model, sparsity, train) configs for a named preset, with optional per-section overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    p = PRESETS[name]
    unknown = set(sections) - {"model", "sparsity", "train"}
    if unknown:
        raise ValueError(f"unknown config sections {sorted(unknown)}")
    return (
        ModelConfig(**{**p.get("model", {}), **sections.get("model", {})}),
        SparsityConfig(**{**p.get("sparsity", {}), **sections.get("sparsity", {})}),
        TrainConfig(**{**p.get("train", {}), **sections.get("train", {})}),
    )


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Rebuild a config from a dict, refusing unknown keys (e.g. a checkpoint from another version)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**d)


__all__ = ["ModelConfig", "SparsityConfig", "TrainConfig", "PRESETS", "get_preset", "to_dict", "from_dict",
           "check_finite"]
