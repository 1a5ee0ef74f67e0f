"""What vLLM serves, decided without vLLM: the served configuration of a model, the shapes of its attention
layers and their KV-cache bytes per token, and every reason a model or folder cannot be served.

Each servable type's file registers its vLLM layer beside its class (``@serves``:
:class:`~diffattn.attention.serving.ServedLayer`); its classmethods say what is read here without vLLM: the
served config (a type served as another, Shared DIFF as V1), the weights as the served type names them, and the
shape of its ``Attention`` layers, whose docstrings give each KV-cache layout. A type without one says why
(``unsupported["serve"]`` on its class).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from diffattn.attention.registry import ATTENTION, serving_of, unsupported_note
from diffattn.attention.serving import AttentionShape
from diffattn.checkpoint.hf_family_table import BASE, DIFF, HF_ACTIVATIONS
from diffattn.checkpoint.hf_folder import from_hf_config
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import Refused, confined, printable, read_json

#: vLLM 0.32's CPU attention backend's head sizes (``CPUAttentionBackend.get_supported_head_sizes``; a test
#: checks them against the installed vLLM).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def served_type(attention: str) -> str | None:
    """The registered type whose vLLM layer serves ``attention`` (None: not servable)."""
    layer = serving_of(attention)
    return None if layer is None else layer.as_type or attention


def not_served_reason(attention: str) -> str:
    """Why ``attention`` has no vLLM layer, one phrase."""
    if attention not in ATTENTION:
        return f"attention {attention!r} is not a registered type"
    note = unsupported_note(attention, "serve")
    return f"attention {attention!r} has no vLLM recipe" + (f": {note}" if note else
                                                             " (its file registers no @serves layer)")


def _first_layers(cfg: ModelConfig) -> dict[str, int]:
    """{type: the first layer of that type}, in layer order."""
    first: dict[str, int] = {}
    for i, t in enumerate(cfg.attention_per_layer):
        first.setdefault(t, i)
    return first


def stored_types(cfg: ModelConfig) -> list[str]:
    """The types among ``cfg``'s layers that are servable but served as another type (``as_type``: a folder of
    them is diffattn's, not yet vLLM's)."""
    return [t for t in _first_layers(cfg) if served_type(t) not in (None, t)]


def served_config(cfg: ModelConfig) -> ModelConfig:
    """The configuration vLLM serves for ``cfg`` (its layer's ``config``: the served type, K = Q written out as a
    key projection, no dropout). A model whose layers mix types (``layer_attention``, a selective retrofit) is
    served layer by layer: each layer's type's ``config`` of that layer's config, which must agree with the
    model's on everything but the type (one ``ModelConfig`` holds them all). Raises ValueError (one phrase)
    when a layer's type has no vLLM layer, or the layers' served configs cannot share one config."""
    first = _first_layers(cfg)
    for t in dict.fromkeys([*first, cfg.attention]):  # the model's own type holds the fields every layer shares
        if serving_of(t) is None:
            raise ValueError(not_served_reason(t))
    served = serving_of(cfg.attention).config(cfg)
    if cfg.layer_attention is None:
        return served
    types = [served_type(t) for t in cfg.layer_attention]
    served = served.replace(layer_attention=types if len(set(types)) > 1 else None)
    for t, i in first.items():
        want = serving_of(t).config(cfg.layer_config(i)).to_dict()
        got = served.layer_config(i).to_dict()
        apart = [f"{k} {want[k]!r}, not {got[k]!r}" for k in want if k != "layer_attention" and want[k] != got[k]]
        if apart:
            raise ValueError(f"its {t!r} layers are served with {'; '.join(apart)} as the model's other layers "
                             "are (one served config holds every layer): set it in the model's config")
    return served


def served_state_dict(model: TransformerLM) -> dict[str, Tensor]:
    """``model``'s weights as the model of :func:`served_config` names them (each layer's type's ``weights``)."""
    cfg = model.config
    state = {k: v for k, v in model.state_dict().items() if ".attn." not in k}
    for i, block in enumerate(model.blocks):
        layer = serving_of(cfg.layer_config(i).attention)
        state.update({f"body.blocks.{i}.attn.{k}": v for k, v in layer.weights(block.attn).items()})
    return state


def served_model(model: TransformerLM) -> TransformerLM:
    """A :class:`TransformerLM` of :func:`served_config` computing ``model``'s function (the same object when
    nothing changes), on the same device and dtype, in eval mode."""
    cfg = served_config(model.config)
    if cfg == model.config:
        return model
    ref = model.lm_head.weight
    with ref.device:
        served = TransformerLM(cfg).to(ref.dtype)
    served.load_state_dict(served_state_dict(model), strict=True)
    return served.eval()


