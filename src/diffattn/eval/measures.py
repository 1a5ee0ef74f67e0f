"""The measures ``diffattn eval`` offers and the defaults the command lines show (``eval --what``, ``--bits``;
``heads --distances``). Imports nothing heavy: ``diffattn eval --help`` lists these without loading torch."""

from __future__ import annotations

WHATS = ("ppl", "needle", "noise", "outliers", "quant")  # eval --what: what evaluate_model measures
DEFAULT_BITS = (16, 8, 6, 4)  # the attention-logit quantization sweep's bit widths
DEFAULT_DISTANCES = (1, 4, 16, 64, 256)  # the distances at which `heads` prints each head's f
