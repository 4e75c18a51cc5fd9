"""The benchmark's model: a GPT-style byte-level causal language model, in two presets; or, with
``--arch gpt2``, transformers' GPT-2 of the same sizes."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    d_model: int
    n_heads: int
    context: int
    vocab: int = 256


PRESETS = {
    "tiny": ModelConfig(n_layers=4, d_model=128, n_heads=4, context=64),  # ~0.9M parameters
    "small": ModelConfig(n_layers=5, d_model=384, n_heads=6, context=64),  # ~9.1M parameters
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style byte-level causal language model (learned positions, untied head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"--width {cfg.d_model} must be a multiple of --heads {cfg.n_heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class HFGPT2(nn.Module):
    """transformers' ``GPT2LMHeadModel`` from a ``GPT2Config`` of the same sizes (byte vocabulary,
    tied embeddings, its own initialisation), returning the logits as :class:`TinyGPT` does:
    ``--arch gpt2`` (transformers is imported here only)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as exc:  # pragma: no cover - the dev extra installs it
            raise SystemExit("--arch gpt2 needs transformers (pip install -e '.[integrations]')") from exc
        self.cfg = cfg
        self.gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.context, n_embd=cfg.d_model,
                                               n_layer=cfg.n_layers, n_head=cfg.n_heads, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt2(idx).logits


ARCHS = {"gpt": TinyGPT, "gpt2": HFGPT2}


def count_params(cfg: ModelConfig) -> int:
    d, L = cfg.d_model, cfg.n_layers
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab * d * 2 + cfg.context * d + L * per_block + 2 * d

