"""experiments/soak.py's loop, short: CodeAlpaca buckets under a budget, never over it, no fallback."""

import math

import jax
import numpy as np
import pytest

from jax_symmem._src import jit as jit_lib
from jax_symmem.examples import llama
from experiments import soak

BATCH = 4
ONE_LAYER = llama.LlamaConfig(vocab=256, d_model=64, n_layers=1, n_heads=4, d_ff=172, max_len=256)


def _numpy_state(cfg, seed=0):
  """llama.init_state(cfg)'s tree, shapes and dtypes with values from NumPy: norm scales
  1, the other parameters N(0, 1/fan_in), the AdamW state zero as optax initializes it.
  llama.init_state compiles the model's initializer (~3.5 s on 2 CPU cores), and the soak
  judges memory, compiles and fallbacks, which any finite values exercise alike
  (test_llama's linen flag test runs llama.init_state in the fast tier)."""
  rng = np.random.RandomState(seed)
  def fill(path, x):
    if path[0].key != "params":
      return jax.numpy.asarray(np.zeros(x.shape, x.dtype))
    if len(x.shape) == 1:
      return jax.numpy.asarray(np.ones(x.shape, x.dtype))
    return jax.numpy.asarray((rng.randn(*x.shape) / np.sqrt(x.shape[0])).astype(x.dtype))
  return jax.tree_util.tree_map_with_path(fill, jax.eval_shape(lambda: llama.init_state(cfg)))


# The tiny preset on examples up to 192 tokens: 3 buckets (64, 128, 192), 30 steps; the
# fast tier runs one layer, 2 buckets (up to 128 tokens), 12 steps.
@pytest.mark.parametrize("cfg,steps,max_length", [
    (ONE_LAYER, 12, 128), pytest.param(llama.PRESETS["tiny"], 30, 192, marks=pytest.mark.slow)],
    ids=["one_layer", "tiny"])
def test_soak_loop_stays_within_budget(cfg, steps, max_length):
  batches = soak.load_batches(BATCH, 64, vocab=cfg.vocab, seed=0, max_length=max_length)
  max_len = max(t.shape[1] for t, _ in batches)
  args = soak.abstract_args(cfg, batches[0])
  budget, info = soak.pick_budget(cfg, args, frac=0.5, max_len=max_len, max_batch=BATCH)
  assert info["min_peak"] < budget < info["no_remat_peak"]
  step = llama.make_train_step(cfg, use_symmem=True, memory_budget=budget, max_len=max_len,
                               max_batch=BATCH)
  step.analyze(*args)
  _, res = soak.soak_loop(step, lambda: _numpy_state(cfg), batches, steps, budget)

  assert len(res["records"]) == steps
  assert res["over_budget"] == 0 and res["unjudged"] == 0
  assert res["cache_info"]["fallback_calls"] == 0 and res["fallback_steps"] == 0
  assert res["cache_info"]["compiles"] <= len(res["shapes"]) * (1 + jit_lib.MAX_RECOMPILES)
  assert res["compiles_after_warmup"] == 0
  assert res["warnings"] == 0, res["logs"]
  assert all(math.isfinite(r["loss"]) for r in res["records"])
  # Nothing accumulates: the bytes held outside the step's arguments stay what they were at
  # the first step (other test modules may hold arrays of their own in this process).
  first = res["records"][0]["reserved"]
  assert all(r["reserved"] <= first + 2**10 for r in res["records"])
