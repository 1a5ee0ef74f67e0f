"""Read a local transformers Llama / DiffLlama folder (``save_pretrained`` output: config.json and safetensors, one
file or sharded) as our :class:`~diffattn.model.transformer.TransformerLM`, without transformers and without
downloading anything, so every command that reads a model folder reads the model a user converted from too.

The layout facts (sub-head order, RoPE styles, the per-head norm's gain, ``lambda_init``) are set out in
:mod:`diffattn.interop.hf`, which writes such folders with these same row layouts. The weight files a folder names
are plain names inside it (:func:`weight_files`), checked before any is opened, and the model's size is checked
against the machine before its tensors are read.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from diffattn.fileio import confined, printable, read_json
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.transformer import TransformerLM

_MODEL_TYPE = {"llama": "standard", "diffllama": "diff"}


def _rope_perm(d: int) -> Tensor:
    """perm (d,) with neox_vec = interleaved_vec[perm]: even coordinates first, then odd ones."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))


def _permute_within_heads(w: Tensor, d: int, perm: Tensor) -> Tensor:
    """Reorder the d rows of every head of a projection weight w: (n·d, E) by ``perm`` (d,)."""
    n = w.shape[0] // d
    return w.reshape(n, d, -1)[:, perm.to(w.device)].reshape(w.shape)


def _pairs_to_halves(w: Tensor, d: int) -> Tensor:
    """Official -> DiffLlama sub-head order. w: (2n·d, E) with sub-heads [a0, b0, a1, b1, ...] ->
    [a0, a1, ..., b0, b1, ...]."""
    n = w.shape[0] // (2 * d)
    return w.reshape(n, 2, d, -1).transpose(0, 1).reshape(w.shape)


def halves_to_pairs(w: Tensor, d: int) -> Tensor:
    """DiffLlama -> official sub-head order (inverse of :func:`_pairs_to_halves`)."""
    n = w.shape[0] // (2 * d)
    return w.reshape(2, n, d, -1).transpose(0, 1).reshape(w.shape)


def from_hf_config(hf_config: Any, rope: str = "neox") -> ModelConfig:
    """The :class:`ModelConfig` of a ``LlamaConfig`` / ``DiffLlamaConfig``. ``rope`` picks our RoPE style
    ("neox" or "interleaved"); both are exact, see the module docstring. Raises ValueError for HF settings
    our models cannot express (RoPE scaling, biases, another activation, a head_dim that does not divide
    hidden_size, ...)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _MODEL_TYPE:
        raise ValueError(f"cannot convert a transformers config of model_type {model_type!r}; "
                         f"supported: {sorted(_MODEL_TYPE)}")
    if rope not in ("neox", "interleaved"):
        raise ValueError(f"rope must be 'neox' or 'interleaved', got {rope!r}")
    attention = _MODEL_TYPE[model_type]

    def refuse(msg: str) -> None:
        raise ValueError(f"cannot convert {type(hf_config).__name__}: {msg}")

    if hf_config.hidden_act != "silu":
        refuse(f"hidden_act={hf_config.hidden_act!r}; our MLP is SwiGLU (silu)")
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        refuse("attention_bias / mlp_bias are set; only bias-free models are supported")
    if getattr(hf_config, "attention_dropout", 0.0):
        refuse(f"attention_dropout={hf_config.attention_dropout}; only 0 is supported")
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rp.get("rope_type", "default") != "default":
        refuse(f"rope_type={rp.get('rope_type')!r}; only plain RoPE ('default') is supported")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor={rp['partial_rotary_factor']}; only full-width RoPE is supported")
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        refuse("no rope_theta found in rope_parameters")

    split = 2 if attention == "diff" else 1
    n_sub = hf_config.num_attention_heads
    n_kv_sub = hf_config.num_key_value_heads or n_sub
    if n_sub % split or n_kv_sub % split:
        refuse(f"DiffLlama needs even num_attention_heads / num_key_value_heads, got {n_sub} / {n_kv_sub}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_sub
    n_heads, kv = n_sub // split, n_kv_sub // split
    lambda_std = getattr(hf_config, "lambda_std_dev", None)  # Llama has none: keep our default
    cfg = ModelConfig(
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=None if kv == n_heads else kv,
        attention=attention,
        max_seq_len=hf_config.max_position_embeddings,
        rope=rope,
        rope_theta=float(theta),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        norm_eps=float(hf_config.rms_norm_eps),
        init_std=float(hf_config.initializer_range),
        lambda_std=0.1 if lambda_std is None else float(lambda_std),
        # keep head_dim=None when it is the derived width, so configs round-trip unchanged
        head_dim=None if head_dim * n_sub == hf_config.hidden_size else int(head_dim),
    )
    # Keep ffn_hidden=None when it is our default, so configs round-trip unchanged.
    if cfg.ffn_dim != hf_config.intermediate_size:
        cfg = cfg.replace(ffn_hidden=int(hf_config.intermediate_size))
    return cfg


def _layer_names(i: int) -> list[tuple[str, str]]:
    """(ours, HF) names of the per-layer tensors that copy across unchanged."""
    ours, hf = f"body.blocks.{i}.", f"model.layers.{i}."
    return [
        (ours + "attn_norm.weight", hf + "input_layernorm.weight"),
        (ours + "ffn_norm.weight", hf + "post_attention_layernorm.weight"),
        (ours + "ffn.gate_proj.weight", hf + "mlp.gate_proj.weight"),
        (ours + "ffn.up_proj.weight", hf + "mlp.up_proj.weight"),
        (ours + "ffn.down_proj.weight", hf + "mlp.down_proj.weight"),
    ]


_GLOBAL_NAMES = [("body.tok_emb.weight", "model.embed_tokens.weight"),
                 ("body.norm.weight", "model.norm.weight"),
                 ("lm_head.weight", "lm_head.weight")]


_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def read_hf_folder(path: str | os.PathLike, rope: str = "neox") -> TransformerLM:
    """The :class:`TransformerLM` of a local transformers folder (``save_pretrained`` output: config.json and
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``) of a ``llama`` or ``diffllama``
    model, in fp32 on the CPU, eval mode. Nothing is downloaded. Raises ValueError naming what is missing or
    what our models cannot express."""
    folder = Path(path)
    if not confined(folder, "config.json").is_file():
        raise ValueError(f"{folder}: not a transformers model folder (no config.json)")
    try:
        raw = read_json(folder / "config.json")
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}/config.json: not valid JSON: {printable(e)}") from None
    cfg = from_hf_config(config_namespace(raw), rope=rope)
    files = weight_files(folder)
    check_fits(cfg, str(folder), copies=2)  # the files' tensors in fp32 and the model: refused before either
    src: dict[str, Tensor] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    src[key] = f.get_tensor(key).float()
        except (SafetensorError, OSError) as e:  # an empty or truncated file
            raise ValueError(f"{folder / printable(name)}: not a readable safetensors file "
                             f"({printable(str(e).splitlines()[0] if str(e) else type(e).__name__)})") from None
    return _build_from_hf_state(cfg, src, rope, torch.device("cpu"), torch.float32)


INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a transformers folder: ``model.safetensors``, or those the index's
    ``weight_map`` names, each a plain file name inside the folder (no ``..``, no path, no link out of it but
    into a Hugging Face cache's blobs/), checked before any is opened. ValueError (UnsafePath) otherwise."""
    if confined(folder, INDEX).is_file():
        try:
            index = read_json(folder / INDEX)
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder / INDEX}: not valid JSON: {printable(e)}") from None
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise ValueError(f"{folder / INDEX}: no \"weight_map\" object naming the weight files; the folder is "
                             "damaged or not a transformers model")
        files: set[str] = set()
        for v in wmap.values():
            if not (isinstance(v, str) and v in files):
                files.add(confined(folder, v, what=f"{INDEX} weight file").name)
        return sorted(files)
    if confined(folder, "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError(f"{folder}: no model.safetensors or {INDEX} (only safetensors weights are read; nothing is "
                     "unpickled)")


# transformers' LlamaConfig defaults for keys an older or hand-written config.json may leave out
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02, "head_dim": None,
    "max_position_embeddings": 2048, "lambda_std_dev": None,
}


