"""The writer of ``save_pretrained`` folders: ``model.save_pretrained(dir)`` / ``Model.from_pretrained(dir)``
(:class:`PretrainedMixin`, inherited by the models), the folder's file names and the model card: the ecosystem's
folder layout, local only. ``diffattn.load_pretrained(dir)``, which reads any model folder and picks the class,
is in :mod:`diffattn.checkpoint.model_folders` (it needs the training checkpoints, a layer above the models).

Built on ``huggingface_hub.PyTorchModelHubMixin`` (the models inherit it through :class:`PretrainedMixin`). A
folder holds::

    model.safetensors          weights (tied weights stored once), written by safetensors' save_model
    config.json                {"diffattn_class": "TransformerLM", "config": {ModelConfig fields}, ...}
    README.md                  our model card (:func:`model_card`); a README.md we did not write is kept
    diffattn_tokenizer.json    tokenizer.to_dict(), only when a tokenizer was given

What we change from the mixin's defaults, and why:

- Local folders only. The mixin's ``from_pretrained`` treats any path that is not a folder as a Hub repo id and
  downloads it; ours raises instead, and never passes a path to the Hub client.
- Strict loading. The mixin loads with ``strict=False`` (missing or unexpected weights are silently ignored);
  ours fails on any mismatch.
- No pickle. The mixin falls back to ``pytorch_model.bin`` (``torch.load``) for Hub repos without safetensors;
  that path is unreachable here.
- config.json names the class and nests the :class:`~diffattn.model.config.ModelConfig` (read back with
  ``ModelConfig.from_dict``, which rejects unknown fields, where the mixin silently drops them), plus the
  classifier's ``num_classes`` and ``pooling``.
- Each file is written to a temporary folder first and moved into place with ``os.replace``.
- The model card says what we know (config, parameters, and the training data, steps and losses when given:
  :func:`diffattn.checkpoint.model_folders.training_info` reads them from a run's checkpoint) instead of the mixin's Hub
  template.

The training checkpoint folder (:mod:`diffattn.checkpoint.format`: optimizer, RNG and train state, sha256) is separate.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, PyTorchModelHubMixin
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_SINGLE_FILE
from safetensors import SafetensorError
from safetensors.torch import load_model

from diffattn.model.config import ModelConfig
from diffattn.model.footprint import ModelTooLarge, check_fits
from diffattn.system.atomic_files import UnsafePath, as_umask_allows, confined, open_nofollow, printable, read_json
from diffattn.system.untrusted import Refused, markdown_code, markdown_text

TOKENIZER_FILE = "diffattn_tokenizer.json"
FORMAT_VERSION = 1
README = "README.md"
# First line after the front matter of every card we write: a README.md without it is the user's, and is kept.
CARD_MARKER = "<!-- model card written by diffattn save_pretrained; saving again replaces it -->"
# What save_pretrained(training=...) may say about how the weights were trained (see training_info).
TRAINING_KEYS = ("checkpoint", "data", "data_sha256", "synthetic", "steps", "tokens_seen", "final_train_loss",
                 "final_val_loss", "best_val_loss", "val_accuracy")


class PretrainedError(Refused):
    """A folder that is not a readable save_pretrained folder."""


class PretrainedMixin(
    PyTorchModelHubMixin,
    library_name="diffattn",
    tags=["diffattn", "differential-attention"],
):
    """``save_pretrained`` / ``from_pretrained`` for diffattn models (``self.config`` is a ModelConfig)."""

    def pretrained_kwargs(self) -> dict[str, Any]:
        """Constructor arguments besides ``config`` (JSON values)."""
        return {}

    def save_pretrained(self, save_directory: str | os.PathLike, *, tokenizer: Any = None,
                        training: dict[str, Any] | None = None) -> None:
        """Write weights (safetensors), config.json, a model card and, if given, the tokenizer (an object with
        ``to_dict()``, or that dict) to ``save_directory``. ``training`` (keys in ``TRAINING_KEYS``, e.g.
        ``training_info(checkpoint)``) goes into the card. Nothing goes over the network."""
        out = Path(save_directory)
        tok = tokenizer.to_dict() if hasattr(tokenizer, "to_dict") else tokenizer
        if tok is not None and not isinstance(tok, dict):
            raise TypeError(f"tokenizer must have to_dict() or be a dict, got {type(tokenizer).__name__}")
        _check_training(training)
        config = {"diffattn_class": type(self).__name__, "diffattn_format": FORMAT_VERSION,
                  "config": self.config.to_dict(), **self.pretrained_kwargs()}
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out, prefix=".tmp-save-") as tmp:
            super().save_pretrained(tmp, config=config, model_card_kwargs={
                "training": training, "path": str(out), "has_tokenizer": tok is not None})
            names = [SAFETENSORS_SINGLE_FILE, CONFIG_NAME]
            if tok is not None:
                (Path(tmp) / TOKENIZER_FILE).write_text(json.dumps(tok))
                names.append(TOKENIZER_FILE)
            if _ours_or_absent(out / README):
                names.append(README)
            for name in names:
                as_umask_allows(Path(tmp) / name)  # the mixin writes the weights 0600: a shared folder needs more
                os.replace(Path(tmp) / name, out / name)
        if tok is None:  # a tokenizer left by an earlier save would not belong to this model
            (out / TOKENIZER_FILE).unlink(missing_ok=True)

    def generate_model_card(self, training: dict[str, Any] | None = None, path: str = "PATH",
                            has_tokenizer: bool = False) -> ModelCard:
        """The mixin writes README.md from this: :func:`model_card`, not the mixin's Hub template."""
        return ModelCard(model_card(self, training=training, path=path, has_tokenizer=has_tokenizer))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, map_location: str = "cpu",
                        **kwargs: Any):
        """Load a folder written by ``save_pretrained``, strictly (every weight must match). Local only."""
        if kwargs:
            raise TypeError(f"unexpected argument(s) {sorted(kwargs)}; diffattn loads local folders only")
        path = check_folder(pretrained_model_name_or_path)
        saved = read_config(path)["diffattn_class"]
        if saved != cls.__name__:
            raise PretrainedError(f"{path} holds a {saved}, not a {cls.__name__} (use diffattn.load_pretrained)")
        return super().from_pretrained(str(path), local_files_only=True, map_location=map_location)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, map_location: str = "cpu", config: Any = None, **kwargs: Any):
        for hub_arg in ("revision", "cache_dir", "force_download", "local_files_only", "token"):
            kwargs.pop(hub_arg, None)
        cfg = ModelConfig.from_dict(config)
        classes = kwargs.get("num_classes", 0)
        try:  # the file's tensors and the model: refused before either is read when they cannot fit
            check_fits(cfg, model_id, copies=2, num_classes=classes if isinstance(classes, int) else 0)
            model = cls(cfg, **kwargs)
            load_model(model, os.path.join(model_id, SAFETENSORS_SINGLE_FILE), strict=True, device=map_location)
        except ModelTooLarge as e:
            raise PretrainedError(str(e)) from None
        except (ValueError, TypeError) as e:  # the classifier's head in config.json: num_classes, pooling
            raise PretrainedError(f"{model_id}: {CONFIG_NAME} is invalid: {printable(e)}") from None
        except (SafetensorError, RuntimeError) as e:  # an empty or damaged file, weights of another shape
            why = printable(" ".join(str(e).split()) or type(e).__name__)  # torch's key lists, on one line
            raise PretrainedError(f"{model_id}: {SAFETENSORS_SINGLE_FILE} cannot be loaded into the model its "
                                  f"{CONFIG_NAME} describes: {why}") from None
        return model.eval()