def layer_shapes(cfg: ModelConfig) -> list[AttentionShape]:
    """The attention layers of each block of ``cfg`` served (``cfg`` a served config: :func:`served_config`):
    each layer's type's ``shape`` of that layer's config. vLLM keeps each layer's cache at its own shape: layers
    of one kind (full attention, or one window) whose pages differ in size share one KV-cache group and one block
    table, each layer's tensor its own page wide (``UniformTypeKVCacheSpecs``), so a V1 layer's 2d-wide cache
    beside a standard layer's d-wide one costs no padding."""
    return [attention_shape(cfg, i) for i in range(cfg.n_layers)]


def attention_shape(cfg: ModelConfig, layer: int = 0) -> AttentionShape:
    """The attention layers of block ``layer`` of ``cfg`` served (``cfg`` a served config: :func:`served_config`)."""
    layer_cfg = cfg.layer_config(layer)
    recipe = served_type(layer_cfg.attention)
    if recipe is None:
        raise ValueError(not_served_reason(layer_cfg.attention))
    return serving_of(recipe).shape(layer_cfg)


def kv_floor_values(cfg: ModelConfig) -> int:
    """The fewest cached values per token and layer that ``cfg``'s attention needs: each KV head's keys and
    values once (V1, DINT: K1 and K2 of width d and V of width 2d per KV diff-head, the matched baseline's;
    DINT's running mean is extra state the floor does not count)."""
    kv, d = cfg.kv_heads, cfg.qk_head_dim
    return 4 * kv * d if ATTENTION[cfg.attention].head_split == 2 else 2 * kv * d


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> dict[str, Any]:
    """KV-cache bytes per token of the served model (all layers, each at its own type's shape) against the floor,
    at ``dtype_bytes`` per value (2: bf16/fp16, 4: fp32): {"served", "floor", "ratio"}."""
    served = served_config(cfg)
    values = sum(shape.kv_values_per_token() for shape in layer_shapes(served))
    floor = sum(kv_floor_values(served.layer_config(i)) for i in range(cfg.n_layers))
    return {"served": values * dtype_bytes, "floor": floor * dtype_bytes, "ratio": values / floor}


#: Why a checkpoint saved mid-schedule is not served: the folder would hold the plain type, another function.
MID_RETROFIT = ("it was saved in the middle of its retrofit schedule (a blend the served model would not compute): "
                "export a checkpoint from the end of the schedule on")


def config_problems(cfg: ModelConfig, *, cpu: bool = True) -> list[str]:
    """Every reason a language model of ``cfg`` cannot be served by vLLM, one phrase each (empty: it can).
    ``cpu``: also the head widths vLLM's CPU attention backend refuses."""
    problems: list[str] = []
    if not cfg.causal:
        problems.append("it is not causal (vLLM serves decoders)")
    unserved = [not_served_reason(t) for t in dict.fromkeys([*_first_layers(cfg), cfg.attention])
                if served_type(t) is None]
    if unserved:
        return problems + unserved
    try:
        served = served_config(cfg)
    except ValueError as e:
        return problems + [str(e)]
    if cpu:
        sizes = {t: serving_of(t).shape(served.layer_config(i)).head_sizes() for t, i in _first_layers(served).items()}
        bad = sorted(set().union(*sizes.values()) - set(CPU_HEAD_SIZES))
        if bad:
            width = "head width" + ("s" if len(bad) > 1 else "")
            which = ", ".join(t for t, s in sizes.items() if s - set(CPU_HEAD_SIZES))
            problems.append(f"vLLM's CPU attention takes head widths {', '.join(map(str, CPU_HEAD_SIZES))}; this "
                            f"model's attention needs {width} {', '.join(map(str, bad))} ({which}: "
                            f"Q/K width {served.qk_head_dim})")
    return problems


