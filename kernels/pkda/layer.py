"""A PKDA attention layer and a small two-layer language model around it, in plain PyTorch.

Self-contained on purpose (it imports torch only, never `kernels`): the harness loads this file by
path from its own checkout, so both sides of a training comparison run the same model code, and
only the attention function (`chunk_precond_kda` of each side's worktree) differs. The function is
a constructor argument:

    model = PKDAModel(vocab=..., hidden=..., heads=..., head_dim=..., attn_fn=chunk_precond_kda)
    loss = model(input_ids, labels=labels, cu_seqlens=cu_seqlens)

`attn_fn(q, k, v, g, g_atk, beta_atk, beta, scale=..., cu_seqlens=..., log_atk_scale=...)` has the
public op's contract (design note pkda.md) and returns `o` or a tuple whose first item is `o`.

The layer (as models use the op): from the hidden state x [B, T, hidden],
    q, k  = x W_q, x W_k                      [B, T, H, head_dim]   (the op L2-normalises them)
    v     = x W_v                             [B, T, H, head_dim]
    g     = logsigmoid(x W_g + b_g)           [B, T, H, head_dim]   per-channel log decay
    g_atk = logsigmoid(x W_ga + b_ga)         [B, T, H]             scalar log decay per head
    beta, beta_atk = sigmoid(x W_b), sigmoid(x W_ba)  [B, T, H]
    log_atk_scale                             [H] parameter (init -0.2, the op's default)
    o     = W_o RMSNorm_head(attn(...))
q, k, v enter the op in `attn_dtype` (bf16 on GPU for the benchmark, fp32 on CPU); gates, betas
and log_atk_scale stay fp32; the op's output is cast back to the parameters' dtype (fp32).

The model: token embedding, `layers` pre-norm blocks (x += attn(norm(x)); x += mlp(norm(x)), the
MLP a SwiGLU of width `mlp_ratio * hidden`), a final RMS norm and an untied LM head. No positional
embedding (the recurrence orders tokens). Loss: mean cross entropy over every position.

Varlen packing (`varlen_cu_seqlens`): a batch of B rows of T tokens is flattened into one stream
[1, B*T] and split into documents at fixed boundaries every `context_len` tokens (the last document
takes the remainder), i.e. cu_seqlens = [0, c, 2c, ..., B*T]. With B=1 and context_len=T this is one
document and equals the dense run; with context_len < T the documents are independent sequences
(no state crosses a boundary), which equals running them as separate batch rows.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class PKDAAttention(nn.Module):
    """One PKDA attention layer; `attn_fn` is the operator (see the module docstring)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, attn_fn, attn_dtype: torch.dtype | None = None,
                 x: float = 1.5, norm_eps: float = 1e-6):
        super().__init__()
        if attn_fn is None:
            raise ValueError("PKDAAttention needs an attention function (attn_fn)")
        self.hidden, self.heads, self.head_dim = hidden, heads, head_dim
        self.attn_fn, self.attn_dtype, self.x = attn_fn, attn_dtype, x
        inner = heads * head_dim
        self.q_proj = nn.Linear(hidden, inner, bias=False)
        self.k_proj = nn.Linear(hidden, inner, bias=False)
        self.v_proj = nn.Linear(hidden, inner, bias=False)
        self.g_proj = nn.Linear(hidden, inner, bias=True)
        self.g_atk_proj = nn.Linear(hidden, heads, bias=True)
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.b_atk_proj = nn.Linear(hidden, heads, bias=False)
        self.log_atk_scale = nn.Parameter(torch.full((heads,), -0.2))
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, hidden, bias=False)

    def reset_gate_biases(self) -> None:
        # slow decays at init (logsigmoid(3) ~ -0.05 per token), as gated linear attention models do
        nn.init.constant_(self.g_proj.bias, 3.0)
        nn.init.constant_(self.g_atk_proj.bias, 3.0)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        dt = self.attn_dtype or x.dtype
        q = self.q_proj(x).view(B, T, H, D).to(dt)
        k = self.k_proj(x).view(B, T, H, D).to(dt)
        v = self.v_proj(x).view(B, T, H, D).to(dt)
        g = F.logsigmoid(self.g_proj(x).float()).view(B, T, H, D)
        g_atk = F.logsigmoid(self.g_atk_proj(x).float())
        beta = torch.sigmoid(self.b_proj(x).float())
        beta_atk = torch.sigmoid(self.b_atk_proj(x).float())
        out = self.attn_fn(q, k, v, g, g_atk, beta_atk, beta, scale=D ** -0.5, cu_seqlens=cu_seqlens,
                           x=self.x, log_atk_scale=self.log_atk_scale)
        o = out[0] if isinstance(out, (tuple, list)) else out
        o = self.o_norm(o.to(x.dtype))
        return self.o_proj(o.reshape(B, T, H * D))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PKDABlock(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, attn_fn, attn_dtype=None, mlp_ratio: int = 4):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = PKDAAttention(hidden, heads, head_dim, attn_fn, attn_dtype)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, mlp_ratio * hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class PKDAModel(nn.Module):
    """Embedding, `layers` PKDA blocks, final norm, LM head (see the module docstring)."""

    def __init__(self, vocab: int, hidden: int, heads: int, head_dim: int, attn_fn, layers: int = 2,
                 attn_dtype: torch.dtype | None = None, mlp_ratio: int = 4, init_std: float = 0.02):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(PKDABlock(hidden, heads, head_dim, attn_fn, attn_dtype, mlp_ratio)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self._init(init_std, layers)

    def _init(self, std: float, layers: int) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for b in self.blocks:
            b.attn.reset_gate_biases()
            # scaled residual projections (GPT-2 style) keep the residual stream's scale with depth
            nn.init.normal_(b.attn.o_proj.weight, std=std / math.sqrt(2 * layers))
            nn.init.normal_(b.mlp.down.weight, std=std / math.sqrt(2 * layers))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab], or the mean cross entropy when `labels` [B, T] are given."""
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), labels.reshape(-1))


def varlen_cu_seqlens(total: int, context_len: int, device=None) -> torch.Tensor:
    """Document boundaries every `context_len` tokens over a stream of `total` tokens (int32)."""
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    bounds = list(range(0, total, context_len)) + [total]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def pack_varlen(input_ids: torch.Tensor, labels: torch.Tensor, context_len: int):
    """[B, T] rows -> ([1, B*T] ids, [1, B*T] labels, cu_seqlens) with boundaries every context_len."""
    B, T = input_ids.shape
    cu = varlen_cu_seqlens(B * T, context_len, device=input_ids.device)
    return input_ids.reshape(1, B * T), labels.reshape(1, B * T), cu


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: dict, attn_fn) -> PKDAModel:
    """The harness's model factory: cfg holds vocab, hidden, heads, head_dim and optionally layers
    (default 2), mlp_ratio (4) and dtype (the attention inputs' dtype name, default float32)."""
    attn_dtype = _DTYPES[cfg.get("dtype") or "float32"]
    return PKDAModel(vocab=int(cfg["vocab"]), hidden=int(cfg["hidden"]), heads=int(cfg["heads"]),
                     head_dim=int(cfg["head_dim"]), attn_fn=attn_fn, layers=int(cfg.get("layers", 2)),
                     attn_dtype=attn_dtype, mlp_ratio=int(cfg.get("mlp_ratio", 4)))
