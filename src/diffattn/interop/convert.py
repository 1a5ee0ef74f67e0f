"""`diffattn convert SRC --to diff|diff_v2|gated|... --out DIR`: turn a standard-attention Llama into differential
(or gated) attention.

The targets are the registered types that declare a recipe (``convert_as`` in their file): ``diff`` and
``diff_v2``, and types built on V1's parameters whose exactness argument is V1's (``dint``: with λ = 0 its
λ·G term vanishes too, so ``--init exact`` is exact for it as well).

SRC is a local transformers Llama folder (config.json, safetensors weights, tokenizer files; nothing is
downloaded) or one of our checkpoints of a ``standard`` model. The result is a checkpoint folder of a
:class:`~diffattn.model.transformer.TransformerLM` that every other command reads (``train --init-from``, ``generate``,
``eval``, ``info``), with the source's ``tokenizer.json`` used as it is.

Notation. The source layer has h query heads and hkv KV heads of width d, q_i = W_q,i x, k_g, v_g likewise,
head i reads KV head g(i) = i // n_rep (n_rep = h / hkv), A_i = softmax(q_i k_gᵀ / √d), and
y = Σ_i W_o,i A_i v_g (W_o,i: the d columns of W_o for head i). Everything outside attention (embeddings,
norms, SwiGLU, lm_head) is copied unchanged.

``--to diff --init exact`` (V1, function-preserving). One diff-head per source head, Q/K sub-heads of width
d (``ModelConfig.head_dim = d``; the derived width would be d/2), value heads of width 2d:

* Q1_i = Q2_i = q_i, K1_g = K2_g = k_g, so A1_i = A2_i = A_i. The official GQA pairing (diff-head i reads KV
  diff-head i // n_rep) is the source's grouping, so GQA needs nothing else.
* λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init with λ_init = 0 (``lambda_init = 0.0``), λq1 = λq2 = u,
  λk1 = λk2 = w, u and w drawn like a fresh model's (N(0, lambda_std²)): the two exponentials are the same
  floating-point computation, so λ = 0 exactly. The head computes (A1 − λA2)·V = (1 − λ)·A·V = A·V.
  u, w ≠ 0 is what keeps λ off a saddle: ∂λ/∂λq1 = w·e^{u·w} = −∂λ/∂λq2 (and likewise for k) are non-zero,
  whereas u = w = 0 would give every λ vector a zero gradient forever.
* No per-head norm (``subln = False``): RMSNorm over 2d is not an identity (it rescales each token), so the
  only exact choice is to drop it (and its (1 − λ_init) factor, which is 1 here anyway).
* V_g = [v_g ; v_g] (both halves of the 2d-wide value head), and diff-head i's 2d out-projection columns
  are [½W_o,i + Δ_i | ½W_o,i − Δ_i]. Since both halves of the head output equal A_i v_g,
  (½W_o,i + Δ_i)·A v + (½W_o,i − Δ_i)·A v = W_o,i·A v: exact (up to rounding) for any Δ_i.
  Δ breaks a symmetry: with Δ = 0 the two value halves get identical gradients (both read ½W_o,i) and the two
  column halves get identical gradients (both see the same head output), so under AdamW they would stay
  equal forever and the doubled value width would be wasted; Δ ≠ 0 gives the halves different gradients from
  the first step. Δ ~ N(0, (s·std(W_o))²) with s = ``break_symmetry`` (default 0.5; 0 reproduces the tie).
* Gradients at the start: Q2/K2 rows get ∂L/∂(Q2,K2) ∝ λ = 0 at step 0, but the λ vectors do get a gradient,
  so after one optimizer step λ ≠ 0 and every tensor conversion created has a non-zero gradient (tested).

``--to diff_v2 --init exact`` (V2, function-preserving). 2h query heads at width d sharing the source KV
heads; out_j = attn_2j − σ(W_λ x)_j·attn_2j+1. Query heads 2j and 2j+1 are both q_j (both read KV head
j // n_rep, the source's grouping), so out_j = (1 − σ)·A_j v_g; W_λ = 0 gives σ = ½ everywhere, and the
out-projection is 2·W_o (multiplying by 2 and by ½ is exact in floating point). W_λ = 0 is not a saddle:
∂L/∂W_λ = Σ_t (∂L/∂σ)·σ(1 − σ)·x_tᵀ ≠ 0; the odd query heads get −σ times the even heads' gradient, so the
copies separate from the first step.

``--to gated --init exact`` (gated attention, function-preserving). Q, K, V copied; the gate projection
W_θ = 0, so every gate is σ(0) = ½, and the out-projection is 2·W_o (exact, as V2's). ∂L/∂W_θ = Σ_t
(∂L/∂g_t)·σ'(0)·x_tᵀ ≠ 0, so the gate trains from the first step.

``--to grouped_diff --init exact`` (GDA at its default ratio r = 3, function-preserving): V1's recipe with the
source's H heads as the signal heads and, per group of r, a copy of the group's first head as its noise head
(the group reads the source head's KV head, so the source's KV heads must divide the H/r noise heads: a GQA
source, r dividing H); λ = 0 exactly, no per-head norm, V = [v; v], out columns [½W_o,i ± Δ_i] as V1's.

``--init split`` (V1 only; parameter-matched, NOT function-preserving). The paper's parameter-matched
layout: source heads 2j and 2j+1 become diff-head j (Q1 = q_2j, Q2 = q_2j+1, K1/K2 = k_2g/k_2g+1,
V = [v_2g ; v_2g+1], out columns [W_o,2j | W_o,2j+1]). In our layout that is every projection copied as it
is, with h/2 diff-heads at the source width (so hkv must be even), the paper's λ_init schedule, fresh λ
vectors and the per-head norm (gain 1). Parameters equal the source's plus 6d per layer (λ vectors and norm
gains). Each head now mixes two maps into one value head and subtracts λ·A2, so the function changes: a
starting point for fine-tuning, not a converted model. ``--to diff_v2 --init split`` is refused (V2 is not
parameter-matched by design: it has twice the query heads of its baseline).

``ModelConfig.lambda_init``, ``head_dim`` and ``subln`` record all of this; the model's ``lambda_scale``
buffers (see :func:`diffattn.model.transformer.set_lambda_scale`) let ``train.lambda_warmup_steps`` ramp the negative
map in from 0: λ_eff = s·λ (V1), σ_eff = s·σ(W_λ x) (V2), s = min(1, step / lambda_warmup_steps).
For V1 the converted model is exact at every s (λ = 0); the ramp only slows λ's growth at first. For V2 the
exactness rests on σ = ½ at s = 1 (the ×2 out-projection), so at s = 0 a V2 conversion computes twice the
source's attention output: warm-up does not suit a V2 conversion (its negative map is already in, with the
function preserved), only V2 models that do not rely on σ.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_SINGLE_FILE
from torch import Tensor

from diffattn.attention.registry import ATTENTION
from diffattn.checkpoint.format import MANIFEST, load_checkpoint, save_checkpoint
from diffattn.checkpoint.hf_folder import read_tokenizer
from diffattn.checkpoint.output_guard import CHECKPOINT_FILES
from diffattn.checkpoint.run_folder import LATEST, resolve_checkpoint_dir
from diffattn.interop.hf import read_hf_folder
from diffattn.model.config import ModelConfig
from diffattn.model.footprint import check_fits
from diffattn.model.pretrained import README, TOKENIZER_FILE
from diffattn.model.transformer import TransformerLM

# Every registered type that declares a recipe (``convert_as``): V1, V2, and the types built on V1's parameters
# and exactness argument (DINT: λ = 0 also zeroes its λ·G term).
TARGETS = tuple(sorted(n for n, c in ATTENTION.items() if c.convert_as in ("diff", "diff_v2", "gated", "grouped_diff")))
INITS = ("exact", "split")


def converted_config(cfg: ModelConfig, to: str, init: str = "exact") -> ModelConfig:
    """The config of the differential model :func:`convert` builds from a ``standard`` config ``cfg``."""
    if cfg.attention != "standard":
        raise ValueError(f"convert: the source must use standard attention, got {cfg.attention!r}")
    if to not in TARGETS:
        note = ATTENTION[to].convert_note if to in ATTENTION else None
        raise ValueError(f"convert: no conversion to {to!r}: {note}" if note else
                         f"convert: --to must be one of {TARGETS}, got {to!r}")
    recipe = ATTENTION[to].convert_as
    if init not in INITS:
        raise ValueError(f"convert: --init must be one of {INITS}, got {init!r}")
    if cfg.bias:
        raise ValueError("convert: bias=True sources are not supported (Llama has no attention biases)")
    d, h, kv = cfg.qk_head_dim, cfg.n_heads, cfg.kv_heads
    if init == "exact":
        if recipe == "gated":
            return cfg.replace(attention=to, head_dim=None if d * h == cfg.d_model else d)
        if recipe == "grouped_diff":
            return _grouped_config(cfg, to)
        if recipe == "diff":
            return cfg.replace(attention=to, head_dim=d, subln=False, lambda_init=0.0)
        return cfg.replace(attention=to, head_dim=None if d * h == cfg.d_model else d)
    if recipe in ("diff_v2", "gated", "grouped_diff"):
        raise ValueError(f"convert: --init split is for --to diff only; {to} is not parameter-matched by "
                         "design (extra query heads or gate weights), use --init exact")
    if h % 2 or kv % 2:
        raise ValueError(f"convert: --init split pairs heads, so n_heads ({h}) and the KV heads ({kv}) must be "
                         "even")
    return cfg.replace(attention=to, n_heads=h // 2, n_kv_heads=None if kv == h else kv // 2,
                       head_dim=None if d * h == cfg.d_model else d, subln=True, lambda_init=None)


def _grouped_config(cfg: ModelConfig, to: str) -> ModelConfig:
    """GDA at ratio r (its default): the source's H heads become the signal heads, H/r noise heads join them."""
    r = ATTENTION[to].Options().gda_ratio
    h, kv = cfg.n_heads, cfg.kv_heads
    if h % r or (h // r) % kv:
        raise ValueError(f"convert: --to {to} turns the {h} source heads into signal heads with one noise head per "
                         f"{r}, on the source's KV heads: it needs {r} to divide the heads and the KV heads ({kv}) "
                         f"to divide the {h / r:g} noise heads")
    return cfg.replace(attention=to, n_heads=(h + h // r) // 2, n_kv_heads=kv, head_dim=cfg.qk_head_dim,
                       subln=False, lambda_init=0.0)


def _grouped_queries(wq: Tensor, d: int, r: int) -> Tensor:
    """Source query rows (H·d, E) in GDA's group order: per group, its r source heads, then a copy of the first
    as the noise head ((H + H/r)·d, E)."""
    heads = wq.reshape(-1, r, d, wq.shape[1])
    return torch.cat((heads, heads[:, :1]), dim=1).reshape(-1, wq.shape[1])


def _twice(w: Tensor, d: int) -> Tensor:
    """Rows of n heads of width d, (n·d, E), with every head repeated: (2n·d, E) = [w_0; w_0; w_1; w_1; ...]."""
    n = w.shape[0] // d
    heads = w.reshape(n, 1, d, -1)
    return torch.cat((heads, heads), dim=1).reshape(2 * n * d, -1)


@torch.no_grad()
def convert(src: TransformerLM, to: str = "diff", init: str = "exact", seed: int = 0,
            break_symmetry: float = 0.5) -> TransformerLM:
    """A differential :class:`TransformerLM` made from a ``standard`` one (see the module docstring).

    ``init="exact"`` computes the source's logits (to float rounding) until trained; ``"split"`` is the
    parameter-matched alternative and does not. ``seed`` draws the new λ vectors and the symmetry-breaking Δ;
    ``break_symmetry`` scales Δ (V1 exact only). Returns an fp32 model in eval mode on the CPU."""
    if not isinstance(src, TransformerLM):
        raise TypeError(f"convert: expected a TransformerLM, got {type(src).__name__}")
    cfg = converted_config(src.config, to, init)
    check_fits(cfg, "convert", copies=2)  # the new model and its state dict, beside the source already held
    gen = torch.Generator().manual_seed(seed)
    torch_state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = TransformerLM(cfg)
    finally:
        torch.set_rng_state(torch_state)
    s = {k: v.detach().float().cpu() for k, v in src.state_dict().items()}
    new = model.state_dict()
    out: dict[str, Tensor] = {k: s[k] for k in new if k in s and ".attn." not in k}
    d = src.config.qk_head_dim
    for i in range(cfg.n_layers):
        p = f"body.blocks.{i}.attn."
        wq, wk, wv, wo = (s[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
        attn: dict[str, Any] = {}
        if init == "split":  # the official layout already pairs adjacent heads: copy, keep fresh λ and norm
            attn = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv, "out_proj.weight": wo}
            attn.update({n: new[p + n] for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2",
                                                  "subln.weight")})
        elif ATTENTION[to].convert_as in ("diff", "grouped_diff"):
            e = wo.shape[0]
            half = 0.5 * wo.reshape(e, -1, 1, d)
            delta = torch.randn(half.shape, generator=gen) * (break_symmetry * float(wo.std()))
            grouped = ATTENTION[to].convert_as == "grouped_diff"
            q = _grouped_queries(wq, d, model.blocks[i].attn.ratio) if grouped else _twice(wq, d)
            attn = {"q_proj.weight": q, "k_proj.weight": _twice(wk, d), "v_proj.weight": _twice(wv, d),
                    "out_proj.weight": torch.cat((half + delta, half - delta), dim=2).reshape(e, -1)}
            u, w = new[p + "lambda_q1"], new[p + "lambda_k1"]
            attn.update({"lambda_q1": u, "lambda_q2": u.clone(), "lambda_k1": w, "lambda_k2": w.clone()})
        elif ATTENTION[to].convert_as == "gated":  # σ(0·x) = ½ everywhere, out-projection doubled: exact
            attn = {"q_proj.weight": wq, "k_proj.weight": wk, "v_proj.weight": wv, "out_proj.weight": 2.0 * wo,
                    "gate_proj.weight": torch.zeros_like(new[p + "gate_proj.weight"])}
        else:  # diff_v2
            attn = {"q_proj.weight": _twice(wq, d), "k_proj.weight": wk, "v_proj.weight": wv,
                    "out_proj.weight": 2.0 * wo, "lambda_proj.weight": torch.zeros_like(new[p + "lambda_proj.weight"])}
        out.update({p + k: v for k, v in attn.items()})
    missing = sorted(set(new) - set(out))
    if missing:  # every tensor must come from the source or from the construction above
        raise RuntimeError(f"convert: no value for {missing}")
    model.load_state_dict(out, strict=True)
    return model.eval()


def created_tensors(model: TransformerLM, grads: bool = False) -> dict[str, Tensor]:
    """Views of every block of parameters that conversion created or copied into several places (for the
    saddle check), by name ``layer{i}.<part>``: V1: the Q1/Q2 and K1/K2 sub-head rows, both value halves, both
    out-projection column halves, the λ vectors (and the norm gain when ``subln``); V2: the even and odd query
    heads, W_λ and the out-projection. ``grads=True``: the same views of the gradients."""
    cfg = model.config
    d, e, out = cfg.qk_head_dim, cfg.d_model, {}

    def get(p: Tensor) -> Tensor:
        if not grads:
            return p
        if p.grad is None:
            raise ValueError("created_tensors(grads=True): a parameter has no gradient; run backward first")
        return p.grad

    for i, block in enumerate(model.blocks):
        a, p = block.attn, f"layer{i}."
        recipe = ATTENTION[cfg.attention].convert_as
        if recipe == "diff":
            q, k = get(a.q_proj.weight).view(-1, 2, d, e), get(a.k_proj.weight).view(-1, 2, d, e)
            v, o = get(a.v_proj.weight).view(-1, 2, d, e), get(a.out_proj.weight).view(e, -1, 2, d)
            out.update({p + "q1": q[:, 0], p + "q2": q[:, 1], p + "k1": k[:, 0], p + "k2": k[:, 1],
                        p + "v_half1": v[:, 0], p + "v_half2": v[:, 1], p + "out_half1": o[:, :, 0],
                        p + "out_half2": o[:, :, 1]})
            out.update({p + n: get(getattr(a, n)) for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")})
            if a.subln is not None:
                out[p + "subln"] = get(a.subln.weight)
        elif recipe == "diff_v2":
            q = get(a.q_proj.weight).view(-1, 2, d, e)
            out.update({p + "q_even": q[:, 0], p + "q_odd": q[:, 1], p + "lambda_proj": get(a.lambda_proj.weight),
                        p + "out_proj": get(a.out_proj.weight)})
        elif recipe == "grouped_diff":
            r = a.ratio
            q = get(a.q_proj.weight).view(-1, r + 1, d, e)
            k, o = get(a.k_proj.weight).view(-1, 2, d, e), get(a.out_proj.weight).view(e, -1, 2, d)
            v = get(a.v_proj.weight).view(-1, 2, d, e)
            out.update({p + "q_signal": q[:, :r], p + "q_noise": q[:, r], p + "k1": k[:, 0], p + "k2": k[:, 1],
                        p + "v_half1": v[:, 0], p + "v_half2": v[:, 1], p + "out_half1": o[:, :, 0],
                        p + "out_half2": o[:, :, 1]})
            out.update({p + n: get(getattr(a, n)) for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")})
        elif recipe == "gated":
            out.update({p + "gate_proj": get(a.gate_proj.weight), p + "out_proj": get(a.out_proj.weight)})
        else:
            raise ValueError(f"created_tensors: not a converted model (attention {cfg.attention!r})")
    return out


def load_source(path: str | Path, rope: str = "neox") -> tuple[TransformerLM, Any, dict[str, Any]]:
    """(standard model, tokenizer or None, provenance) from a transformers Llama folder or our checkpoint."""

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p}: not a folder (want a transformers Llama folder or a diffattn checkpoint)")
    if (p / MANIFEST).is_file() or (p / LATEST / MANIFEST).is_file():
        ck = load_checkpoint(resolve_checkpoint_dir(p))  # never a ckpt/ linked out of the folder
        model = ck.build_model()
        if not isinstance(model, TransformerLM):
            raise ValueError(f"{p}: a {ck.task} checkpoint; convert reads language models")
        return model, ck.tokenizer, {"source": str(p), "format": "diffattn"}

    model = read_hf_folder(p, rope=rope)
    tok = read_tokenizer(p)  # before anything is written: a folder with a tokenizer but no tokenizer.json stops here
    return model, tok, {"source": str(p), "format": "transformers", "rope": rope}


def check_target(cfg: ModelConfig, to: str) -> None:
    """Refuse (ValueError, one line) a conversion whose recipe does not carry the source's family options yet:
    the differential recipes are Llama's (issue 40's next phase extends them); ``--to standard`` reads any
    family as it is."""
    options = cfg.family_options()
    if to != "standard" and options:
        raise ValueError(f"convert: --to {to} of a {cfg.family or 'llama'} model is not supported yet: the "
                         f"differential recipes do not carry its {', '.join(options)}; --to standard reads it as "
                         "it is")


@torch.no_grad()
def logits_checks(model: TransformerLM, src: TransformerLM, provenance: dict[str, Any],
                  seed: int = 0) -> list[tuple[str, float]]:
    """max |Δlogits| of ``model`` in fp32 on 2 × min(64, context) random ids against what it came from:
    ("source", the source as read) when the conversion changed the model, and ("transformers", the source
    folder read by ``AutoModelForCausalLM`` in fp32) when the source is a transformers folder and transformers is
    installed (the label names its class)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, src.config.vocab_size, (2, min(64, src.config.max_seq_len)), generator=g)
    logits = model.float()(ids)
    out = [] if model is src else [("source", (logits - src.float()(ids)).abs().max().item())]
    if provenance.get("format") == "transformers":
        try:
            import transformers  # optional, and seconds to import: only for this check
        except ImportError:
            return out
        log = transformers.utils.logging
        was, bars = log.get_verbosity(), log.is_progress_bar_enabled()
        log.set_verbosity_error()  # no progress bars or notes on stderr
        log.disable_progress_bar()
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(provenance["source"], dtype=torch.float32,
                                                                   local_files_only=True).eval()
        finally:
            log.set_verbosity(was)
            if bars:
                log.enable_progress_bar()
        out.append((f"transformers ({type(hf).__name__}, fp32)", (logits - hf(ids).logits).abs().max().item()))
    return out


def write_checkpoint_into(out: Path, model: TransformerLM, **kw: Any) -> list[str]:
    """Save ``model`` as a checkpoint in the folder ``out``, replacing only the checkpoint files there (a new
    or empty folder is written atomically by :func:`~diffattn.checkpoint.format.save_checkpoint`). In a folder that
    holds other files, the checkpoint is first written complete beside them, then moved in file by file with
    the manifest last, so an interrupted write is detected on load (no manifest, or a mismatch). Returns the
    names of the other files, which stay."""

    out = Path(out)
    others = sorted(p.name for p in out.iterdir() if p.name not in CHECKPOINT_FILES) if out.is_dir() else []
    if not others:
        save_checkpoint(out, model, **kw)
        return []
    stage = out / f".convert-{os.getpid()}"
    try:
        save_checkpoint(stage, model, **kw)
        new = sorted(p.name for p in stage.iterdir())
        (out / MANIFEST).unlink(missing_ok=True)
        for name in CHECKPOINT_FILES:  # an older checkpoint's optimizer/rng files must not outlive it
            if name not in new:
                (out / name).unlink(missing_ok=True)
        for name in [n for n in new if n != MANIFEST] + [MANIFEST]:
            os.replace(stage / name, out / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return others


def pretrained_files() -> tuple[str, ...]:
    """The files a ``save_pretrained`` folder consists of: what ``--format hub`` writes and may replace."""
    return (SAFETENSORS_SINGLE_FILE, CONFIG_NAME, README, TOKENIZER_FILE)


def write_pretrained_into(out: str | os.PathLike, model: TransformerLM, tokenizer: Any = None) -> list[str]:
    """Save a convert result as a ``save_pretrained`` folder (``diffattn convert --format hub``): weights, config.json,
    a model card and the tokenizer, each file moved into place atomically; ``diffattn.load_pretrained(out)``
    reads it back. Validate ``out`` first (``check_output_dir(owned_patterns=pretrained_files())``). Returns the
    names of the other files in ``out``, which stay."""
    out = Path(out)
    own = pretrained_files()
    others = sorted(p.name for p in out.iterdir() if p.name not in own) if out.is_dir() else []
    model.save_pretrained(out, tokenizer=tokenizer)
    return others
