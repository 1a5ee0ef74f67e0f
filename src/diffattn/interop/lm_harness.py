"""The lm-evaluation-harness model ``diffattn``: ``lm_eval --model diffattn --model_args pretrained=RUN --tasks ...``.

``RUN`` is any folder :func:`diffattn.load_pretrained` reads (a run folder, its ``ckpt/``, a ``save_pretrained`` or
``convert`` output, a ``compare`` cell), any attention type. The three request types of the harness:

* ``loglikelihood``: :func:`diffattn.eval.loglik.continuation_logprobs`, batched, with the harness's own
  tokenization of (context, continuation) pairs (``TemplateLM``) and its truncation rule, so a model that also
  exports to transformers scores the same under ``--model hf`` on the exported folder;
* ``loglikelihood_rolling``: the harness's disjoint rolling windows of ``max_length`` tokens, scored the same way;
* ``generate_until``: :func:`diffattn.model.generate.generate_batch` on the KV cache, ``batch_size`` prompts at a
  time, each stopping at its first stop sequence (the text is cut there, as the harness does); prompts are
  left-truncated so prompt + ``max_gen_toks`` fit in the context. Greedy unless the task samples.

Model arguments: ``pretrained`` (required), ``batch_size`` (``auto`` means ``max_batch_size``, default 32),
``device`` (CUDA when available, else the CPU, as for ``--model hf``), ``dtype`` (float32, bfloat16, float16;
default float32), ``max_length`` (default: the model's context), ``max_gen_toks`` (default: 256, or half the
context when that is less), ``prefix_token_id`` and ``seed`` (of sampled generation).

The prefix token: the harness conditions the first token of a text (an empty context, every rolling window's
start) on a BOS/EOS token. An HF tokenizer whose post-processor adds a BOS gives that; diffattn's char and BPE
tokenizers have none, so the default is the token of ``"\\n"`` when the tokenizer has one (a line break: the
nearest thing plain text has to a document boundary); ``prefix_token_id=ID`` sets it, and must be given when
there is neither.

Registration: lm-eval releases that discover plugins read this class from the ``lm_eval.models`` entry point
in diffattn's ``pyproject.toml``, so plain ``lm_eval --model diffattn`` works. lm-eval 0.4.13 has no plugin
discovery: run ``python -m diffattn.interop.lm_harness`` with the same arguments as ``lm_eval`` (it
registers the model, then runs the harness's own command line), or ``import diffattn.interop.lm_harness``
before ``lm_eval.simple_evaluate(model="diffattn", ...)``.
"""

from __future__ import annotations

import sys
from typing import Any

import lm_eval.models  # noqa: F401  (the built-in models register first: lm_eval imports them only into an empty registry)
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from diffattn.checkpoint.model_folders import load_pretrained, load_pretrained_tokenizer
from diffattn.eval.loglik import continuation_logprobs
from diffattn.model.generate import generate_batch
from diffattn.model.tokenizer import prefix_token
from diffattn.model.transformer import TransformerLM
from diffattn.system.untrusted import Refused

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}


def _batch_size(batch_size: int | str, max_batch_size: int | None) -> int:
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        return int(max_batch_size or 32)
    n = int(batch_size)
    if n < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    return n


class UnscorableText(Refused):
    """A task's text the model's tokenizer cannot encode; the command line says so in one line (exit 2)."""


