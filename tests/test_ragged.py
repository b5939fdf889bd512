"""Mixture-of-experts layers on `jax.lax.ragged_dot`: traced as the dense work XLA:CPU runs.

XLA:CPU has no ragged-dot kernel; JAX lowers each ragged dot there as an operand copied
and masked per group, then one dot (`tracing.DENSE_RAGGED_DOTS`). The planner traces
it as those ops, so the model counts the copies, and its rounds compile what JAX would
lower anyway.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import executor
from jax_symmem._src import memory
from jax_symmem._src import tracing
from jax_symmem._src import variants

EXPERTS, D, FF = 4, 16, 32
SHAPES = (None, "m, _")
CONSTRAINTS = ("m <= 256",)


def _params(seed=0):
  rng = np.random.RandomState(seed)
  w = lambda *shape: jnp.asarray(rng.randn(*shape) / np.sqrt(shape[-2]), jnp.float32)
  return {"router": w(D, EXPERTS), "up": w(EXPERTS, D, FF), "down": w(EXPERTS, FF, D)}


def _tokens(m, seed=1):
  return jnp.asarray(np.random.RandomState(seed).randn(m, D), jnp.float32)


def _loss(p, x):
  # Top-1 routing: tokens sorted by expert, the experts' matmuls grouped, order restored.
  logits = x @ p["router"]
  expert = jnp.argmax(logits, -1)
  order = jnp.argsort(expert)
  sizes = jnp.bincount(expert, length=EXPERTS).astype(jnp.int32)
  h = jax.nn.gelu(jax.lax.ragged_dot(x[order], p["up"], sizes))
  y = jnp.zeros_like(x).at[order].set(jax.lax.ragged_dot(h, p["down"], sizes))
  gate = jnp.max(jax.nn.softmax(logits), -1, keepdims=True)
  return jnp.mean((x + gate * y) ** 2)


def _step(p, x):
  loss, grads = jax.value_and_grad(_loss)(p, x)
  return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads), loss


def _names(traced):
  return [n.name for _, n in traced.program.walk()]


def test_ragged_dots_trace_as_xla_cpus_dense_work_and_the_model_counts_it(monkeypatch):
  params = _params()
  traced = symmem.trace(_step, params, _tokens(32), polymorphic_shapes=SHAPES,
                        constraints=CONSTRAINTS)
  # Two ragged dots forward; backward, both experts' weight gradients and the hidden
  # activations' gradient (the sorted tokens take none): five, each now dense ops.
  assert "ragged_dot_general" not in _names(traced)
  graph = symmem.shape_graph(traced)
  m = symmem.Poly.var("m")
  # The forward's first copy: the sorted tokens masked per expert, EXPERTS x their bytes.
  assert EXPERTS * 4 * D * m in {graph.bytes(v) for v in graph.values}
  prof = memory.profile(graph)
  # Op by op (each primitive compiles per shape: one shape), every step's live bytes as
  # the executor tracks them.
  args = (params, _tokens(37))
  run = executor.execute(traced, args)
  assert prof.live_bytes(include_transients=False, m=37) == list(run.live_during)
  chex.assert_trees_all_close(run.outputs, jax.jit(_step)(*args), rtol=1e-5, atol=1e-6)
  # Where XLA has the instruction (TPU, GPU) the node stays one node.
  monkeypatch.setattr(tracing, "DENSE_RAGGED_DOTS", False)
  kept = symmem.trace(lambda p, x: _step(p, x), params, _tokens(32), polymorphic_shapes=SHAPES,
                      constraints=CONSTRAINTS)
  assert _names(kept).count("ragged_dot_general") == 5


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the dense lowering is XLA:CPU's")
def test_every_round_of_a_ragged_step_computes_what_jax_jit_does():
  params = _params()
  analysis = symmem.analyze(_step, params, _tokens(32), polymorphic_shapes=SHAPES,
                            constraints=CONSTRAINTS, memory_budget=1 << 30)
  last = len(analysis.rounds) - 1
  assert last >= 2
  args = (params, _tokens(200, seed=2))
  want = jax.jit(_step)(*args)
  flat = jax.tree_util.tree_leaves(args)
  for k in (1, last // 2, last):
    got = jax.jit(variants.round_function(analysis, k, {"m": 200}))(*flat)
    chex.assert_trees_all_close(jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(want), got), want, rtol=1e-5, atol=1e-6)
