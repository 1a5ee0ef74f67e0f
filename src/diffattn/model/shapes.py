"""Whether a set of weights is the model its config describes, said in one phrase (:func:`weights_mismatch`):
what ``diffattn info`` reports for a checkpoint whose config and weights disagree, and what a strict load
says instead of torch's list of every key.

The expected shapes come from a one-layer model built on the meta device (no memory); every block of one
attention type has the same shapes (a config whose layers mix types builds one per type), so a config of 10⁶
layers costs no more to check than one of 2.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerClassifier, TransformerEncoder, TransformerLM
from diffattn.system.atomic_files import printable


def _template(cfg: ModelConfig, task: str, num_classes: int) -> tuple[dict[str, tuple], dict[str, tuple], str]:
    """(shapes outside the blocks, one block's shapes by their name inside it, the blocks' name prefix)."""
    one = cfg.first_layers(1)
    with torch.device("meta"):
        if task == "classify":
            model: torch.nn.Module = TransformerClassifier(one, max(num_classes, 2))
        elif task == "encoder":
            model = TransformerEncoder(one)
        else:
            model = TransformerLM(one)
    prefix = "encoder.body.blocks." if task == "classify" else "body.blocks."
    root, block = {}, {}
    for name, t in model.state_dict().items():
        if name.startswith(prefix + "0."):
            block[name[len(prefix) + 2:]] = tuple(t.shape)
        else:
            root[name] = tuple(t.shape)
    return root, block, prefix


def weights_mismatch(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], *, task: str = "lm",
                     num_classes: int = 0) -> str | None:
    """The first way the weights ``shapes`` ({name: shape}, tied aliases included) differ from the model
    ``cfg`` describes, as one phrase with the names escaped; None when they are that model's."""
    root, block, prefix = _template(cfg, task, num_classes)
    # a config whose layers mix types (layer_attention): one block template per type
    kinds = cfg.attention_per_layer
    blocks = {t: block if t == cfg.attention else _template(cfg.layer_config(kinds.index(t)), task, num_classes)[1]
              for t in set(kinds)}
    layer = re.compile(re.escape(prefix) + r"(\d+)\.(.+)$")
    per_layer: dict[int, int] = {}
    for name, shape in shapes.items():
        m = layer.match(name)
        if m and int(m[1]) >= cfg.n_layers:
            return f"the weights hold layer {m[1]}, but the config describes {cfg.n_layers:,} layers"
        if m:
            per_layer[int(m[1])] = per_layer.get(int(m[1]), 0) + 1
        want = blocks[kinds[int(m[1])]].get(m[2]) if m else root.get(name)
        if want is None:
            return f"the weights hold {printable(name)}, which the config's model does not have"
        if tuple(shape) != want:
            return (f"{printable(name)} has shape {tuple(shape)} in the weights but {want} in the config's model "
                    f"({_shape(cfg)})")
    missing = next((k for k in root if k not in shapes), None)
    if missing is not None:
        return f"the weights lack {missing}"
    if len(per_layer) < cfg.n_layers:
        return f"the config describes {cfg.n_layers:,} layers, but the weights hold {len(per_layer):,}"
    short = next((i for i, n in sorted(per_layer.items()) if n < len(blocks[kinds[i]])), None)
    if short is not None:
        lacking = next(k for k in blocks[kinds[short]] if f"{prefix}{short}.{k}" not in shapes)
        return f"the weights lack {prefix}{short}.{lacking}"
    return None


def _shape(cfg: ModelConfig) -> str:
    return f"{cfg.n_layers} layers, d_model {cfg.d_model}, vocab_size {cfg.vocab_size}, {cfg.n_heads} heads"
