"""Retrofit (``train --init-from SRC --retrofit.to TYPE``, issue 41): a standard pretrained model converted in memory
by the target type's exact recipe, then annealed by a schedule factor s from the exact conversion (s = 0) to the
plain target type (s = 1), each attention module reading s from its buffer (``retrofit_anneals`` says what it
anneals). The run config's ``[retrofit]`` section (:class:`~diffattn.configs.retrofit.RetrofitConfig`) is the
whole recipe, recorded with the run, so a resumed run recomputes s from the step: nothing of the schedule is in
the weights, and a model past its schedule is the plain target type.

Selective retrofit: only ``layers`` (or the ``top_k_layers`` of highest attention entropy on the source) convert;
the others stay standard in the same model (``ModelConfig.layer_attention``). The entropy score: a layer whose
attention is spread over many keys is where a subtracted second map has noise to cancel (DIFF's claim), and it
costs one reference forward per scored batch. Or only ``heads`` (or the ``top_k_heads`` of highest entropy over
the whole model, DEX's unit) convert, for the types that select heads: the converted layer's other heads are
standard heads on its first map (``ModelConfig.diff_heads``), a layer with no chosen head stays standard.

Here: the target config (:func:`retrofit_config`), the conversion (:func:`retrofit_model`), the layer score
(:func:`entropy_scores`), which parameters train (:func:`freeze`) and the loop's per-step hook
(:class:`RetrofitSchedule`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from diffattn.attention.registry import ATTENTION, conversion_of
from diffattn.configs.retrofit import RetrofitConfig, shown
from diffattn.model.config import ModelConfig
from diffattn.model.transformer import TransformerLM

__all__ = ["RetrofitSchedule", "calibrate", "check_source", "entropy_scores", "freeze", "head_entropy_scores",
           "retrofit_config", "retrofit_model"]


def check_source(cfg: ModelConfig, rcfg: RetrofitConfig) -> None:
    """Refuse (ValueError, one line) a retrofit of a model that is not standard (a type onto itself included), or
    layers or heads the model does not have; before anything is built."""
    if not rcfg.active:
        return
    if cfg.attention != "standard" or cfg.mixed:
        what = "onto itself" if cfg.attention == rcfg.to else f"onto a {cfg.attention!r} model"
        raise ValueError(f"retrofit: --retrofit.to {rcfg.to} {what}: a retrofit starts from a standard model "
                         f"(--init-from a standard checkpoint or a transformers folder)")
    bad = [i for i in rcfg.layers or [] if i >= cfg.n_layers]
    if bad:
        raise ValueError(f"retrofit: layers {shown(bad)} do not exist: the model has {cfg.n_layers} layers (0 to "
                         f"{cfg.n_layers - 1})")
    if rcfg.top_k_layers > cfg.n_layers:
        raise ValueError(f"retrofit: top_k_layers {rcfg.top_k_layers} is more than the model's {cfg.n_layers} "
                         "layers")
    n, h = cfg.n_layers, cfg.n_heads
    bad_heads = [f"{i}.{j}" for i, j in rcfg.head_pairs if i >= n or j >= h]
    if bad_heads:  # the source's heads: the types that select heads convert one for one
        raise ValueError(f"retrofit: heads {shown(bad_heads)} do not exist: the model has {n} layers of {h} heads "
                         f"(0.0 to {n - 1}.{h - 1})")
    if rcfg.top_k_heads > n * h:
        raise ValueError(f"retrofit: top_k_heads {rcfg.top_k_heads} is more than the model's {n * h} heads ({n} "
                         f"layers of {h})")
    target = retrofit_config(cfg, rcfg, list(range(cfg.n_layers)))
    if (rcfg.layers is not None or rcfg.top_k_layers or rcfg.selects_heads) and (
            target.n_heads, target.kv_heads) != (cfg.n_heads, cfg.kv_heads):
        raise ValueError(f"retrofit: --retrofit.to {rcfg.to} changes the heads ({cfg.n_heads} -> {target.n_heads}), "
                         "so its layers cannot sit beside standard ones: convert every layer (no layers, no "
                         "top_k_layers)")


def retrofit_config(cfg: ModelConfig, rcfg: RetrofitConfig, layers: list[int],
                    heads: list[str] | None = None) -> ModelConfig:
    """The retrofitted model's config from the standard source's: the target type's exact conversion config, then
    its plain form (the type's ``retrofit_target``: V1's per-head norm and target λ_init), with the layers not
    in ``layers`` left standard (``layer_attention``); ``heads`` ("LAYER.HEAD", None: every head of ``layers``)
    the heads whose negative map is on (``diff_heads``; a layer without one is standard)."""
    exact = conversion_of(rcfg.to).config(cfg, rcfg.to, "exact")
    target = ATTENTION[rcfg.to].retrofit_target(exact, rcfg.lambda_init)
    n = cfg.n_layers
    chosen = None
    if heads is not None:
        pairs = [tuple(int(x) for x in h.split(".")) for h in heads]
        chosen = [sorted(j for i, j in pairs if i == layer) for layer in range(n)]
        layers = [i for i in range(n) if chosen[i]]
        if all(len(c) == target.n_heads for c in chosen):
            chosen = None  # every head: the plain type
    if len(layers) == n:
        return target.replace(diff_heads=chosen)
    return target.replace(layer_attention=[rcfg.to if i in layers else "standard" for i in range(n)],
                          diff_heads=chosen)


def entropy_scores(model: TransformerLM, batches: list[Tensor]) -> list[float]:
    """The mean attention-row entropy (nats) of each layer of ``model`` over ``batches`` of input ids (B, T): the
    mean of :func:`head_entropy_scores` over the layer's heads (each head has as many rows)."""
    return [sum(row) / len(row) for row in head_entropy_scores(model, batches)]