def model_problems(model: nn.Module, *, cpu: bool = True) -> list[str]:
    """:func:`config_problems` for a model object: only a :class:`TransformerLM` (a causal LM) is served."""
    if not isinstance(model, TransformerLM):
        return [not_lm_reason(type(model).__name__)]
    mid = [MID_RETROFIT] if any(getattr(m, "retrofitting", False) for m in model.modules()) else []
    return config_problems(model.config, cpu=cpu) + mid


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers-style config.json fields vLLM reads (sizes, heads as vLLM's tensor parallelism splits
    them, context, norms), for a served config. ``num_attention_heads`` counts what tensor parallelism splits,
    which is what ``ModelConfig.n_heads`` counts: heads, diff-heads (V1, DINT, GDA: pairs of sub-heads) or pairs
    of query heads (V2)."""
    # one model-wide KV shape is what vLLM reads from config.json (its own size estimates); each layer builds its
    # own cache (layer_shapes), and the widest layer's is the one that over-estimates rather than under
    shape = max((s.layers[0] for s in layer_shapes(cfg)), key=lambda s: s[1] * s[2])
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": shape[1], "head_dim": shape[2], "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": HF_ACTIVATIONS[cfg.mlp_activation],
    }


#: model_type values of the folders vLLM serves with the plugin installed: ours, DiffLlama (the plugin) and
#: Llama (vLLM's own model).
SERVED_MODEL_TYPES = ("diffattn", DIFF.model_type, BASE.model_type)


def folder_problems(folder: str | os.PathLike, *, cpu: bool = True) -> list[str]:
    """Every reason vLLM cannot serve the model folder ``folder`` (config.json of a ``diffattn export --to vllm``,
    a transformers DiffLlama or Llama folder), read without vLLM, one phrase each (empty: it can). ``cpu``: also
    the head widths vLLM's CPU attention refuses."""
    path = Path(folder) / "config.json"
    try:  # a FIFO or a document nested too deeply is refused here (UnreadableInput, a ValueError)
        raw = read_json(confined(folder, "config.json"))
    except (OSError, ValueError) as e:
        why = printable(e) if isinstance(e, Refused) else type(e).__name__
        return [f"{printable(path)} cannot be read as JSON ({why})"]
    if not isinstance(raw, dict):
        return [f"{path} does not hold a JSON object"]
    kind = raw.get("model_type")
    if kind not in SERVED_MODEL_TYPES:
        if "diffattn_class" in raw:
            return ["it is a diffattn save_pretrained folder, not a vLLM one: export it with diffattn export "
                    "RUN --to vllm (diffattn serve does this itself)"]
        return [f"model_type {printable(repr(kind))}: diffattn serves {', '.join(SERVED_MODEL_TYPES)} folders"]
    try:
        if kind == "diffattn":
            if raw.get("diffattn_class") != "TransformerLM":
                return [not_lm_reason(raw.get("diffattn_class"))]
            cfg = ModelConfig.from_dict(raw.get("config") or {})
        else:
            cfg = (_llama_sizes if kind == BASE.model_type else _diffllama)(raw)
        check_fits(cfg, "vLLM", copies=1)  # every reader's size check, before vLLM starts building it
    except (TypeError, ValueError) as e:  # ModelTooLarge too
        return [printable(e)]
    if kind == BASE.model_type:  # vLLM's own model: only its size and the head width its CPU attention takes are ours
        width = cfg.qk_head_dim
        return [] if not cpu or width in CPU_HEAD_SIZES else [
            f"vLLM's CPU attention takes head widths {', '.join(map(str, CPU_HEAD_SIZES))}; this Llama's is {width}"]
    problems = config_problems(cfg, cpu=cpu)
    stored = stored_types(cfg)
    if kind == "diffattn" and not problems and stored:
        problems.append(f"it holds {', '.join(map(repr, stored))}, stored for diffattn, not as vLLM serves it: "
                        "export it with diffattn export --to vllm")
    return problems


def _diffllama(raw: dict[str, Any]) -> ModelConfig:
    return from_hf_config(raw, rope="neox")


def _llama_sizes(raw: dict[str, Any]) -> ModelConfig:
    """A standard-attention model of a Llama config.json's sizes (vLLM serves its other settings itself): what
    the size check counts. ValueError for sizes that are no sizes."""
    heads = raw.get("num_attention_heads")
    return ModelConfig(vocab_size=raw.get("vocab_size"), d_model=raw.get("hidden_size"),
                       n_layers=raw.get("num_hidden_layers"), n_heads=heads,
                       n_kv_heads=raw.get("num_key_value_heads") or heads, ffn_hidden=raw.get("intermediate_size"),
                       max_seq_len=raw.get("max_position_embeddings") or 2048, head_dim=raw.get("head_dim"),
                       attention="standard", rope="none", tie_embeddings=bool(raw.get("tie_word_embeddings")))


def not_lm_reason(cls_name: object) -> str:
    """Why a diffattn model of class ``cls_name`` (not a TransformerLM) is not served, one phrase."""
    what = {"TransformerClassifier": "a classifier", "TransformerEncoder": "an encoder"}.get(str(cls_name),
                                                                                          f"a {cls_name}")
    return f"it is {what}; vLLM serves causal language models (TransformerLM)"
