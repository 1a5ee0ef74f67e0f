"""Tokenizers, text and token-file datasets, and the batch protocol the training loop reads.

CONTRACT (used by train.py, compare.py, evaluate.py):
  class BatchSource(Protocol):
      def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]
  split is "train" or "val"; returns (inputs, targets), both LongTensor (B, T); targets == -100 are ignored.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class BatchSource(Protocol):
    vocab_size: int

    def get_batch(self, split: str, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]: ...
