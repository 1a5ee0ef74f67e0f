"""The run config's ``[retrofit]`` section: a standard pretrained model converted exactly to another attention type
and annealed, over ``steps`` optimizer steps, into a real model of that type (issue 41; the work is
:mod:`diffattn.train.retrofit`, what each type anneals is its own class's ``retrofit_anneals``).

``to`` names the target type (None: no retrofit, the section is not recorded). The run starts from a ``standard``
model (``train --init-from``), converts the chosen layers in memory by the target type's exact recipe, and a
schedule factor s goes from 0 (step 0: the exact conversion, the source's logits) to 1 (step ``steps`` and after:
the plain target type, whose checkpoint needs nothing special). ``shape``: s = step/N (linear) or
½(1 − cos(π·step/N)) (cosine). ``lambda_init``: V1's and GDA's target λ_init (None: the paper's
0.8 − 0.6·exp(−0.3·depth)). ``layers``: the layers that convert (None: all); ``top_k_layers`` instead converts the
k layers with the highest attention entropy on ``score_batches`` training batches (the rest stay standard in the
same model). ``heads``: the heads that convert instead, as "LAYER.HEAD" strings ("0.1,3.5" on the command line),
or ``top_k_heads`` the k heads of highest attention entropy over the whole model (DEX's unit): the source's heads,
which for the types that select heads (``selects_heads``) are the target's, one for one; a layer with no chosen
head stays standard, the other heads of a converted layer are standard heads in it (``ModelConfig.diff_heads``).
One of ``layers``, ``top_k_layers``, ``heads``, ``top_k_heads`` at most. ``train``: which parameters train:
``all``, ``attention`` (every attention module's), ``new`` (only what the conversion created or copied into several
places: the converted layers' attention)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from diffattn.attention.registry import ATTENTION, conversion_of
from diffattn.system.untrusted import printable

SHAPES = ("linear", "cosine")
TRAINABLE = ("all", "attention", "new")
# the batches scored and calibrated on are drawn and held at once: 10⁹ of them would never end
MAX_SCORE_BATCHES = 1024


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for a one-line refusal: a long list (10⁵ layer indices) cut to ``limit`` characters, with how
    many items it holds."""
    text = repr(value)
    if len(text) <= limit:
        return text
    count = f" ({len(value):,} items)" if isinstance(value, (list, tuple)) else ""
    return f"{text[:limit]}...{count}"


def retrofit_targets() -> list[str]:
    """The registered types a standard model retrofits to: a conversion recipe and a schedule (sorted)."""
    return sorted(n for n, cls in ATTENTION.items()
                  if conversion_of(n) is not None and getattr(cls, "retrofit_anneals", None) is not None)