@torch.no_grad()
def head_entropy_scores(model: TransformerLM, batches: list[Tensor]) -> list[list[float]]:
    """The mean attention-row entropy (nats) of each head of each layer of ``model`` (a standard one: its maps
    ``probs`` are (B, h, T, T)) over ``batches`` of input ids (B, T), from the materialized maps (one reference
    forward per batch): [layer][head]."""
    attns = [b.attn for b in model.blocks]
    totals: list[Tensor | float] = [0.0] * len(attns)
    was = model.training
    model.eval()
    try:
        for ids in batches:
            for a in attns:
                a.capture = []
            model(ids)
            for i, a in enumerate(attns):
                p = a.capture[-1]["probs"].float()
                totals[i] = totals[i] + -torch.special.xlogy(p, p).sum(-1).mean(dim=(0, 2))  # (h,)
    finally:
        for a in attns:
            a.capture = None
        model.train(was)
    return [(torch.as_tensor(t) / max(1, len(batches))).tolist() for t in totals]


def _chosen(src: TransformerLM, rcfg: RetrofitConfig, source: Any, seed: int) -> dict[str, Any]:
    """The retrofit's note: {"layers": the layers that convert, "scores": their entropy scores or [], "heads":
    the heads that convert ("LAYER.HEAD") or None (every head of those layers), "head_scores": [layer][head]
    entropy or []}."""
    n, h = src.config.n_layers, src.config.n_heads
    note: dict[str, Any] = {"layers": list(range(n)), "scores": [], "heads": None, "head_scores": []}
    pairs = rcfg.head_pairs or None
    if rcfg.layers is not None:
        note["layers"] = list(rcfg.layers)
    elif rcfg.top_k_layers or rcfg.top_k_heads:
        if source is None:
            raise ValueError("retrofit: top_k_layers and top_k_heads score the source on training batches: give "
                             "the data (source=)")
        per_head = head_entropy_scores(src, _batches(source, rcfg.score_batches, seed))
        if rcfg.top_k_layers:
            scores = note["scores"] = [sum(row) / len(row) for row in per_head]
            note["layers"] = sorted(sorted(range(n), key=lambda i: (-scores[i], i))[:rcfg.top_k_layers])
        else:
            note["head_scores"] = per_head
            every = sorted(((i, j) for i in range(n) for j in range(h)), key=lambda p: (-per_head[p[0]][p[1]], p))
            pairs = sorted(every[:rcfg.top_k_heads])
    if pairs is not None:
        note["heads"] = [f"{i}.{j}" for i, j in pairs]
        note["layers"] = sorted({i for i, _ in pairs})
    return note


@torch.no_grad()
def retrofit_model(src: TransformerLM, rcfg: RetrofitConfig, *, source: Any = None, seed: int = 0,
                   break_symmetry: float = 0.5) -> tuple[TransformerLM, dict[str, Any]]:
    """(the retrofitted model, a note: :func:`_chosen`'s, the layers and heads that convert and their entropy
    scores) from a standard ``src``: built from ``seed`` at the target config, everything outside the converted
    layers' attention copied, each converted layer's attention from the target type's exact recipe (the tensors
    the exact conversion does not have, such as V1's per-head norm gain, as built: the norm's gain is 1). With its
    schedule factor at 0 it computes ``src``'s logits (to rounding). ``source``: the batches ``top_k_layers`` and
    ``top_k_heads`` score, and ``score_batches`` of them calibrate what the plain type adds (:func:`calibrate`:
    V1's norm gain matched to the conversion's head outputs, the selected heads'); without one, nothing is
    calibrated."""
    check_source(src.config, rcfg)
    note = _chosen(src, rcfg, source, seed)
    layers = note["layers"]
    cfg = retrofit_config(src.config, rcfg, layers, note["heads"])
    recipe = conversion_of(rcfg.to)
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    state = {k: v.detach().float().cpu() for k, v in src.state_dict().items()}
    new = model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in state.items() if k in new and not any(k.startswith(f"body.blocks.{i}.attn.")
                                                                  for i in layers)}
    for i in layers:
        p = f"body.blocks.{i}.attn."
        layer = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
        attn = model.blocks[i].attn
        weights = recipe.weights(layer, attn, init="exact", gen=gen, break_symmetry=break_symmetry)
        out.update({p + k: v for k, v in attn.state_dict().items() if k not in weights})  # built (norm gain 1)
        out.update({p + k: v for k, v in weights.items()})
    missing = sorted(set(new) - set(out))
    if missing:
        raise RuntimeError(f"retrofit: no value for {missing}")
    model.load_state_dict(out, strict=True)
    if source is not None:
        calibrate(model, _batches(source, rcfg.score_batches, seed))
    return model, note


