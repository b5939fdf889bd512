"""A contrastive two-tower step (CLIP's loss): the batch is a dim of the loss's own arrays.

Image patches and padded captions go through their towers (the text tower with self-
attention, b·s² per head), are pooled, normalized and compared all against all: the
similarities are b × b, so sizes grow as b², b·s and b·s² and which is largest depends on
the shape. The step is traced once over "b, s" and must plan and run as `jax.jit` runs it.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_symmem as symmem
from jax_symmem._src import variants
from tests import budgets

D, E, PATCHES, VOCAB = 16, 8, 6, 64
SHAPES = (None, "b, _, _", "b, s", "b, s")
CONSTRAINTS = ("s >= 2", "s <= 64", "b <= 32")


def _init(seed=0):
  rng = np.random.RandomState(seed)
  w = lambda *shape: jnp.asarray(rng.randn(*shape) / np.sqrt(shape[0]), jnp.float32)
  return {"patch": w(12, D), "img_out": w(D, E), "embed": w(VOCAB, D), "qkv": w(D, 3 * D),
          "mlp": w(D, 2 * D), "mlp_out": w(2 * D, D), "txt_out": w(D, E),
          "log_scale": jnp.asarray(np.log(10.0), jnp.float32)}


def _towers(p, patches, tokens, mask):
  img = jnp.mean(jax.nn.gelu(patches @ p["patch"]), axis=1) @ p["img_out"]   # (b, E)
  x = p["embed"][tokens]                                                     # (b, s, D)
  q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
  scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(D)                     # (b, s, s)
  scores = jnp.where(mask[:, None, :] > 0, scores, -1e9)
  x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)
  x = x + jax.nn.gelu(x @ p["mlp"]) @ p["mlp_out"]
  txt = (jnp.sum(x * mask[..., None], 1) / jnp.maximum(jnp.sum(mask, 1, keepdims=True), 1.0)
         ) @ p["txt_out"]                                                    # (b, E)
  return img, txt


def _loss(p, patches, tokens, mask):
  img, txt = _towers(p, patches, tokens, mask)
  img = img / jnp.linalg.norm(img, axis=-1, keepdims=True)
  txt = txt / jnp.linalg.norm(txt, axis=-1, keepdims=True)
  logits = txt @ img.T * jnp.exp(p["log_scale"])                             # (b, b)
  labels = jnp.arange(logits.shape[0])
  return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
          + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2


def _step(params, patches, tokens, mask):
  loss, grads = jax.value_and_grad(_loss)(params, patches, tokens, mask)
  return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads), loss


def _batch(b, s, seed=0):
  rng = np.random.RandomState(seed)
  mask = np.ones((b, s), np.float32)
  mask[1::2, s - s // 3:] = 0.0   # every other caption padded by a third
  return (jnp.asarray(rng.randn(b, PATCHES, 12), jnp.float32),
          jnp.asarray(rng.randint(1, VOCAB, (b, s)), jnp.int32), jnp.asarray(mask))


def _analysis():
  return symmem.analyze(_step, _init(), *_batch(4, 8), polymorphic_shapes=SHAPES,
                        constraints=CONSTRAINTS)


def test_the_similarities_are_sized_by_the_batch_squared():
  graph = _analysis().graph
  b, s = symmem.Poly.var("b"), symmem.Poly.var("s")
  sizes = {graph.bytes(v) for v in graph.values}
  assert 4 * b * b in sizes and 4 * b * s * s in sizes and 4 * D * b * s in sizes
  # Which is larger depends on the shape, with the breakpoint where it is.
  o = graph.compare(4 * b * b, 4 * b * s)
  assert o.kind == "DEPENDS" and o.witness_gt["b"] > o.witness_gt["s"]
  assert o.witness_lt["b"] < o.witness_lt["s"]


# 13 compiles (8 s): slow; the fast tier runs a recomputing round under a budget below.
@pytest.mark.slow
def test_every_round_computes_what_jax_jit_does_at_a_wide_or_a_long_shape():
  analysis = _analysis()
  last = len(analysis.rounds) - 1
  assert last > 2
  params = _init()
  shapes = ((32, 8), (3, 64))   # b² above b·s, and below; the rounds take turns, the last both
  for i, (b, s) in enumerate(shapes):
    args = (params, *_batch(b, s, seed=b))
    want = jax.jit(_step)(*args)
    flat = jax.tree_util.tree_leaves(args)
    for k in sorted({*range(i, last, len(shapes)), last}):
      got = jax.jit(variants.round_function(analysis, k, {"b": b, "s": s}))(*flat)
      chex.assert_trees_all_close(jax.tree_util.tree_unflatten(
          jax.tree_util.tree_structure(want), got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("own_arrays_only")   # a budget of a few hundred KiB
def test_symmem_jit_runs_as_jax_jit_without_and_within_a_budget():
  params = _init()
  batches = [(params, *_batch(b, s, seed=s)) for b, s in ((32, 8), (4, 64), (2, 16))]
  plain = symmem.jit(_step, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  for args in batches:
    chex.assert_trees_all_close(plain(*args), jax.jit(_step)(*args), rtol=1e-5, atol=1e-6)
    assert "fallback" not in plain.last_call and plain.last_call["round"] == 0
  analysis = plain.analyze(*batches[0])
  dims = {"b": 4, "s": 64}
  budget = budgets.tight_budget(analysis, dims, batches[1])
  step = symmem.jit(_step, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS,
                    memory_budget=budget)
  close = lambda a, b: chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
  rounds = budgets.rounds_run_within(step, budget, _step, batches, close)
  assert rounds[1] > 0 and step.cache_info()["budget_errors"] == 0