class DiffattnLM(TemplateLM):
    """A diffattn language model in lm-evaluation-harness (module docstring)."""

    backend = "causal"

    def __init__(self, pretrained: str, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, dtype: str = "float32", max_length: int | None = None,
                 max_gen_toks: int | None = None, prefix_token_id: int | None = None, seed: int = 0) -> None:
        super().__init__()
        model = load_pretrained(pretrained)
        if not isinstance(model, TransformerLM):
            raise ValueError(f"{pretrained}: a {type(model).__name__}; lm-eval evaluates language models")
        self.tokenizer = load_pretrained_tokenizer(pretrained)
        if self.tokenizer is None:
            raise ValueError(f"{pretrained}: no tokenizer was saved with this model, so text cannot be scored")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
            # lm_eval's command line asks for cuda:0 by default; like its hf model, take what this machine has
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        self.model = model.to(self._device, DTYPES[dtype]).eval()
        context = model.config.max_seq_len
        self._max_length = int(max_length or context)
        if not 1 <= self._max_length <= context:
            raise ValueError(f"max_length must be in [1, {context}] (the model's context), got {max_length}")
        self._max_gen_toks = int(max_gen_toks or min(256, self._max_length // 2))
        self.batch_size_per_gpu = _batch_size(batch_size, max_batch_size)
        self._prefix = self._default_prefix() if prefix_token_id is None else int(prefix_token_id)
        self._generator = torch.Generator(device=self._device).manual_seed(int(seed))

    def _default_prefix(self) -> int | None:
        """The BOS an HF tokenizer's post-processor adds, else the line break's id (:func:`prefix_token`: the
        exported tokenizer names the same one, so ``--model hf`` conditions on it too)."""
        found = prefix_token(self.tokenizer)
        if found is None:
            return None
        if found[1] == "line break":
            print(f"note: diffattn's tokenizer has no BOS/EOS token: a text's first token is conditioned on the "
                  f"line break (id {found[0]}); model_args prefix_token_id=ID chooses another", file=sys.stderr)
        return found[0]

    # ------------------------------------------------------------------------------------- the harness's API
    @property
    def eot_token_id(self) -> int | None:
        return None  # diffattn's tokenizers have no end-of-text token; generation stops at the task's strings

    @property
    def prefix_token_id(self) -> int:
        if self._prefix is None:
            raise ValueError("this tokenizer has no BOS/EOS and no single line-break token to condition a text's "
                             "first token on; pass model_args prefix_token_id=ID")
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        inner = getattr(self.tokenizer, "tok", None)  # a tokenizers object (BPE, HF): may add special tokens
        if add_special_tokens is False and inner is not None:
            return inner.encode(string, add_special_tokens=False).ids
        try:
            return self.tokenizer.encode(string)
        except ValueError as e:  # a char model meeting a character it never saw
            raise UnscorableText(f"{e}: a char model scores only text in its own alphabet; give it tasks over "
                                 "the characters it was trained on (README: lm-evaluation-harness), or use a "
                                 "byte-level BPE model") from None

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        out = continuation_logprobs(self.model, pairs, max_length=self.max_length, batch_size=self.batch_size)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[list[int], list[int]]] = []
        counts = []
        for (text,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="rolling windows"):
            mine = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += mine
            counts.append(len(mine))
        scores = continuation_logprobs(self.model, windows, max_length=self.max_length, batch_size=self.batch_size)
        totals, at = [], 0
        for req, n in zip(requests, counts):
            totals.append(sum(s for s, _ in scores[at:at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, totals[-1])
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):  # one batch never mixes generation settings
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        results: list[str] = [""] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            n_new = int(kwargs.pop("max_gen_toks"))
            if n_new >= self.max_length:
                raise ValueError(f"max_gen_toks ({n_new}) must be less than the context ({self.max_length})")
            members.sort(key=lambda i: -len(requests[i].args[0]))
            for start in range(0, len(members), self.batch_size):
                rows = members[start:start + self.batch_size]
                texts = self._generate_rows([requests[i].args[0] for i in rows], n_new, until, kwargs)
                for i, text in zip(rows, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(rows))
        bar.close()
        return results

    def _generate_rows(self, contexts: list[str], n_new: int, until: list[str], kwargs: dict[str, Any]) -> list[str]:
        """One batch: each context's continuation, cut at its first stop sequence."""
        prompts = [self.tok_encode(c)[-(self.max_length - n_new):] for c in contexts]
        if any(not p for p in prompts):
            prompts = [p or [self.prefix_token_id] for p in prompts]
        sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        extra = sorted(set(kwargs) - SAMPLING_KEYS)
        if extra:
            raise ValueError(f"generation settings diffattn does not know: {extra}; known: "
                             f"{sorted(SAMPLING_KEYS | {'until', 'max_gen_toks'})}")

        def should_stop(_: int, ids: list[int]) -> bool:
            text = self.tokenizer.decode(ids)
            return any(u and u in text for u in until)

        new = generate_batch(self.model, prompts, n_new, temperature=float(kwargs["temperature"]) if sampled else 0.0,
                             top_k=kwargs.get("top_k") if sampled else None,
                             top_p=kwargs.get("top_p") if sampled else None,
                             generator=self._generator, should_stop=should_stop if until else None)
        return [postprocess_generated_text(self.tokenizer.decode(ids), until, None) for ids in new]


def register() -> None:
    """Make ``--model diffattn`` known to the harness in this process (no-op when already known, e.g. through the
    entry point of an lm-eval release that discovers plugins)."""
    if "diffattn" not in model_registry:
        model_registry.register("diffattn")(DiffattnLM)


register()


def main() -> None:
    """``python -m diffattn.interop.lm_harness ARGS``: lm-eval's command line, with ``--model diffattn`` known."""
    from lm_eval.__main__ import cli_evaluate  # lm-eval's own command line, only when run as a command

    try:
        cli_evaluate()
    except UnscorableText as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