def _batches(source: Any, n: int, seed: int) -> list[Tensor]:
    """``n`` training batches of 2 rows, drawn with their own generator (the run's data order is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    return [source.get_batch("train", 2, gen)[0] for _ in range(n)]


@torch.no_grad()
def calibrate(model: TransformerLM, batches: list[Tensor]) -> None:
    """Run the model at s = 0 (the exact conversion) over ``batches``, measuring the input of each attention
    module's ``retrofit_probe`` child, and let the module set what its plain type adds from it
    (``calibrate_retrofit``: V1's per-head norm gain); the schedule factor is left at 1."""
    mods = [m for m in model.modules() if getattr(m, "retrofit_probe", None) and getattr(m, "retrofit_s", None)
            is not None and getattr(m, m.retrofit_probe, None) is not None]
    if not mods or not batches:
        return
    seen: list[list[Tensor]] = [[] for _ in mods]

    def probe(i: int):
        on = getattr(mods[i], "head_mask", None)  # a head mask: only the selected heads (dim 1) take the norm

        def hook(mod, args):
            x = args[0].detach().float()
            seen[i].append((x if on is None else x[:, on.bool()]).pow(2).mean())
        return hook

    hooks = [getattr(m, m.retrofit_probe).register_forward_pre_hook(probe(i)) for i, m in enumerate(mods)]
    was = model.training
    set_retrofit(model, 0.0)
    model.eval()
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
        set_retrofit(model, 1.0)
        model.train(was)
    for m, squares in zip(mods, seen):
        m.calibrate_retrofit(squares)


def freeze(model: nn.Module, rcfg: RetrofitConfig) -> int:
    """Leave trainable only what ``rcfg.train`` names (``all``: everything; ``attention``: every layer's attention
    module; ``new``: the parameters the retrofitted layers' type adds to a standard layer, such as V1's λ vectors
    and norm gain, V2's W_λ, the gate W_θ; with a head mask they are still the converted layers', whose
    unselected heads read none of them). Returns the number of trainable parameters."""
    if rcfg.active and rcfg.train != "all":
        cfg = model.config
        plain = cfg.replace(attention="standard", layer_attention=None, diff_heads=None)
        standard = set(ATTENTION["standard"].from_config(plain, 0).state_dict()) if rcfg.train == "new" else set()
        for name, p in model.named_parameters():
            parts = name.split(".")
            in_attn = "attn" in parts
            if rcfg.train == "new":
                i = int(parts[parts.index("blocks") + 1]) if "blocks" in parts else None
                converted = i is not None and cfg.layer_config(i).attention == rcfg.to
                keep = in_attn and converted and ".".join(parts[parts.index("attn") + 1:]) not in standard
            else:
                keep = in_attn
            p.requires_grad_(keep)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class RetrofitSchedule:
    """The training loop's hook: called with ``done``, the optimizer steps completed (at the start, and after each
    step), it gives every attention module the schedule factor s(done) (:meth:`RetrofitConfig.schedule`), which
    the next step trains with and an evaluation or checkpoint after ``done`` steps sees; :meth:`columns` is what
    diagnostics.csv adds."""

    def __init__(self, rcfg: RetrofitConfig):
        self.rcfg = rcfg
        self.s = 1.0

    def __call__(self, model: nn.Module, step: int) -> None:
        self.s = self.rcfg.schedule(step)
        set_retrofit(model, self.s)

    def columns(self) -> dict[str, float]:
        return {"retrofit_s": self.s}


def set_retrofit(model: nn.Module, s: float | None) -> int:
    """Set the schedule factor on every attention module of ``model`` that has one; -> how many."""
    n = 0
    for m in model.modules():
        if getattr(m, "retrofit_s", None) is not None and hasattr(m, "set_retrofit"):
            m.set_retrofit(s)
            n += 1
    return n
