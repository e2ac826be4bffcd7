"""A selective state-space mixer (Mamba, Gu & Dao 2023, arXiv 2312.00752, sec. 3 and Algorithm 2), usable in
place of attention in chosen blocks (`ModelConfig.ssm_layers`: hybrids).

Per token t, with d_in = expand * dim inner channels, N state dimensions per channel and R = dt_rank:

    [u ; z]  = W_in x_t                                   (dim -> 2 d_in)
    u        = SiLU(causal depthwise conv_k(u)_t)          (kernel `ssm_conv` over the last k tokens)
    Delta_t  = softplus(W_dt (W_x u)_{:R} + b_dt)           [d_in], the step size: selective, per token
    B_t, C_t = (W_x u)_{R:R+N}, (W_x u)_{R+N:}               [N] each, also per token
    h_t      = exp(Delta_t A) * h_{t-1} + (Delta_t u_t) B_t  [d_in, N], A = -exp(A_log) < 0 (a decay)
    y_t      = h_t C_t + D * u_t                             [d_in]
    out      = W_out (y_t * SiLU(z_t))                       (d_in -> dim)

No position encoding: order enters through the recurrence (and the convolution). Three ways to compute the
same scan:
  * `scan_sequential`: the recurrence token by token -- the naive reference, and on CPU the fastest;
  * `scan_chunked`: chunks of `chunk` tokens, every chunk's positions at once from a zero state with the
    decay products since its start, then the state carried from chunk to chunk and added in (the two-level
    form of a linear recurrence's scan, Blelloch 1990) -- what training and prefill use on a GPU;
  * one token with the state kept in the KV cache (`SSMState`): constant memory per sequence whatever its
    length, (k - 1) d_in for the convolution and d_in N for h.
Tested equal to each other in tests/test_parts.py. Pure PyTorch; no fused kernel (Mamba's hardware-aware
scan is a CUDA kernel).

Where it does not fit, it is refused: skip-middle gating (a skipped token must leave no trace, but a state
absorbs every token it sees), and speculative decoding / drafters (a state cannot be rolled back to a draft
tree's accepted path the way KV slots are dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from midlayer.config import ModelConfig


@dataclass
class SSMState:
    """One sequence batch's state of one SSM layer in generation: the last k - 1 inputs of the convolution
    [B, d_in, k - 1] and h [B, d_in, N]."""

    conv: torch.Tensor
    h: torch.Tensor


def scan_sequential(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (module docstring). u, delta [Bt, T, d_in]; A [d_in, N]; B, C [Bt, T, N].
    Returns (y without the D term [Bt, T, d_in], the last state [Bt, d_in, N])."""
    Bt, T, D = u.shape
    h = u.new_zeros(Bt, D, A.shape[1]) if h0 is None else h0
    ys = []
    for t in range(T):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def scan_chunked(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 h0: torch.Tensor | None = None, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The same scan, `chunk` tokens at a time (module docstring): the same (y, last state) as
    `scan_sequential` up to float rounding, in about chunk + T / chunk steps of whole-tensor work instead of
    T. With a_t = exp(Delta_t A) and b_t = Delta_t u_t B_t, h_t = a_t h_{t-1} + b_t. Inside every chunk at once
    (one loop over the chunk's positions): the state from a zero start, loc_t, and the decay since the chunk's
    start, P_t = prod a; across chunks (one loop over chunks): the state entering each; then
    h_t = loc_t + P_t h_in. Only products of decays in (0, 1] are formed, so nothing can overflow (a masked
    segment sum exp(S_t - S_s) needs a mask before its exp and costs chunk / 2 times the work: the form this
    replaced, 10x slower on CPU). Memory: a few [Bt, T, d_in, N] tensors."""
    Bt, T, D = u.shape
    N = A.shape[1]
    h = u.new_zeros(Bt, D, N) if h0 is None else h0
    chunk = max(1, min(chunk, T))
    pad = (-T) % chunk  # padded steps are the identity (a = 1, b = 0): the last state is h_T
    a = torch.exp(delta[..., None] * A)  # [Bt, T, d_in, N]
    b = (delta * u)[..., None] * B[:, :, None, :]
    if pad:
        a = F.pad(a, (0, 0, 0, 0, 0, pad), value=1.0)
        b = F.pad(b, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, pad))
    n = (T + pad) // chunk
    a, b = a.view(Bt, n, chunk, D, N), b.view(Bt, n, chunk, D, N)
    loc, dec = [b[:, :, 0]], [a[:, :, 0]]
    for i in range(1, chunk):  # every chunk at once, from a zero state
        loc.append(a[:, :, i] * loc[-1] + b[:, :, i])
        dec.append(dec[-1] * a[:, :, i])
    loc_t, dec_t = torch.stack(loc, 2), torch.stack(dec, 2)  # [Bt, n, chunk, d_in, N]
    carry = []
    for c in range(n):  # the state entering chunk c, then leaving it
        carry.append(h)
        h = dec[-1][:, c] * h + loc[-1][:, c]
    hs = loc_t + dec_t * torch.stack(carry, 1)[:, :, None]
    y = (hs * C.view(Bt, n, chunk, 1, N)).sum(-1).reshape(Bt, n * chunk, D)[:, :T]
    return y, h


class SelectiveSSM(nn.Module):
    """The Mamba mixer of the module docstring. Parameter names follow the reference implementation's
    (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.d_in, self.N, self.k, self.R = cfg.dim, cfg.ssm_inner, cfg.ssm_state, cfg.ssm_conv, cfg.ssm_rank
        self.chunk = 16
        self.in_proj = nn.Linear(d, 2 * self.d_in, bias=False)
        self.conv1d = nn.Conv1d(self.d_in, self.d_in, self.k, groups=self.d_in, padding=0, bias=True)
        self.x_proj = nn.Linear(self.d_in, self.R + 2 * self.N, bias=False)
        self.dt_proj = nn.Linear(self.R, self.d_in, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.d_in, self.N))
        self.D = nn.Parameter(torch.ones(self.d_in))
        self.out_proj = nn.Linear(self.d_in, d, bias=False)

    def reset_ssm_parameters(self) -> None:
        """Mamba's S4D-real initialisation (A_n = -(n + 1)), D = 1, and step sizes between 1e-3 and 1e-1
        (softplus^-1 of a log-uniform draw in the dt_proj bias): what `Transformer.reset_parameters` calls
        after its generic init, which would make A, D and the step sizes meaningless."""
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.arange(1, self.N + 1, dtype=torch.float32)).expand(self.d_in, -1))
            self.D.fill_(1.0)
            dt = torch.exp(torch.rand(self.d_in) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def _project(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dbc = self.x_proj(u)
        delta = F.softplus(self.dt_proj(dbc[..., :self.R]))
        return delta, dbc[..., self.R:self.R + self.N], dbc[..., self.R + self.N:]

    def forward(self, x: torch.Tensor, state: SSMState | None = None, valid: torch.Tensor | None = None,
                scan: str = "auto") -> torch.Tensor:
        """x [Bt, T, dim] -> [Bt, T, dim]. With `state` (generation): continue from it and update it in
        place. `valid` [Bt, T] (generation): only the True entries are tokens, in order and first in each
        row; the others leave the state unchanged. `scan`: "sequential", "chunked", or "auto": sequential on
        CPU, chunked elsewhere. Why: on CPU the token loop's [Bt, d_in, N] steps stay in cache and it is the
        fastest (forward + backward at the parts sweep's shapes, Bt 16, T 256, d_in 256, N 16, AMD EPYC AVX2,
        2 threads: the chunked form takes 4.6-6.4x the sequential's time, `python benchmarks/ssm_scan.py`);
        on a GPU T small kernels are the cost the chunked form removes."""
        if scan not in ("auto", "sequential", "chunked"):
            raise ValueError(f"scan must be 'auto', 'sequential' or 'chunked', got {scan!r}")
        Bt, T, _ = x.shape
        uz = self.in_proj(x)
        u, z = uz[..., :self.d_in], uz[..., self.d_in:]
        if valid is not None:
            u = u * valid[..., None].to(u.dtype)
        ut = u.transpose(1, 2)  # [Bt, d_in, T]
        prev = ut.new_zeros(Bt, self.d_in, self.k - 1) if state is None else state.conv
        padded = torch.cat([prev, ut], 2)
        u = F.silu(F.conv1d(padded, self.conv1d.weight, self.conv1d.bias, groups=self.d_in)).transpose(1, 2)
        delta, B, C = self._project(u)
        if valid is not None:  # a non-token leaves h unchanged: step size 0 (decay 1, no input)
            delta = delta * valid[..., None].to(delta.dtype)
        A = -torch.exp(self.A_log.float())
        if scan == "auto":
            scan = "sequential" if x.device.type == "cpu" else "chunked"
        run = scan_sequential if scan == "sequential" else (lambda *a: scan_chunked(*a, chunk=self.chunk))
        y, h = run(u.float(), delta.float(), A, B.float(), C.float(), None if state is None else state.h)
        if state is not None:
            state.h = h
            if valid is None:
                state.conv = padded[:, :, padded.shape[2] - (self.k - 1):]
            else:  # per row, the last k - 1 inputs among its previous ones and its valid new ones
                n = valid.sum(1)
                state.conv = torch.stack([padded[b, :, int(n[b]):int(n[b]) + self.k - 1]
                                          if self.k > 1 else padded[b, :, :0] for b in range(Bt)])
        y = (y.to(x.dtype) + self.D * u) * F.silu(z)
        return self.out_proj(y)

    def new_state(self, batch: int, device: torch.device, dtype: torch.dtype = torch.float32) -> SSMState:
        """A zero state; the convolution's inputs in the activations' dtype, h in fp32 (the scan's)."""
        return SSMState(torch.zeros(batch, self.d_in, self.k - 1, device=device, dtype=dtype),
                        torch.zeros(batch, self.d_in, self.N, device=device, dtype=torch.float32))


def ssm_param_count(cfg: ModelConfig) -> int:
    """Parameters of one SelectiveSSM (module docstring): in_proj, conv (+ bias), x_proj, dt_proj (+ bias), A, D,
    out_proj."""
    d, D, N, k, R = cfg.dim, cfg.ssm_inner, cfg.ssm_state, cfg.ssm_conv, cfg.ssm_rank
    return d * 2 * D + D * k + D + D * (R + 2 * N) + R * D + D + D * N + D + D * d


def ssm_flops_per_token(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of one SelectiveSSM as the sequential recurrence does them: the projections (2 per
    multiply-add), the convolution, per state entry the discretisation exp(Delta A) (2), the update (4: two
    products, the input product, the add) and the read-out (2), the D term and the gate. The chunked scan
    (training and prefill off CPU) does about twice the update's work (its decay products and the
    correction by the entering state); this counts the recurrence, the model's arithmetic, as the attention
    terms count exact attention."""
    d, D, N, k, R = cfg.dim, cfg.ssm_inner, cfg.ssm_state, cfg.ssm_conv, cfg.ssm_rank
    return 2 * d * 2 * D + 2 * k * D + 2 * D * (R + 2 * N) + 2 * R * D + 6 * D * N + 2 * D * N + 6 * D + 2 * D * d


__all__ = ["SelectiveSSM", "SSMState", "scan_sequential", "scan_chunked", "ssm_param_count", "ssm_flops_per_token"]
