"""``diffattn export RUN --to vllm --out DIR``: one folder that vLLM (with diffattn's plugin installed) serves and
diffattn loads, for every attention type with a vLLM recipe, including those transformers cannot express (V2,
DINT, ALiBi, a constant λ_init, V1 without its per-head norm).

The folder is a ``save_pretrained`` folder of the served model (:func:`.served.served_model`: Shared DIFF
re-expressed as V1, K = Q written out as a key projection), so ``diffattn.load_pretrained(DIR)`` reads it,
plus what vLLM reads: config.json's ``model_type`` (``diffattn``, a config class the plugin registers with
transformers), ``architectures`` and sizes, a transformers fast tokenizer (``tokenizer.json``) giving the run's
ids, and a model card saying how to serve it. Written whole or not at all, config.json last
(:func:`diffattn.interop.hf_export.write_folder`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from diffattn.interop.hf_export import hf_tokenizer, provenance_text, save_tokenizer, write_folder
from diffattn.interop.vllm import MODEL_TYPE, SUPPORTED_TEXT
from diffattn.interop.vllm.served import hf_fields, kv_bytes_per_token, model_problems, served_model
from diffattn.model.pretrained import CARD_MARKER
from diffattn.model.transformer import TransformerLM

#: What an export writes (and all that ``--overwrite`` may replace in a used folder).
VLLM_FILES = ("config.json", "model.safetensors", "diffattn_tokenizer.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json",
              "README.md")


def export_problems(model: torch.nn.Module) -> list[str]:
    """Every reason ``model`` cannot be served by vLLM on any platform, one phrase each (empty: it can)."""
    return model_problems(model, cpu=False)


def export_vllm(model: TransformerLM, tokenizer: Any, out: str | os.PathLike, *,
                provenance: dict[str, Any] | None = None) -> list[str]:
    """Write ``model`` (and ``tokenizer``, when not None) to the folder ``out`` for vLLM and diffattn.
    Validate ``out`` first (``check_output_dir(owned_patterns=VLLM_FILES)``); raises ValueError, before writing
    anything, when vLLM cannot serve the model. Returns the names of other files ``out`` holds."""
    problems = export_problems(model)
    if problems:
        raise ValueError("cannot export for vLLM: " + "; ".join(problems))
    served = served_model(model)
    if next(served.parameters()).dtype != torch.float32 or served.lm_head.weight.device.type != "cpu":
        served = served.float().cpu() if served is not model else _copy(model)
    tok = hf_tokenizer(tokenizer, model.config.max_seq_len) if tokenizer is not None else None

    def fill(stage: Path) -> None:
        served.save_pretrained(stage, tokenizer=tokenizer)
        config = json.loads((stage / "config.json").read_text(encoding="utf-8"))
        config.update(model_type=MODEL_TYPE, architectures=["DiffattnForCausalLM"], torch_dtype="float32",
                      bos_token_id=getattr(tok, "bos_token_id", None), eos_token_id=getattr(tok, "eos_token_id", None),
                      **hf_fields(served.config))
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if tok is not None:
            save_tokenizer(tok, stage)
            gen = {k: v for k, v in (("bos_token_id", tok.bos_token_id), ("eos_token_id", tok.eos_token_id))
                   if v is not None}
            (stage / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
        (stage / "README.md").write_text(model_card(model, served, provenance or {}, tok is not None),
                                         encoding="utf-8")

    return write_folder(out, fill, VLLM_FILES)


def _copy(model: TransformerLM) -> TransformerLM:
    with torch.device("cpu"):
        copy = TransformerLM(model.config)
    copy.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()})
    return copy.eval()


def model_card(model: TransformerLM, served: TransformerLM, provenance: dict[str, Any], has_tokenizer: bool) -> str:
    cfg, scfg = model.config, served.config
    kv = kv_bytes_per_token(cfg, 2)
    how = ("" if scfg.attention == cfg.attention and not cfg.shared_qk else
           f" It is stored as the `{scfg.attention}` model computing the same function"
           + (" (K = Q written out as a key projection)" if cfg.shared_qk else "") + ".")
    if cfg.mixed:
        how += f" Its layers mix attention types ({', '.join(cfg.layer_attention)}), each served as its own type."
    return "\n".join([
        "---", "library_name: diffattn", "tags:", "- diffattn", "- vllm", f"- {cfg.attention}", "---", CARD_MARKER,
        "", f"# `{cfg.attention}` language model for vLLM, exported by diffattn", "",
        f"{served.num_params():,} parameters: {cfg.n_layers} layers, d_model {cfg.d_model}, context "
        f"{cfg.max_seq_len}; exported by `diffattn export --to vllm`{provenance_text(provenance)}."
        + how, "",
        f"KV cache: {kv['served']:,} bytes per token in bf16 ({kv['ratio']:.2f}x the floor of {kv['floor']:,}).", "",
        "```bash", f'pip install "diffattn[serve]"   # vLLM {SUPPORTED_TEXT} and the diffattn plugin',
        "vllm serve PATH", "```", "", "```python", "from vllm import LLM", 'llm = LLM(model="PATH")',
        "import diffattn", 'model = diffattn.load_pretrained("PATH")  # the same weights in diffattn', "```", "",
        *([] if has_tokenizer else ["The run had no tokenizer: give vLLM token ids (no text prompts).", ""]),
    ])
