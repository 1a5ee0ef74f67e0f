"""The models: TransformerLM (decoder), TransformerEncoder and TransformerClassifier, over one TransformerBody.

Block (:mod:`diffattn.model.blocks`): Y = X + Attn(RMSNorm(X)); X' = Y + SwiGLU(RMSNorm(Y)). The attention type
comes from the registry in :mod:`diffattn.attention.registry`; everything else is shared, so DIFF and its baseline
differ only in attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from diffattn.model.blocks import Block, init_linear_, scaled_init_std
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.init import full_tensors, replay_init
from diffattn.model.pretrained import PretrainedMixin
from diffattn.ops.norm import RMSNorm
from diffattn.ops.rope import RotaryEmbedding


def set_lambda_scale(model: nn.Module, scale: float) -> int:
    """Multiply every differential attention module's negative map by ``scale`` in [0, 1]: λ (V1 and
    diff_distance) or sigmoid(W_λ x) (V2). A knob for a training loop to ramp the negative map in (a converted
    model starts with it at 0); it is a buffer that is not saved, so a loaded model has scale 1. Returns the
    number of modules set."""
    if not 0.0 <= scale <= 1.0:
        raise ValueError(f"lambda scale must be in [0, 1], got {scale}")
    n = 0
    for m in model.modules():
        buf = getattr(m, "lambda_scale", None)
        if isinstance(buf, Tensor):
            buf.fill_(scale)
            n += 1
    return n


class TransformerBody(nn.Module):
    """Token embeddings (× √d_model with ``scale_embeddings``) → blocks → final RMSNorm. Shared by the decoder LM
    and the encoder. RoPE: one table (``rope``, base ``rope_theta``, linear ``rope_factor``), and a second one
    (``rope_local``, base ``rope_local_theta``) for the sliding-window layers when the config gives them their own
    base (Gemma 3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, unit_offset=cfg.norm_unit_offset)
        rope_dim = self.blocks[0].attn.rope_dim
        self.rope = (RotaryEmbedding(rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope, factor=cfg.rope_factor)
                     if cfg.rope != "none" else None)
        self.local_layers = [i for i in range(cfg.n_layers) if cfg.local_rope(i)] if self.rope is not None else []
        self.rope_local = (RotaryEmbedding(rope_dim, cfg.max_seq_len, cfg.rope_local_theta, cfg.rope)
                           if self.local_layers else None)

    def forward(self, input_ids: Tensor, input_pos: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """input_ids: (B, T) -> hidden states (B, T, d_model)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if input_pos is None:
            if self.blocks[0].attn.cache is not None:
                raise ValueError("a KV cache is set up: pass input_pos, the absolute positions of the new tokens")
            if t > self.config.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
            input_pos = torch.arange(t, device=input_ids.device)
        rope = self.rope(input_pos) if self.rope is not None else None
        ropes = [rope] * len(self.blocks)
        if self.rope_local is not None:
            local = self.rope_local(input_pos)
            for i in self.local_layers:
                ropes[i] = local
        x = self.tok_emb(input_ids)
        if self.config.scale_embeddings:  # fp32, then the embeddings' dtype, as Gemma rounds √d_model (bf16: 55.5)
            x = x * torch.tensor(math.sqrt(self.config.d_model)).to(x.dtype)
        x = self.drop(x)
        for block, r in zip(self.blocks, ropes):
            x = block(x, r, input_pos, attn_mask, self.config.causal)
        return self.norm(x)

    def init_weights(self) -> None:
        """GPT-2's initialisation of the linear layers and the embedding (what the models' constructors add to
        the modules' own; see :meth:`TransformerLM.init_weights` for the whole of it)."""
        std = self.config.init_std
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                is_residual_out = name.endswith(("out_proj", "down_proj"))
                with full_tensors(m):
                    init_linear_(m, scaled_init_std(std, self.config.n_layers) if is_residual_out else std)
            elif isinstance(m, nn.Embedding):
                with full_tensors(m):
                    nn.init.normal_(m.weight, mean=0.0, std=std)


class TransformerLM(nn.Module, PretrainedMixin):
    """Decoder-only language model. ``model(input_ids)`` with (B, T) ids returns logits (B, T, vocab).

    Incremental decoding: ``setup_cache(batch_size)``, then call with ``input_pos`` (the absolute positions of
    the new tokens); ``clear_cache()`` when done. ``save_pretrained(dir, tokenizer=...)`` /
    ``diffattn.load_pretrained(dir)``: safetensors + config.json folders (:mod:`diffattn.model.pretrained`).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not config.causal:
            raise ValueError("TransformerLM is a decoder: config.causal must be True (use TransformerEncoder)")
        self.config = config
        self.body = TransformerBody(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.body.init_weights()
        init_linear_(self.lm_head, config.init_std)
        self._tie()

    def _tie(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.body.tok_emb.weight

    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place as the constructor did: for the same torch seed, the
        same values (λ_init per depth included) and the same RNG state afterwards. For a model built on the meta
        device, moved with ``to_empty`` or sharded by FSDP2 (:func:`diffattn.model.init.materialize`)."""
        if self.config.tie_embeddings and self.lm_head.weight is not self.body.tok_emb.weight:
            self._tie()  # to_empty re-creates parameters one module at a time, which unties them
        # The constructor's order: the body's modules, lm_head's default, GPT-2's init of the body, of lm_head.
        # A tied lm_head's draws were then replaced by the embedding: draw them the same (keeping the RNG
        # stream) and drop them.
        replay_init(self.body)
        tied = self.config.tie_embeddings
        with torch.no_grad():
            with full_tensors(self.lm_head, discard=tied):
                self.lm_head.reset_parameters()
            self.body.init_weights()
            with full_tensors(self.lm_head, discard=tied):
                init_linear_(self.lm_head, self.config.init_std)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.body.blocks

    def forward(self, input_ids: Tensor, input_pos: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        return self.lm_head(self.body(input_ids, input_pos, attn_mask))

    def setup_cache(self, batch_size: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Preallocate every layer's static KV cache."""
        s = max_seq_len or self.config.max_seq_len
        if s > self.config.max_seq_len:
            raise ValueError(f"cache length {s} exceeds max_seq_len {self.config.max_seq_len}")
        p = self.lm_head.weight
        # a context from a config file may be 10¹² tokens: refused in one line, before anything is allocated
        check_fits(self.config.replace(max_seq_len=s), "the KV cache", copies=0, rope=False, kv_batch=batch_size,
                   device=p.device)
        for block in self.blocks:
            block.attn.setup_cache(batch_size, s, dtype or p.dtype, p.device)

    def clear_cache(self) -> None:
        for block in self.blocks:
            block.attn.cache = None

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.body.tok_emb.weight.numel() if exclude_embeddings else n


class TransformerEncoder(nn.Module, PretrainedMixin):
    """Bidirectional encoder: (B, T) ids (+ optional (B, T) bool padding mask, True = token) -> (B, T, d_model)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.causal:
            config = config.replace(causal=False)
        self.config = config
        self.body = TransformerBody(config)
        self.body.init_weights()

    def init_weights(self) -> None:
        """In place, as the constructor did (see :meth:`TransformerLM.init_weights`)."""
        replay_init(self.body)
        with torch.no_grad():
            self.body.init_weights()

    def forward(self, input_ids: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        return self.body(input_ids, attn_mask=attn_mask)


class TransformerClassifier(nn.Module, PretrainedMixin):
    """Encoder + pooling ("mean" over real tokens, or "first") + linear head -> logits (B, num_classes)."""

    def __init__(self, config: ModelConfig, num_classes: int, pooling: str = "mean"):
        super().__init__()
        if pooling not in ("mean", "first"):
            raise ValueError(f"pooling must be 'mean' or 'first', got {pooling!r}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.encoder = TransformerEncoder(config)
        self.config = self.encoder.config
        self.pooling = pooling
        self.head = nn.Linear(config.d_model, num_classes)
        init_linear_(self.head, config.init_std)

    def init_weights(self) -> None:
        """In place, as the constructor did (see :meth:`TransformerLM.init_weights`)."""
        self.encoder.init_weights()
        with torch.no_grad(), full_tensors(self.head):
            self.head.reset_parameters()
            init_linear_(self.head, self.config.init_std)

    def pretrained_kwargs(self) -> dict:
        return {"num_classes": self.head.out_features, "pooling": self.pooling}

    def forward(self, input_ids: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        h = self.encoder(input_ids, attn_mask)
        if self.pooling == "first":
            pooled = h[:, 0]
        elif attn_mask is None:
            pooled = h.mean(dim=1)
        else:
            w = attn_mask.to(h.dtype)[..., None]
            pooled = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        return self.head(pooled)
