"""The conversion recipe a variant registers beside its class (``@converts(Cls)``, :mod:`.registry`): how a
standard-attention model becomes that type, computing the same function.

:mod:`diffattn.interop.convert` reads the source (a transformers Llama folder or a diffattn checkpoint of a
``standard`` model), builds the converted model from the seed, copies everything outside attention (embeddings,
norms, SwiGLU, lm_head) and asks the target type's recipe for each layer's attention weights. The recipe holds
the rest, as code: the config change, the weights, the exactness argument (its docstring) and the tensors it
created (the saddle check: each must get a non-zero gradient after one optimizer step).

Notation of the recipes' docstrings. The source layer has h query heads and hkv KV heads of width d,
q_i = W_q,i x, k_g, v_g likewise, head i reads KV head g(i) = i // n_rep (n_rep = h / hkv),
A_i = softmax(q_i k_gᵀ / √d), and y = Σ_i W_o,i A_i v_g (W_o,i: the d columns of W_o for head i).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from diffattn.attention.base import AttentionConfig

#: The initialisations a recipe may define (:attr:`Conversion.inits`).
INITS = ("exact", "split")
#: ``get(p)``: a parameter itself, or its gradient (:meth:`Conversion.created`).
Getter = Callable[[Tensor], Tensor]
#: The source layer's weights, named as :class:`~diffattn.attention.standard.StandardAttention` names them
#: (``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``, ``out_proj.weight``; the families' ``q_proj.bias``,
#: ``k_proj.bias``, ``v_proj.bias``, ``out_proj.bias``, ``q_norm.weight``, ``k_norm.weight`` when it has them), in
#: fp32 on the CPU.
SourceLayer = dict[str, Tensor]
#: The per-head QK-norm gains (Qwen3, Gemma 3): one gain over the head width, shared by the heads, so every
#: recipe that keeps the source's head width and copies heads (as sub-heads, pairs or groups) copies them as they
#: are: each copy of a head is normed as the source normed it, before RoPE.
QK_NORMS = ("q_norm.weight", "k_norm.weight")


class Conversion:
    """A conversion recipe: classmethods, no state; registered for one type or several (``@converts``).

    ``inits``: the initialisations it defines. "exact" computes the source's logits (to float rounding) until
    trained; a recipe may define "split" too (parameter-matched, not function-preserving)."""

    inits: tuple[str, ...] = ("exact",)
    #: True for the recipe that converts to the source's own type (``--to standard``): ``convert`` then returns
    #: the source model itself.
    keeps_source = False

    @classmethod
    def config(cls, cfg: AttentionConfig, to: str, init: str) -> AttentionConfig:
        """The converted model's ``ModelConfig`` from the ``standard`` source's ``cfg`` for type ``to`` (the
        registered name: one recipe may convert to several types) and ``init`` (one of :attr:`inits`). Raises
        ValueError (one line, starting "convert: ") for a source this recipe cannot take. By default: type ``to``
        at the source's heads and head width."""
        return cfg.replace(attention=to, head_dim=head_dim_field(cfg))

    @classmethod
    def weights(cls, src: SourceLayer, new: nn.Module, *, init: str, gen: torch.Generator,
                break_symmetry: float) -> dict[str, Tensor]:
        """One layer: every entry of ``new.state_dict()`` (``new``: the converted model's freshly built layer,
        whose new tensors, such as V1's λ vectors, were drawn from the convert seed) from the source layer
        ``src``. ``gen`` draws any symmetry-breaking noise, scaled by ``break_symmetry`` (a recipe without
        such noise ignores both)."""
        raise NotImplementedError

    @classmethod
    def created(cls, attn: nn.Module, get: Getter) -> dict[str, Tensor]:
        """Views of every block of parameters this recipe created or copied into several places, by part name
        (``q2``, ``v_half1``, ``gate_proj``, ...), through ``get`` (the parameter or its gradient)."""
        raise NotImplementedError


def projection(src: SourceLayer, name: str, rows: Callable[[Tensor], Tensor] | None = None) -> dict[str, Tensor]:
    """Projection ``name``'s weight and, when the source has one, its bias, with ``rows`` (the recipe's rearrangement
    of output rows: head copies, a reordering) applied to both: a bias belongs to its row, so it moves and repeats
    with it (V1's [v; v] doubles the v bias too)."""
    rows = rows or (lambda w: w)
    out = {f"{name}.weight": rows(src[f"{name}.weight"])}
    if f"{name}.bias" in src:
        out[f"{name}.bias"] = rows(src[f"{name}.bias"][:, None])[:, 0]
    return out


def carried(src: SourceLayer, out_weight: Tensor) -> dict[str, Tensor]:
    """What every exact recipe keeps as it is besides its own tensors: the QK-norm gains (:data:`QK_NORMS`) and the
    out-projection's bias, added once after the heads are summed (so a recipe that rescales W_o, ×2 under a σ = ½
    gate, leaves it alone), with the recipe's ``out_proj.weight``."""
    keep = [*QK_NORMS, "out_proj.bias"]
    return {"out_proj.weight": out_weight, **{n: src[n] for n in keep if n in src}}


def repeat_heads(w: Tensor, d: int) -> Tensor:
    """Rows of n heads of width d, (n·d, E), with every head repeated: (2n·d, E) = [w_0; w_0; w_1; w_1; ...]."""
    n = w.shape[0] // d
    heads = w.reshape(n, 1, d, -1)
    return torch.cat((heads, heads), dim=1).reshape(2 * n * d, -1)


def head_dim_field(cfg: AttentionConfig) -> int | None:
    """``ModelConfig.head_dim`` that keeps the source's head width d at the source's heads: None when d is the
    width the config derives anyway (d · n_heads = d_model), else d."""
    d = cfg.qk_head_dim
    return None if d * cfg.n_heads == cfg.d_model else d
