"""The Transformer of the translation recipe: torch's `nn.Transformer` with shared embeddings.

One embedding matrix is shared by source, target and output projection (fairseq's --share-all-embeddings;
the BPE vocabulary is joint), with sinusoidal positions and embeddings scaled by sqrt(d_model), as in
Vaswani et al. 2017. `TransformerConfig` is the recipe's `model` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from data.translation import PAD
from trainer.config import require


@dataclass
class TransformerConfig:
    d_model: int = 512
    """Embedding and residual width (base 512, big 1024)."""
    heads: int = 8
    """Attention heads (base 8, big 16)."""
    encoder_layers: int = 6
    """Encoder layers."""
    decoder_layers: int = 6
    """Decoder layers."""
    ffn_dim: int = 2048
    """Feed-forward inner width (base 2048, big 4096)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention weights, feed-forward and residuals (nn.Transformer has one rate)."""
    label_smoothing: float = 0.1
    """Label smoothing of the cross-entropy loss."""
    norm_first: bool = False
    """Pre-norm layers (LayerNorm before each sub-layer); false = the paper's post-norm."""
    max_positions: int = 1024
    """Longest sequence the sinusoidal position table covers (BPE tokens + 1)."""

    def __post_init__(self) -> None:
        require(self.d_model > 0 and self.d_model % self.heads == 0,
                f"model.d_model: must be a positive multiple of model.heads ({self.heads}), got {self.d_model}")
        require(self.encoder_layers > 0 and self.decoder_layers > 0 and self.ffn_dim > 0,
                "model.encoder_layers, model.decoder_layers and model.ffn_dim must be > 0")
        require(0 <= self.dropout < 1, f"model.dropout: must be in [0, 1), got {self.dropout}")
        require(0 <= self.label_smoothing < 1, f"model.label_smoothing: must be in [0, 1), got {self.label_smoothing}")


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """Vaswani et al.'s fixed position encodings: sin on even, cos on odd channels."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer with shared embeddings; `forward(src, tgt_in)` gives logits (B, T, vocab)."""

    def __init__(self, cfg: TransformerConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0.0, cfg.d_model ** -0.5)  # fairseq's init for tied output weights
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.register_buffer("positions", sinusoids(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        layer = dict(d_model=cfg.d_model, nhead=cfg.heads, dim_feedforward=cfg.ffn_dim, dropout=cfg.dropout,
                     batch_first=True, norm_first=cfg.norm_first)
        # Built as nn.Transformer builds them, minus the prototype nested-tensor path (it warns, and would make
        # a sentence's encoding depend on its batch's padding).
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), cfg.encoder_layers,
                                        nn.LayerNorm(cfg.d_model), enable_nested_tensor=False)
        decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), cfg.decoder_layers,
                                        nn.LayerNorm(cfg.d_model))
        self.transformer = nn.Transformer(cfg.d_model, cfg.heads, custom_encoder=encoder, custom_decoder=decoder,
                                          batch_first=True)

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table covers (the decoder's output length limit)."""
        return self.cfg.max_positions

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.cfg.max_positions:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds model.max_positions {self.cfg.max_positions}")
        x = self.embed(ids) * math.sqrt(self.cfg.d_model) + self.positions[:ids.shape[1]]
        return self.dropout(x)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return self.transformer.encoder(self.embed_tokens(src), src_key_padding_mask=src == PAD)

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        length = tgt_in.shape[1]  # boolean like the padding masks (mixed mask types are deprecated in torch)
        causal = torch.ones(length, length, dtype=torch.bool, device=tgt_in.device).triu(1)
        h = self.transformer.decoder(self.embed_tokens(tgt_in), memory, tgt_mask=causal, tgt_is_causal=True,
                                     tgt_key_padding_mask=tgt_in == PAD, memory_key_padding_mask=src_pad)
        return F.linear(h, self.embed.weight)  # output projection tied to the embeddings

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return self.decode(tgt_in, self.encode(src), src == PAD)


def build_transformer(cfg: TransformerConfig, vocab_size: int) -> Seq2SeqTransformer:
    """The model for a joint BPE vocabulary of `vocab_size` pieces."""
    return Seq2SeqTransformer(cfg, vocab_size)