def config_namespace(raw: dict[str, Any]) -> Any:
    """A config.json dict as the attribute object :func:`from_hf_config` reads, without importing transformers
    (seconds of start-up): LlamaConfig's defaults for absent keys; old-style ``rope_theta``/``rope_scaling``
    folded into ``rope_parameters``."""
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold a JSON object")
    need = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads"]
    missing = [k for k in need if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    d = {**_LLAMA_DEFAULTS, **raw}
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]
    if not d.get("rope_parameters"):
        scaling = dict(d.get("rope_scaling") or {})
        if "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        d["rope_parameters"] = {"rope_type": "default", **scaling, "rope_theta": float(d.get("rope_theta", 10000.0))}
    return SimpleNamespace(**d)


def _build_from_hf_state(cfg: ModelConfig, src: dict[str, Tensor], rope: str, device: torch.device,
                         dtype: torch.dtype) -> TransformerLM:
    """Our model from an HF state dict ``src`` (HF names) of the network ``cfg`` describes."""
    if cfg.tie_embeddings:  # HF may leave the tied alias out of its state dict
        src.setdefault("lm_head.weight", src["model.embed_tokens.weight"])
    try:
        sd = _import_state_dict(cfg, src, rope)
    except KeyError as e:
        raise ValueError(f"HF weights lack {e.args[0]!r} (needed for {cfg.n_layers} layers)") from None
    with torch.device(device):
        model = TransformerLM(cfg)
    model.load_state_dict(sd, strict=True)
    if dtype != torch.float32:
        model.to(dtype)
    return model.eval()


def _import_state_dict(cfg: ModelConfig, src: dict[str, Tensor], rope: str) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {ours: src[hf] for ours, hf in _GLOBAL_NAMES}
    d = cfg.qk_head_dim
    inv_perm = torch.argsort(_rope_perm(d))
    for i in range(cfg.n_layers):
        sd.update({ours: src[hf] for ours, hf in _layer_names(i)})
        p, q = f"body.blocks.{i}.attn.", f"model.layers.{i}.self_attn."
        wq, wk, wv, wo = (src[q + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if cfg.attention == "diff":
            wq, wk, wv = halves_to_pairs(wq, d), halves_to_pairs(wk, d), halves_to_pairs(wv, d)
            sd.update({p + n: src[q + n] for n in _LAMBDAS})
            sd[p + "subln.weight"] = torch.ones(2 * d, dtype=wo.dtype, device=wo.device)
        if rope == "interleaved":
            wq, wk = _permute_within_heads(wq, d, inv_perm), _permute_within_heads(wk, d, inv_perm)
        sd.update({p + "q_proj.weight": wq, p + "k_proj.weight": wk, p + "v_proj.weight": wv,
                   p + "out_proj.weight": wo})
    return sd

