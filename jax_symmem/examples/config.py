"""What the Flax example models' configurations share (each model adds its own fields)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab: int = 256
  d_model: int = 64
  n_heads: int = 4
  d_ff: int = 172
  dtype: str = "float32"       # activations
  param_dtype: str = "float32"
  norm_eps: float = 1e-6

  @property
  def d_head(self) -> int:
    return self.d_model // self.n_heads
