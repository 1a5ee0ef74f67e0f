"""A diffattn language model as a transformers folder: ``diffattn export RUN --to hf --out DIR``.

The folder holds what ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` read, offline:

* ``config.json`` and ``model.safetensors``: a ``standard`` model as the family it was read from (its class:
  :mod:`diffattn.checkpoint.hf_family_table`), a ``diff`` one as ``DiffLlamaForCausalLM``, built by
  :func:`diffattn.interop.hf.to_hf` (exact re-layout; same logits to float rounding; no ``trust_remote_code``).
  Every other model (another attention type, mixed layers, head-selected heads, an option those classes lack:
  :func:`native_problems`) as a custom-code folder (:mod:`diffattn.interop.hf_custom`): ``DiffattnForCausalLM``,
  diffattn's own model code beside the weights, loaded with ``trust_remote_code=True``;
* ``tokenizer.json`` + ``tokenizer_config.json``: a transformers fast tokenizer giving the run's ids. A BPE or
  HF tokenizer is its own ``tokenizers`` JSON; the char tokenizer is expressed as one
  (:meth:`diffattn.model.tokenizer.CharTokenizer.to_tokenizers`);
* ``generation_config.json`` and a short model card (``README.md``).

What cannot be exported at all (:func:`export_problems`: not a language model, a checkpoint from the middle of a
retrofit schedule) is refused in one message before anything is written. The files are written complete in a
staging folder, then moved in one by one with ``config.json`` last, so a folder that stops half-way is never
mistaken for a loadable model.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.checkpoint.hf_family_table import family_of
from diffattn.checkpoint.output_guard import first_missing
from diffattn.interop.hf import export_problems as config_problems
from diffattn.interop.hf import require_transformers, to_hf
from diffattn.interop.hf_custom import ARCHITECTURE, CODE_FILES, config_types, write_custom
from diffattn.interop.hf_snapshot import snapshot_problems
from diffattn.model.footprint import check_fits
from diffattn.model.tokenizer import CharTokenizer, prefix_token
from diffattn.model.transformer import TransformerLM
from diffattn.system.atomic_files import as_umask_allows
from diffattn.system.run_lock import LOCK_NAME
from diffattn.system.untrusted import markdown_code, markdown_text

#: What an export writes (and all that ``--overwrite`` may replace in a used folder).
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
            "model-*-of-*.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "README.md", *CODE_FILES)

SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog.\nROMEO: But soft, what light!"


def export_problems(model: nn.Module) -> list[str]:
    """Every reason ``model`` cannot be exported to transformers at all, one phrase each (empty: it can, as a
    native class or, failing that, as a custom-code folder: :func:`native_problems`)."""
    if not isinstance(model, TransformerLM):
        return [f"only language models (TransformerLM) export to transformers; this is a {type(model).__name__}"]
    if any(getattr(m, "retrofitting", False) for m in model.modules()):
        return ["it was saved in the middle of its retrofit schedule (a blend the exported model would not "
                "compute): export a checkpoint from the end of the schedule on"]
    return snapshot_problems(config_types(model.config)) if native_problems(model) else []


def native_problems(model: TransformerLM) -> list[str]:
    """Every reason no class transformers ships computes ``model`` (empty: Llama, Qwen2, ..., DiffLlama does);
    such a model is exported as a custom-code folder (:mod:`diffattn.interop.hf_custom`)."""
    if model.config.mixed:
        return [f"its layers mix attention types ({', '.join(model.config.layer_attention)}: a selective "
                "retrofit) and a transformers model class has one attention type for all its layers"]
    if model.config.diff_heads is not None:
        return ["its negative map is on for some heads only (diff_heads: a selective retrofit), which no "
                "transformers model class expresses"]
    return config_problems(model.config)


def check_exportable(model: nn.Module) -> None:
    """Raise ValueError naming every reason ``model`` cannot be exported (one line)."""
    problems = export_problems(model)
    if problems:
        raise ValueError("cannot export to transformers: " + "; ".join(problems))


def hf_tokenizer(tokenizer: Any, max_len: int) -> Any:
    """A transformers fast tokenizer (``PreTrainedTokenizerFast``) giving ``tokenizer``'s ids for every text.
    Our tokenizers have no special tokens except an HF tokenizer's own (its post-processor, e.g. a BOS, still
    applies, and the BOS it adds is named ``bos_token``, so lm-evaluation-harness's ``hf`` model conditions on it
    as ``--model diffattn`` does) and the char tokenizer's unseen-character id (its unk token). Decoding leaves
    spaces as they are. No BOS/EOS is made up (:func:`lm_eval_prefix` says why)."""
    tf = require_transformers()
    kw: dict[str, Any] = {}
    if isinstance(tokenizer, CharTokenizer) and tokenizer.unk:
        kw["unk_token"] = tokenizer.unk_text
    found = prefix_token(tokenizer)
    if found is not None and found[1] == "bos":
        kw["bos_token"] = tokenizer.tok.id_to_token(found[0])
    return tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer.to_tokenizers(), model_max_length=max_len,
                                      clean_up_tokenization_spaces=False, **kw)


def provenance_text(provenance: dict[str, Any]) -> str:
    """`` from `SOURCE` (step N)``: where an export came from, as a model card says it; the source and step, read
    from elsewhere, are Markdown text that shows them as they are (no tag, link or code span can start)."""
    step = provenance.get("step")
    return (f" from {markdown_code(provenance.get('source', '?'))}"
            + (f" (step {markdown_text(step)})" if step is not None else ""))


def lm_eval_prefix(tokenizer: Any) -> int | None:
    """The id lm-evaluation-harness's ``hf`` model must be given as ``prefix_token_id`` on the export (None: none
    is needed, the export names its BOS, or none exists): the line break's, what ``--model diffattn`` conditions a
    text's first token on (:func:`diffattn.model.tokenizer.prefix_token`).

    lm-eval 0.4.13 takes that token from the tokenizer's BOS, else its EOS, and decodes it on every encode (None
    fails with ``TypeError: 'None' is not an instance of 'Sequence'``). Our char and BPE tokenizers have neither:
    the training text is documents joined by line breaks, with no end-of-text token. The export makes none up:
    naming the line break BOS or EOS would make it a special token (transformers 5 registers every named one as
    special, whatever tokenizer_config.json says), and decoding with ``skip_special_tokens=True`` (transformers'
    text-generation pipeline, vLLM, lm-eval's own generate_until) would drop every line break of a generated text;
    as EOS it would also end every generation at the first line break."""
    found = None if tokenizer is None else prefix_token(tokenizer)
    return found[0] if found is not None and found[1] == "line break" else None


def _model_card(model: TransformerLM, cls: str, provenance: dict[str, Any], tokenizer: Any,
                custom: bool) -> str:
    cfg = model.config
    what = (f"layers {', '.join(cfg.layer_attention)}" if cfg.mixed else f"`{cfg.attention}` attention")
    remote = ", trust_remote_code=True" if custom else ""
    lines = [
        "---", "library_name: transformers", "tags:", "- diffattn", f"- {cfg.attention}", "---", "",
        f"# {cls} exported from diffattn", "",
        f"A {what} language model ({model.num_params():,} parameters: {cfg.n_layers} layers, "
        f"d_model {cfg.d_model}, context {cfg.max_seq_len}) exported by `diffattn export`"
        + provenance_text(provenance) + ". "
        + ("transformers ships no class for it: this folder carries diffattn's own model code "
           "(`modeling_diffattn.py` and the `diffattn_*.py` modules it imports), which transformers runs when "
           "asked with `trust_remote_code=True`; diffattn need not be installed. The logits equal the diffattn "
           "model's." if custom else
           "The weights are re-laid out exactly: the logits equal the diffattn model's to float rounding."), "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("PATH"{remote})',
    ]
    has_tokenizer = tokenizer is not None
    if has_tokenizer:
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("PATH"{remote})')
    lines += ["```", ""]
    prefix = lm_eval_prefix(tokenizer)
    if prefix is not None:
        lines += ["The tokenizer has no BOS/EOS token: the model was trained on documents joined by line breaks, with "
                  "no end-of-text token, and none is made up (as a BOS or EOS the line break would be a special "
                  "token, dropped from every text decoded with `skip_special_tokens=True`). "
                  "lm-evaluation-harness's `hf` model needs the token a text's first token is conditioned on: give "
                  "it the line break's, as `--model diffattn` uses, and both give the same numbers:", "",
                  "```", f"lm_eval --model hf --model_args pretrained=PATH,prefix_token_id={prefix}"
                  + (",trust_remote_code=True" if custom else "") + " --tasks ...", "```", ""]
    if not has_tokenizer:
        lines += ["The run had no tokenizer, so this folder has none.", ""]
    return "\n".join(lines)


def _generation_config(hf_config: Any, tok: Any) -> Any:
    tf = require_transformers()
    gen = tf.GenerationConfig.from_model_config(hf_config)
    if tok is not None:  # our tokenizers have no BOS/EOS; an HF tokenizer may name its own
        gen.bos_token_id, gen.eos_token_id = tok.bos_token_id, tok.eos_token_id
    return gen


@contextlib.contextmanager
def _quiet(tf: Any) -> Iterator[None]:
    """transformers' progress bars off for the block (a 1-file save or load needs none), then as they were."""
    was = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tf.utils.logging.enable_progress_bar()


def _compatible_config(path: Path, rope_theta: float, local_theta: float | None = None) -> None:
    """Also name RoPE's theta the way transformers 4.x reads it (top-level ``rope_theta``, and Gemma 3's
    ``rope_local_base_freq``); 5.x reads ``rope_parameters`` and ignores them."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.setdefault("rope_theta", float(rope_theta))
    family = family_of(cfg.get("model_type"))
    if family is not None and family.local_rope:
        cfg.setdefault("rope_local_base_freq", float(rope_theta if local_theta is None else local_theta))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _compatible_tokenizer_config(path: Path) -> None:
    """``PreTrainedTokenizerFast``, the class name both transformers 4.x and 5.x load a tokenizer.json with
    (5.x writes its own alias ``TokenizersBackend``, which 4.x does not know)."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _move_in(stage: Path, out: Path, owned: tuple[str, ...] = HF_FILES) -> None:
    """Move every file of ``stage`` into ``out``, config.json last. The previous export's config.json goes
    first, then its files (``owned``) that this one does not write."""
    new = sorted(p.name for p in stage.iterdir())
    as_umask_allows(stage)  # transformers writes the weights 0600 (a temp file); a folder to share gets the umask
    (out / "config.json").unlink(missing_ok=True)
    for pattern in owned:
        for old in out.glob(pattern):
            if old.name not in new and old.is_file():
                old.unlink()
    for name in [n for n in new if n != "config.json"] + ["config.json"]:
        os.replace(stage / name, out / name)


def export_hf(model: TransformerLM, tokenizer: Any, out: str | os.PathLike, *,
              provenance: dict[str, Any] | None = None) -> list[str]:
    """Write ``model`` (and ``tokenizer``, when not None) to the folder ``out`` as a transformers model: its
    family's class (Llama, ..., DiffLlama) when one computes it, else a custom-code folder
    (:mod:`diffattn.interop.hf_custom`, loaded with ``trust_remote_code=True``).

    Validate ``out`` first (``check_output_dir(owned_patterns=HF_FILES)``); this raises ValueError, before
    writing anything, when the model cannot be exported (:func:`export_problems`). In a folder that holds other
    files only the export's own files (:data:`HF_FILES`) are replaced; their names are returned."""
    check_exportable(model)
    check_fits(model.config, "export", copies=2)  # the transformers copy, and its fp32 copy when it differs
    tf = require_transformers()
    custom = bool(native_problems(model))
    hf = None if custom else to_hf(model).float().cpu()  # a copy: the caller's model keeps its dtype and device
    tok = hf_tokenizer(tokenizer, model.config.max_seq_len) if tokenizer is not None else None

    def fill(stage: Path) -> None:
        if hf is None:
            config = write_custom(model, stage)
            _generation_config(config, tok).save_pretrained(stage)
            cls = ARCHITECTURE
        else:
            hf.generation_config = _generation_config(hf.config, tok)
            with _quiet(tf):
                hf.save_pretrained(stage, safe_serialization=True)
            _compatible_config(stage / "config.json", model.config.rope_theta, model.config.rope_local_theta)
            cls = type(hf).__name__
        if tok is not None:
            save_tokenizer(tok, stage)
        card = _model_card(model, cls, provenance or {}, tokenizer, custom)
        (stage / "README.md").write_text(card, encoding="utf-8")

    return write_folder(out, fill, HF_FILES)


def save_tokenizer(tok: Any, folder: Path) -> None:
    """Write the transformers fast tokenizer ``tok`` (:func:`hf_tokenizer`) as both transformers 4.x and 5.x
    read it."""
    tok.save_pretrained(folder)
    _compatible_tokenizer_config(folder / "tokenizer_config.json")


def write_folder(out: str | os.PathLike, fill: Callable[[Path], None], owned: tuple[str, ...]) -> list[str]:
    """Write a model folder ``out`` whole or not at all: ``fill(stage)`` writes the files into a staging folder
    inside ``out``, then they are moved in with config.json last (:func:`_move_in`; files matching ``owned``
    that this export does not write go). On any failure the staging folder, and any folder this call created,
    are removed. Returns the names of the other files ``out`` holds (left as they were)."""
    out = Path(out)
    others = sorted(p.name for p in out.iterdir() if not any(p.match(pat) for pat in owned)
                    and p.name != LOCK_NAME) if out.is_dir() else []
    created = first_missing(out)
    out.mkdir(parents=True, exist_ok=True)
    # inside out: same file system, so the moves are renames; made new (a name nothing there can already be)
    stage = Path(tempfile.mkdtemp(prefix=f".export-{os.getpid()}-", dir=out))
    try:
        fill(stage)
        _move_in(stage, out, owned)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created is not None:  # leave no empty folder behind
            for q in (out.absolute(), *out.absolute().parents):
                try:
                    q.rmdir()
                except OSError:
                    break
                if q == created.absolute():
                    break
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return others


def _custom_code(out: str | os.PathLike) -> bool:
    """Whether the export at ``out`` is a custom-code folder (our own config.json names its code)."""
    return "auto_map" in json.loads((Path(out) / "config.json").read_text(encoding="utf-8"))


@torch.no_grad()
def check_export(model: TransformerLM, tokenizer: Any, out: str | os.PathLike, *, seed: int = 0,
                 text: str = SAMPLE_TEXT) -> dict[str, Any]:
    """Read ``out`` back with ``AutoModelForCausalLM`` / ``AutoTokenizer`` (offline) and compare with the
    original: ``max_abs_logits`` (max |Δ| of fp32 logits on 2 × min(64, context) random ids), ``tokens``
    (how many ids of ``text``'s encodable characters were compared, 0 without a tokenizer) and
    ``same_ids`` (whether they were all equal)."""
    tf = require_transformers()
    with _quiet(tf):
        hf = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True,
                                                     trust_remote_code=_custom_code(out)).eval()
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, min(64, cfg.max_seq_len)), generator=g)
    p = next(model.parameters())
    if p.dtype != torch.float32 or p.device.type != "cpu":  # compare in fp32 on the CPU, leave the caller's as it is
        model = copy.deepcopy(model).float().cpu()
    err = (model(ids) - hf(ids).logits).abs().max().item()  # dropout is 0 (export refuses it): mode is moot
    result: dict[str, Any] = {"class": type(hf).__name__, "max_abs_logits": err, "tokens": 0, "same_ids": True}
    if tokenizer is not None:
        auto = tf.AutoTokenizer.from_pretrained(out, local_files_only=True, trust_remote_code=_custom_code(out))
        if isinstance(tokenizer, CharTokenizer) and not tokenizer.unk:  # only characters it knows
            text = "".join(c for c in text if c in tokenizer.index) or "".join(tokenizer.chars[:32])
        text = text[:cfg.max_seq_len]  # within the model's length, so transformers does not warn
        ours = tokenizer.encode(text)
        theirs = auto(text)["input_ids"]
        result.update(tokens=len(ours), same_ids=ours == theirs,
                      same_text=auto.decode(theirs) == tokenizer.decode(ours))
    return result
