"""The chunk compression encoder S: child-chunk embeddings -> the embedding of the group's summary.

SmartChunk embeds the upper levels of a hierarchy without summarising every group:
e_comp = S(emb(c_1), ..., emb(c_m)), trained with ||e_comp - e_gt||^2 where e_gt is the encoder's
embedding of an LLM summary of c_1..c_m (``data_pipeline/summaries.py`` makes the pairs).

``SetCompressor`` is a set encoder over the child vectors: pre-norm transformer layers let the
children attend to each other, then attention pooling with a learned query reduces them to one
vector. The layers' output projections and the pooling query start at zero, so an untrained
compressor returns exactly the masked mean of its children (the ``mean_pool`` baseline) and
training only has to learn the correction. Any number of children, padding masks, batches.

It is a transformers ``PreTrainedModel``: ``save_pretrained`` writes a Hugging Face folder
(config.json + model.safetensors), ``from_pretrained`` reads it back; ``save_checkpoint`` adds the
``overstory.json`` manifest (base encoder, data hashes, metrics) beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class SetCompressorConfig(PretrainedConfig):
    model_type = "overstory-set-compressor"

    def __init__(self, embedding_dim: int = 384, num_layers: int = 1, num_heads: int = 4, ffn_dim: int = 768,
                 dropout: float = 0.1, encoder: str = "builtin:all-minilm-l6-v2", **kwargs: Any):
        super().__init__(**kwargs)
        if embedding_dim % num_heads:
            raise ValueError(f"embedding_dim {embedding_dim} is not divisible by num_heads {num_heads}")
        self.embedding_dim, self.num_layers, self.num_heads = embedding_dim, num_layers, num_heads
        self.ffn_dim, self.dropout, self.encoder = ffn_dim, dropout, encoder


class SetCompressor(PreTrainedModel):
    config_class = SetCompressorConfig
    base_model_prefix = "compressor"
    main_input_name = "child_embeddings"

    def __init__(self, config: SetCompressorConfig):
        super().__init__(config)
        layer = nn.TransformerEncoderLayer(config.embedding_dim, config.num_heads, config.ffn_dim, config.dropout,
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.query = nn.Parameter(torch.zeros(config.embedding_dim))
        self.post_init()
        self._start_at_mean()

    def _init_weights(self, module: nn.Module) -> None:
        """torch's own initialisation is kept; ``_start_at_mean`` then zeroes what must start at zero."""

    @torch.no_grad()
    def _start_at_mean(self) -> None:
        # Zero output projections make every pre-norm residual block the identity, and a zero query
        # makes attention pooling uniform: the untrained model is the masked mean of the children.
        for layer in self.layers.layers:
            for linear in (layer.self_attn.out_proj, layer.linear2):
                linear.weight.zero_()
                linear.bias.zero_()
        self.query.zero_()

    def forward(self, child_embeddings: torch.Tensor, child_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``child_embeddings``: [batch, children, dim]; ``child_mask``: [batch, children], True for real
        children (padding False). Returns [batch, dim]."""
        if child_embeddings.dim() != 3 or child_embeddings.shape[-1] != self.config.embedding_dim:
            raise ValueError(f"expected child embeddings of shape [batch, children, {self.config.embedding_dim}], "
                             f"got {list(child_embeddings.shape)}")
        if child_mask is None:
            child_mask = torch.ones(child_embeddings.shape[:2], dtype=torch.bool, device=child_embeddings.device)
        child_mask = child_mask.bool()
        if not child_mask.any(dim=1).all():
            raise ValueError("every group needs at least one child")
        hidden = self.layers(child_embeddings, src_key_padding_mask=~child_mask)
        scores = (hidden @ self.query).masked_fill(~child_mask, float("-inf"))
        weights = torch.softmax(scores, dim=1)
        return (weights.unsqueeze(-1) * hidden).sum(dim=1)


def pad_children(groups: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack groups of child vectors ([m_i, dim] each) into a padded batch and its mask."""
    if not groups:
        raise ValueError("no groups to pad")
    longest = max(g.shape[0] for g in groups)
    batch = torch.zeros(len(groups), longest, groups[0].shape[-1], dtype=groups[0].dtype)
    mask = torch.zeros(len(groups), longest, dtype=torch.bool)
    for i, group in enumerate(groups):
        batch[i, : group.shape[0]] = group
        mask[i, : group.shape[0]] = True
    return batch, mask


def save_checkpoint(model: SetCompressor, folder: str | Path, manifest: dict[str, Any]) -> Path:
    """``save_pretrained`` plus the overstory.json manifest (base encoder, config, data hashes, metrics)."""
    folder = Path(folder)
    model.save_pretrained(folder)
    (folder / "overstory.json").write_text(json.dumps(
        {"kind": "set-compressor", "encoder": model.config.encoder, **manifest}, indent=2, default=str))
    return folder


def load_compressor(folder: str | Path, embedding_dim: int | None = None) -> SetCompressor:
    """Load a saved compressor; with ``embedding_dim``, refuse one trained for another encoder size."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not a compressor checkpoint (config.json missing)")
    model = SetCompressor.from_pretrained(folder)
    if embedding_dim is not None and model.config.embedding_dim != embedding_dim:
        raise ValueError(f"{folder} was trained on {model.config.embedding_dim}-dim embeddings "
                         f"({model.config.encoder}), but this encoder gives {embedding_dim}-dim vectors")
    return model.eval()
