"""Gated DeltaNet, the linear-attention layer of the Qwen3.5 / Qwen3-Next hybrids: a recurrent
layer whose state has a fixed size however long the context.

One token, per value head h with state S [dk, dv] (../shared/reference/hybrid-moe-eagle3.md, 1.5):

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

q and k are L2-normalised (q also scaled by 1/sqrt(dk)); g = -exp(A_log) softplus(a + dt_bias) <= 0
is the log-decay and beta = sigmoid(b) the write strength. Before that q|k|v pass a causal
depthwise convolution of K taps and SiLU, whose state is the last K-1 inputs. Afterwards o goes
through a per-head RMS norm gated by silu(z), then the output projection.

Two forms of the same scan: `scan` runs token by token, with the arithmetic of a one-token step
for every row (so a verify block can be row-exact, and the state after every row is at hand);
`scan_chunked` runs chunks of 64 tokens as a few matmuls (prefill). Elementwise gates run in
float64 on their few values, so that a row's bits never depend on how many rows share the call
(ATen computes a tensor's tail with scalar code, the rest with vector code).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import LinearAttentionShape, ModelConfig
from .layers import DecoderLayer, GatedMLP, RMSNorm, frozen
from .linear import Linear
from .recurrent_state import RecurrentState

CHUNK = 64  # tokens per chunk of the chunked form


def _l2_scale(x: Tensor) -> Tensor:
    """1 / ||x|| over the last dim, as FLA and transformers compute it (eps 1e-6), in float64."""
    return torch.rsqrt((x * x).sum(-1, keepdim=True).double() + 1e-6).float()


class GatedDeltaNet(nn.Module):
    """The layer from prepared weights: `in_proj` yields [q | k | v | z | b | a] rows (Qwen3.5's
    split order; Qwen3-Next's grouped tensors are reordered at load), `conv` [conv_dim, K]."""

    def __init__(self, shape: LinearAttentionShape, in_proj: Linear, conv: Tensor, A_log: Tensor, dt_bias: Tensor,
                 norm: Tensor, out: Linear, eps: float):
        super().__init__()
        self.shape, self.in_proj, self.out, self.eps = shape, in_proj, out, eps
        self.conv = frozen(conv.float().contiguous())
        self.decay_rate = frozen(A_log.double().exp())  # exp(A_log), kept in float64 (see the module doc)
        self.dt_bias = frozen(dt_bias.double())
        self.norm = frozen(norm.float())

    @property
    def state_width(self) -> int:
        """Columns of a projected row that the state needs: q|k|v (the convolution's input), b, a."""
        return self.shape.conv_dim + 2 * self.shape.v_heads

    def project(self, h: Tensor, exact: bool = False) -> tuple[Tensor, Tensor]:
        """h [T, dim] -> (the state's inputs [T, state_width] as q|k|v|b|a, z [T, Hv * dv]), float32."""
        s = self.shape
        y = self.in_proj(h, exact).float()
        C, V = s.conv_dim, s.value_dim
        return torch.cat([y[:, :C], y[:, C + V:]], dim=1), y[:, C:C + V]

    def _prepare(self, conv_state: Tensor, rows: Tensor) -> tuple[Tensor, ...]:
        """Convolution and gates of `rows` [T, state_width] after `conv_state` [K-1, C]: q, k [T, Hv, dk]
        (normalised, q scaled), v [T, Hv, dv], the log-decay g, the decay exp(g) and beta [T, Hv], and
        the convolution's window [K-1+T, C] (its last K-1 rows are the new conv state)."""
        s = self.shape
        K, C, T = s.conv_kernel, s.conv_dim, rows.shape[0]
        window = torch.cat([conv_state, rows[:, :C]])  # [K-1+T, C]
        acc = window[0:T] * self.conv[:, 0]
        for tap in range(1, K):  # one tap at a time, in order: a row's sum never depends on T
            acc = acc + window[tap:tap + T] * self.conv[:, tap]
        x = F.silu(acc.double()).float()
        kd = s.k_heads * s.k_dim
        r = s.v_heads // s.k_heads
        q = x[:, :kd].view(T, s.k_heads, s.k_dim)
        k = x[:, kd:2 * kd].view(T, s.k_heads, s.k_dim)
        v = x[:, 2 * kd:].view(T, s.v_heads, s.v_dim)
        q = q * (_l2_scale(q) * s.k_dim ** -0.5)
        k = k * _l2_scale(k)
        if r > 1 and s.tiled:  # value head h reads key head h % K (a GGUF's order: gguf_archs.py)
            q, k = q.repeat(1, r, 1), k.repeat(1, r, 1)
        elif r > 1:  # value head h reads key head h // r
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        b, a = rows[:, C:C + s.v_heads].double(), rows[:, C + s.v_heads:].double()
        g = -self.decay_rate * F.softplus(a + self.dt_bias)
        return q, k, v, g.float(), g.exp().float(), torch.sigmoid(b).float(), window

    def scan(self, conv_state: Tensor, ssm: Tensor, rows: Tensor, outputs: bool = True, keep: bool = False
             ) -> tuple[Tensor | None, Tensor, Tensor, list[tuple[Tensor, Tensor]] | None]:
        """Token by token from (conv_state, ssm [Hv, dk, dv]) over `rows`: (o [T, Hv, dv] or None,
        conv state, ssm state, and with `keep` the (conv, ssm) state after each row)."""
        q, k, v, _, decay, beta, window = self._prepare(conv_state, rows)
        K = self.shape.conv_kernel
        out, kept = [], [] if keep else None
        for t in range(rows.shape[0]):
            ssm = ssm * decay[t, :, None, None]
            kv = torch.bmm(k[t, :, None, :], ssm)[:, 0]  # S^T k per head: [Hv, dv]
            u = (v[t] - kv) * beta[t, :, None]
            ssm = ssm + k[t, :, :, None] * u[:, None, :]
            if outputs:
                out.append(torch.bmm(q[t, :, None, :], ssm)[:, 0])
            if keep:
                kept.append((window[t + 1:t + K], ssm))
        o = torch.stack(out) if outputs else None
        return o, window[rows.shape[0]:], ssm, kept

    def scan_chunked(self, conv_state: Tensor, ssm: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The same recurrence over chunks of CHUNK tokens: within a chunk, with Γ the cumulative
        log-decay and D_ij = exp(Γ_i - Γ_j) (j <= i), the delta rule's updates are condensed by
        solving (I + strict_lower(β K Kᵀ ⊙ D)) once; the state is carried from chunk to chunk."""
        q, k, v, g, _, beta, window = self._prepare(conv_state, rows)
        T, c = rows.shape[0], CHUNK
        pad = (-T) % c
        # [Hv, chunks, c, d]
        q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, c)) for x in (q, k, v))
        log_decay = F.pad(g.transpose(0, 1), (0, pad)).unflatten(1, (-1, c))
        beta = F.pad(beta.transpose(0, 1), (0, pad)).unflatten(1, (-1, c))
        gamma = log_decay.cumsum(-1)  # [Hv, chunks, c]
        causal = torch.ones(c, c, dtype=torch.bool, device=rows.device).tril()
        D = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = k * beta[..., None]
        system = (kb @ k.transpose(-1, -2) * D).tril(-1) + torch.eye(c, device=rows.device)
        U = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(system, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
        inner = q @ k.transpose(-1, -2) * D
        q_decayed = q * gamma.exp()[..., None]
        last = gamma[..., -1:]
        k_to_end = k * (last - gamma).exp()[..., None]
        outs = []
        for i in range(q.shape[1]):
            v_new = U[:, i] - W[:, i] @ ssm
            outs.append(q_decayed[:, i] @ ssm + inner[:, i] @ v_new)
            ssm = ssm * last[:, i, :, None].exp() + k_to_end[:, i].transpose(-1, -2) @ v_new
        o = torch.cat(outs, dim=1)[:, :T].transpose(0, 1)  # [T, Hv, dv]
        return o, window[T:], ssm

    def output(self, o: Tensor, z: Tensor, dtype: torch.dtype, exact: bool = False) -> Tensor:
        """The gated per-head norm, w * rms_norm(o) * silu(z), and the output projection -> [T, dim]."""
        T, Hv, dv = o.shape
        normed = F.rms_norm(o, (dv,), self.norm, self.eps)
        gated = normed * F.silu(z.view(T, Hv, dv).double()).float()
        return self.out(gated.reshape(T, Hv * dv).to(dtype), exact)


class RecurrentDecoderLayer(DecoderLayer):
    """Pre-norm residual layer around a Gated DeltaNet (`mixer`): x + mixer(norm(x)), then the MLP.
    Its state lives in the model's RecurrentState (recurrent_state.py), as layer `j` of it."""

    @property
    def mixer(self) -> GatedDeltaNet:
        return self.attention

    def forward(self, x: Tensor, state: RecurrentState, j: int, dtype: torch.dtype, exact: bool = False,
                chunked: bool = False) -> Tensor:
        """x: the float32 residual stream [T, dim]; `chunked`: the chunked form (prefill), else token
        by token (every row with a one-token step's arithmetic; `exact` also makes its matmul rows so)."""
        mixer = self.mixer
        rows, z = mixer.project(self.attn_norm(x).to(dtype), exact)
        conv, ssm = state.state_before(j, mixer)
        if chunked:
            o, conv, ssm = mixer.scan_chunked(conv, ssm, rows)
            after = None
        else:
            o, conv, ssm, after = mixer.scan(conv, ssm, rows, keep=state.keeps_snapshots)
        state.record(j, conv, ssm, rows, after)
        x = x + mixer.output(o, z, dtype, exact)
        return self.feed_forward(x, dtype, exact)


def recurrent_layer(cfg: ModelConfig, w: dict) -> RecurrentDecoderLayer:
    """A linear-attention layer from prepared weights: Linear `in_proj` (q|k|v|z|b|a rows) and `out`;
    tensors `conv` [conv_dim, K], `A_log`, `dt_bias`, `gate_norm`, `attn_norm`, `mlp_norm` (see
    weights.build_recurrent_layer)."""
    eps = cfg.norm_eps
    mixer = GatedDeltaNet(cfg.linear, w["in_proj"], w["conv"], w["A_log"], w["dt_bias"], w["gate_norm"], w["out"], eps)
    return RecurrentDecoderLayer(RMSNorm(w["attn_norm"], eps), mixer, RMSNorm(w["mlp_norm"], eps),
                                 w.get("mlp") or GatedMLP(w["gate_up"], w["down"]))
