"""transformers' own greedy text for a prompt, to hold beside `diffattn generate FOLDER --prompt P --temperature 0`.

    python docs/results/families/greedy_transformers.py FOLDER "PROMPT" NEW_TOKENS

The prompt is encoded from the folder's tokenizer.json as diffattn encodes it (the tokenizer's post-processor
applied: Gemma's BOS), continued by ``AutoModelForCausalLM.generate`` in fp32 (greedy, no early stop), and printed
as `diffattn generate` prints it: the prompt, then the new tokens decoded."""

import sys

import torch
import transformers
from tokenizers import Tokenizer

folder, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
ids = tok.encode(prompt).ids
hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
print(prompt + tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=False))