@dataclass
class RetrofitConfig:
    """The ``[retrofit]`` section (module docstring)."""

    to: str | None = None  # the target attention type; None: no retrofit
    steps: int = 0  # the schedule's length N in optimizer steps (0: the target at once); at most train.steps
    shape: str = "linear"  # "linear" or "cosine"
    lambda_init: float | None = None  # V1/GDA target λ_init in [0, 1); None: 0.8 − 0.6·exp(−0.3·depth)
    layers: list[int] | None = None  # the 0-based layers that convert; None: all (or top_k_layers)
    top_k_layers: int = 0  # convert the k layers of highest attention entropy on the source (0: off)
    heads: list[str] | str | None = None  # "LAYER.HEAD" heads that convert (a str: comma-separated); None: off
    top_k_heads: int = 0  # convert the k heads of highest attention entropy on the source, model-wide (0: off)
    score_batches: int = 4  # batches the top_k_layers score and V1's norm-gain calibration read (own generator)
    train: str = "all"  # the parameters that train: "all", "attention", "new"

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"retrofit: {msg}")

        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.to is not None:
            targets = retrofit_targets()
            need(self.to != "standard", "--retrofit.to standard: a retrofit converts a standard model to another "
                                        f"type; choose one of {', '.join(targets)}")
            need(self.to in targets, f"--retrofit.to must be one of {', '.join(targets)}, got {self.to!r}")
        for name in ("steps", "top_k_layers", "top_k_heads"):
            need(whole(getattr(self, name)) and getattr(self, name) >= 0,
                 f"{name} must be a whole number >= 0, got {shown(getattr(self, name))}")
        need(whole(self.score_batches) and 0 < self.score_batches <= MAX_SCORE_BATCHES,
             f"score_batches must be a whole number from 1 to {MAX_SCORE_BATCHES:,}, got {shown(self.score_batches)}")
        need(self.shape in SHAPES, f"shape must be {' or '.join(SHAPES)}, got {self.shape!r}")
        need(self.train in TRAINABLE, f"train must be {', '.join(TRAINABLE)}, got {self.train!r}")
        lam = self.lambda_init
        need(lam is None or (isinstance(lam, (int, float)) and not isinstance(lam, bool) and 0.0 <= lam < 1.0),
             f"lambda_init (the target λ_init) must be in [0, 1), got {lam!r}")
        if self.layers is not None:
            need(isinstance(self.layers, list) and len(self.layers) > 0 and all(whole(i) and i >= 0
                                                                                for i in self.layers)
                 and len(set(self.layers)) == len(self.layers),
                 f"layers must list distinct 0-based layer indices, got {shown(self.layers)}")
            self.layers = sorted(self.layers)
        need(self.layers is None or not self.top_k_layers, "give layers or top_k_layers, not both")
        if self.heads is not None:
            self.heads = parse_heads(self.heads, need)
        given = [n for n in ("layers", "top_k_layers", "heads", "top_k_heads") if getattr(self, n)]
        need(len(given) <= 1, f"give one of layers, top_k_layers, heads, top_k_heads, not {' and '.join(given)}")
        if self.to is not None and (self.heads or self.top_k_heads):
            selecting = sorted(n for n, cls in ATTENTION.items() if getattr(cls, "selects_heads", False))
            need(ATTENTION[self.to].selects_heads, f"--retrofit.to {self.to} does not select heads (its layers convert "
                                                   f"whole: use layers); the types that do: {', '.join(selecting)}")

    @property
    def head_pairs(self) -> list[tuple[int, int]]:
        """``heads`` as (layer, head) pairs, in order (empty: no head list)."""
        return [(int(a), int(b)) for a, b in (h.split(".") for h in self.heads or [])]

    @property
    def selects_heads(self) -> bool:
        """Whether the choice is of heads (``heads`` or ``top_k_heads``) rather than of whole layers."""
        return bool(self.heads or self.top_k_heads)

    @property
    def active(self) -> bool:
        return self.to is not None

    def schedule(self, step: int) -> float:
        """The schedule factor s at optimizer step ``step`` (0-based): 0 at step 0, 1 from step ``steps`` on."""
        if self.steps == 0 or step >= self.steps:
            return 1.0
        t = max(step, 0) / self.steps
        return t if self.shape == "linear" else 0.5 * (1.0 - math.cos(math.pi * t))

    def check_run(self, train_steps: int, n_layers: int) -> None:
        """Refuse (ValueError, one line) a schedule longer than the run or layers the model does not have."""
        if not self.active:
            return
        if self.steps > train_steps:
            raise ValueError(f"retrofit: the schedule ({self.steps} steps) is longer than the run ({train_steps} "
                             "steps): it would never reach the target type")
        bad = [i for i in self.layers or [] if i >= n_layers]
        if bad:
            raise ValueError(f"retrofit: layers {shown(bad)} do not exist: the model has {n_layers} layers (0 to "
                             f"{n_layers - 1})")
        if self.top_k_layers > n_layers:
            raise ValueError(f"retrofit: top_k_layers {self.top_k_layers} is more than the model's {n_layers} layers")


def parse_heads(value: Any, need: Any) -> list[str]:
    """``heads`` as distinct "LAYER.HEAD" strings ordered by layer then head, from a list of them or one
    comma-separated string; ``need(ok, msg)`` refuses anything else."""
    items = value.split(",") if isinstance(value, str) else value
    ok = isinstance(items, list) and len(items) > 0 and all(isinstance(h, str) and re.fullmatch(r"\s*\d+\.\d+\s*", h)
                                                             for h in items)
    need(ok, "heads must be LAYER.HEAD pairs of 0-based indices, such as 0.1,3.5 (layer 0's head 1 and layer 3's "
             f"head 5), got {printable(shown(value))}")
    pairs = [tuple(int(x) for x in h.split(".")) for h in items]
    need(len(set(pairs)) == len(pairs), f"heads must be distinct, got {shown(value)}")
    return [f"{a}.{b}" for a, b in sorted(pairs)]