def check_folder(path: str | os.PathLike) -> Path:
    """``path`` as a save_pretrained folder: its config and weights present, and, as every file of a model
    folder, no link out of it (a link may point inside it, or into a Hugging Face cache's blobs/)."""
    p = Path(path)
    if not p.is_dir():
        raise PretrainedError(f"{printable(repr(str(p)))} is not a folder (diffattn loads local save_pretrained "
                              "folders only)")
    for name in (CONFIG_NAME, SAFETENSORS_SINGLE_FILE, TOKENIZER_FILE):
        try:
            f = confined(p, name)
        except UnsafePath as e:
            raise PretrainedError(str(e)) from None
        if name != TOKENIZER_FILE and not f.is_file():
            raise PretrainedError(f"{p}: no {name}; not a save_pretrained folder")
    return p


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a save_pretrained folder, checked for the fields diffattn needs."""
    p = check_folder(path)
    try:
        cfg = read_json(p / CONFIG_NAME)
    except (OSError, ValueError) as e:  # invalid UTF-8 or JSON, a FIFO, nested too deeply
        raise PretrainedError(f"{p / CONFIG_NAME}: not valid JSON: {printable(e)}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("diffattn_class"), str) or not isinstance(
            cfg.get("config"), dict):
        raise PretrainedError(f"{p / CONFIG_NAME}: not a diffattn config (needs 'diffattn_class' and 'config')")
    return cfg


# ------------------------------------------------------------------------------------------------ model card


def _check_training(training: dict[str, Any] | None) -> None:
    if training is None:
        return
    if not isinstance(training, dict):
        raise TypeError("training must be a dict: diffattn.checkpoint.model_folders.training_info(RUN_FOLDER) makes "
                        f"one; got {type(training).__name__}")
    unknown = sorted(set(training) - set(TRAINING_KEYS))
    if unknown:
        raise TypeError(f"training: unknown key(s) {unknown}; known: {list(TRAINING_KEYS)}")


def _ours_or_absent(readme: Path) -> bool:
    """Whether save_pretrained may (re)write ``readme``: absent, or a card an earlier save wrote."""
    try:
        with open_nofollow(readme, "rb") as f:  # a link is not ours: it is kept (never read through)
            return CARD_MARKER in f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return True
    except (OSError, UnsafePath):
        return False


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _model_lines(model: Any) -> list[str]:
    c = model.config
    kind = {"TransformerLM": "causal language model", "TransformerEncoder": "bidirectional encoder",
            "TransformerClassifier": "sequence classifier: an encoder and a linear head on the pooled states"}.get(
        type(model).__name__, "model")
    kv = f", {_count(c.n_kv_heads, 'KV head')}" if c.n_kv_heads not in (None, c.n_heads) else ""
    n_params = sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once
    lines = [
        f"- Class: `{type(model).__name__}`, a {kind}",
        f"- Attention: `{c.attention}`" + (" with shared Q/K projections" if c.shared_qk else ""),
        f"- Shape: {_count(c.n_layers, 'layer')}, d_model {c.d_model}, {_count(c.n_heads, 'head')}{kv}, "
        f"vocabulary {c.vocab_size}, max sequence length {c.max_seq_len}",
        f"- Positions: {'none' if c.rope == 'none' else f'RoPE ({c.rope}, θ = {c.rope_theta:g})'}",
        f"- Parameters: {n_params:,}" + (" (tied input and output embeddings counted once)"
                                          if c.tie_embeddings and type(model).__name__ == "TransformerLM" else ""),
    ]
    if hasattr(model, "pretrained_kwargs") and model.pretrained_kwargs():
        extra = model.pretrained_kwargs()
        lines.append("- Head: " + ", ".join(f"{k} {v}" for k, v in extra.items()))
    return lines


def _training_lines(training: dict[str, Any] | None) -> list[str]:
    if not training:
        return ["No training information was given when this folder was saved (`save_pretrained(..., "
                "training=diffattn.checkpoint.model_folders.training_info(run_folder))` records it). The weights "
                "may be untrained or converted."]
    # every value comes from a checkpoint (a file from elsewhere): shown as text, never as Markdown or HTML
    t, code, text = training, markdown_code, markdown_text
    lines = []
    if "data" in t:
        lines.append(f"- Data: {code(t['data'])}")
    sha = t.get("data_sha256")
    if isinstance(sha, str):
        lines.append(f"- Data sha256: {code(sha)}")
    elif isinstance(sha, dict) and len(sha) == 1:
        lines.append(f"- Data sha256: {code(next(iter(sha.values())))}")
    elif isinstance(sha, dict) and sha:
        lines.append(f"- Data sha256 ({len(sha)} files):")
        lines += [f"  - {code(name)}: {code(digest)}" for name, digest in sha.items()]
    if "synthetic" in t:
        lines.append(f"- Data: the synthetic task {code(t['synthetic'])}")
    for key, label in (("steps", "Steps"), ("tokens_seen", "Tokens seen")):
        if key in t:
            v = t[key]
            lines.append(f"- {label}: {v:,}" if isinstance(v, int) else f"- {label}: {text(v)}")
    for key, label in (("final_train_loss", "Final training loss"), ("final_val_loss", "Final validation loss"),
                       ("best_val_loss", "Best validation loss"), ("val_accuracy", "Validation accuracy")):
        if key in t:
            v = t[key]
            lines.append(f"- {label}: {v:.4f}" if isinstance(v, float) else f"- {label}: {text(v)}")
    if "checkpoint" in t:
        lines.append(f"- From the training checkpoint {code(t['checkpoint'])}")
    return lines


def model_card(model: Any, *, training: dict[str, Any] | None = None, path: str = "PATH",
               has_tokenizer: bool = False) -> str:
    """README.md for a save_pretrained folder: the model's config and size, how it was trained (``training``,
    keys in ``TRAINING_KEYS``), and how to load it from ``path``."""
    _check_training(training)
    name = type(model).__name__
    quoted = json.dumps(path)  # a valid Python string literal for any path
    load = [f"model = diffattn.load_pretrained({quoted})  # a {name}, in eval mode, on the CPU"]
    if has_tokenizer:
        load.append(f"tokenizer = diffattn.load_pretrained_tokenizer({quoted})")
    return "\n".join([
        "---",
        "library_name: diffattn",
        "tags:",
        "- diffattn",
        "- differential-attention",
        "---",
        CARD_MARKER,
        "",
        f"# {name} with `{model.config.attention}` attention",
        "",
        "Saved by diffattn's `save_pretrained`: weights in `model.safetensors`, the full "
        "configuration in `config.json`" + (", the tokenizer in `" + TOKENIZER_FILE + "`" if has_tokenizer else "")
        + ".",
        "",
        "## Model",
        "",
        *_model_lines(model),
        "",
        "## Training",
        "",
        *_training_lines(training),
        "",
        "## Loading",
        "",
        "```python",
        "import diffattn",
        "",
        *load,
        "```",
        "",
        "Loading reads local folders only and checks every weight against the config (strict); nothing is "
        "downloaded and nothing is unpickled.",
        "",
    ])
