"""Length bucketing for variable-length fine-tuning data, with synthetic token ids.

Examples are sorted by length and cut into batches of `batch_size` neighbours;
each batch is padded to its longest example rounded up to `pad_multiple`. So
every batch has one of ceil(max_len / pad_multiple) sequence lengths (the
buckets), and, with the last batch filled up with empty rows, one batch size:
at most that many distinct (b, s) shapes, hence at most that many compiles
under `jax.jit` (one plan for all of them under `symmem.jit`).

    lengths = load_codealpaca_lengths()          # 2,017 Llama-2 token counts
    for tokens, mask in bucket_batches(lengths, batch_size=4, pad_multiple=64, vocab=cfg.vocab):
      state, loss = step(state, tokens, mask)
"""

from __future__ import annotations

import math
import pathlib
from typing import Sequence

import numpy as np

CODEALPACA_FILE = "codealpaca2k_llama2_lengths.txt"
PAD_ID = 0


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def bucket_indices(lengths: Sequence[int], batch_size: int, pad_multiple: int = 64, *,
                   seed: int = 0, shuffle: bool = True) -> list[tuple[np.ndarray, int]]:
  """Batches as (example indices, padded length): similar lengths together.

  Sorting is by length with a seeded random tie-break (so equal lengths are
  mixed across epochs with different seeds); `shuffle` then shuffles the order
  of the batches. Every example appears in exactly one batch; only the last
  batch (the longest examples) may have fewer than `batch_size`.
  """
  lengths = np.asarray(lengths, np.int64)
  if batch_size < 1 or pad_multiple < 1:
    raise ValueError(f"batch_size and pad_multiple must be >= 1, got {batch_size}, {pad_multiple}")
  if lengths.ndim != 1 or (lengths < 1).any():
    raise ValueError("lengths must be a 1-D sequence of positive integers")
  rng = np.random.default_rng(seed)
  order = np.lexsort((rng.permutation(len(lengths)), lengths))   # by length, then random
  batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
  if shuffle:
    batches = [batches[i] for i in rng.permutation(len(batches))]
  return [(idx, round_up(int(lengths[idx].max()), pad_multiple)) for idx in batches]


def bucket_batches(lengths: Sequence[int], batch_size: int, pad_multiple: int = 64, *,
                   vocab: int = 32000, seed: int = 0, shuffle: bool = True,
                   fill_last: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
  """Padded (tokens int32 (b, s), mask float32 (b, s)) batches with synthetic token ids.

  Args:
    lengths: each example's token count.
    batch_size: examples per batch.
    pad_multiple: each batch's length is its longest example rounded up to this.
    vocab: token ids are drawn uniformly from [1, vocab); padding is `PAD_ID` (0).
    seed: seeds the tie-break, the batch order and the token ids.
    shuffle: shuffle the order of the batches.
    fill_last: pad a short last batch with empty rows (mask 0, no loss) so that
      every batch has `batch_size` rows; otherwise it keeps its own size.

  Returns:
    One (tokens, mask) per batch; row r of a batch holds example
    `bucket_indices(...)[k][0][r]`, its first `lengths[i]` positions real (mask 1).
  """
  rng = np.random.default_rng([seed, 1])
  out = []
  for idx, padded in bucket_indices(lengths, batch_size, pad_multiple, seed=seed,
                                    shuffle=shuffle):
    rows = batch_size if fill_last else len(idx)
    positions = np.arange(padded)[None, :]
    real = positions < np.asarray(lengths)[idx][:, None]
    mask = np.zeros((rows, padded), np.float32)
    mask[:len(idx)] = real
    tokens = np.where(mask > 0, rng.integers(1, vocab, (rows, padded)), PAD_ID).astype(np.int32)
    out.append((tokens, mask))
  return out


def num_buckets(max_length: int, pad_multiple: int = 64) -> int:
  """How many padded lengths examples up to `max_length` tokens can take."""
  return math.ceil(max_length / pad_multiple)


def _repo_data_dir() -> pathlib.Path:
  # jax_symmem/examples/batching.py -> the repository root's experiments/data.
  return pathlib.Path(__file__).resolve().parents[2] / "experiments" / "data"


def load_codealpaca_lengths(path: str | pathlib.Path | None = None) -> np.ndarray:
  """The 2,017 Llama-2 token counts of CodeAlpaca's 2k set (experiments/data), int64.

  Raises FileNotFoundError when the file is missing, e.g. when jax_symmem is
  installed from a wheel rather than used from a clone of the repository.
  """
  path = pathlib.Path(path) if path is not None else _repo_data_dir() / CODEALPACA_FILE
  if not path.is_file():
    raise FileNotFoundError(
        f"{path} not found: the CodeAlpaca length file ships in the repository's "
        f"experiments/data/{CODEALPACA_FILE}, not in the installed package; run from a "
        "clone of the repository or pass path=")
  return np.loadtxt(path, dtype=np.int64, ndmin=1)
