"""The Llama-style decoder: parameters under Hugging Face names, maths as chunk functions.

Every function here works on a fixed number of rows (``EngineConfig.rows``) so that a matrix
product always has the same shape, whichever sessions share the step. On CPU and GPU the
same-shaped product computes a row the same way wherever it sits, so a session's tokens do
not depend on its neighbours; this is what makes a restored session continue exactly.
Attention is the one part that is per session (``attend``), and it is computed one query at a
time over exactly the keys that query sees, so a prefill and a token-by-token decode give the
same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fleetshift_agent.engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q_out = cfg.num_attention_heads * cfg.head_dim
        kv_out = cfg.num_key_value_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)


class LlamaModel(nn.Module):
    """Holds the parameters; its state_dict keys are the Hugging Face tensor names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict without the tied alias (safetensors refuses shared storage)."""
        state = {k: v.detach() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state


def rope_table(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, in float32, laid out as Hugging Face's rotate_half expects."""
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**half)
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [rows, heads, head_dim]; cos/sin: [rows, head_dim]
    xf = x.float()
    out = xf * cos[:, None, :] + _rotate_half(xf) * sin[:, None, :]
    return out.to(x.dtype)


def pre_attention(
    x: torch.Tensor,
    ln: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    bq: torch.Tensor | None,
    bk: torch.Tensor | None,
    bv: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of rows: norm, q/k/v projections, RoPE. Returns [rows, heads, head_dim]."""
    h = _rms_norm(x, ln, eps)
    rows = x.shape[0]
    q = F.linear(h, wq, bq).view(rows, -1, head_dim)
    k = F.linear(h, wk, bk).view(rows, -1, head_dim)
    v = F.linear(h, wv, bv).view(rows, -1, head_dim)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    wo: torch.Tensor,
    ln: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """One chunk of rows: output projection, residual, norm, SwiGLU, residual."""
    x = x + F.linear(attn, wo)
    h = _rms_norm(x, ln, eps)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def final_logits(
    x: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, eps: float
) -> torch.Tensor:
    """One chunk of rows: final norm and the vocabulary projection, as float32."""
    return F.linear(_rms_norm(x, norm, eps), head).float()


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query over exactly the keys it sees.

    q: [heads, head_dim]; keys/values: [seen, kv_heads, head_dim]. The shapes depend only on
    the query's position, so the same query gives the same bits in a prefill or a decode.
    """
    kv_heads, head_dim = keys.shape[1], keys.shape[2]
    qg = q.view(kv_heads, -1, head_dim).float()  # [kv, group, d]
    k = keys.permute(1, 2, 0).float()  # [kv, d, seen]
    v = values.permute(1, 0, 2).float()  # [kv, seen, d]
    scores = torch.matmul(qg, k) * (head_dim**-0.5)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).reshape(-1).to(q.dtype)
