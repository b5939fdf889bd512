"""Fencing an order into XLA: same numbers as jax.jit, barriers survive compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import fence
from jax_symmem._src import schedule
from tests.programs import CASES


def test_fenced_order_computes_what_jit_computes_and_keeps_barriers():
  case = next(c for c in CASES if c.name == "attention_grad")
  dims = {"b": 3, "s": 17}
  args = case.make_args(**dims)
  traced = symmem.trace(case.fun, *args, polymorphic_shapes=case.polymorphic_shapes,
                        constraints=case.constraints)
  graph = symmem.shape_graph(traced)
  order = schedule.schedule(graph).order
  program = traced.specialize(**dims)
  sizes = {v: graph.evaluate(v, **dims) for v in graph.values}
  significant = fence.significant_nodes(sizes, program, min_bytes=3 * 17 * 17 * 4)
  assert len(significant) >= 2
  fn = jax.jit(fence.ordered_function(program, order, significant))
  flat = jax.tree_util.tree_leaves(args)
  compiled = fn.lower(*flat).compile(compiler_options=fence.FENCE_COMPILER_OPTIONS)
  assert "opt-barrier" in compiled.as_text()
  want = jax.tree_util.tree_leaves(jax.jit(case.fun)(*args))
  for got, w in zip(compiled(*flat), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  # Without the option XLA:CPU drops the barriers (DESIGN.md F1): the option is what keeps them.
  assert "opt-barrier" not in fn.lower(*flat).compile().as_text()


# Slow: the mask-in-place test below covers pinned draws in the fast tier.
@pytest.mark.slow
def test_pinned_draws_hold_their_counters_only_while_they_run():
  """A planned round pins its large random draws where its order puts them: XLA can no
  longer compute a draw's first counters as soon as the key is ready and hold them until
  its scheduler reaches the draw, so its footprint falls; the numbers stay jax.jit's."""
  from jax_symmem._src import interpret, tracing, variants
  from tests.test_remat import _DropoutNet, _dropout_step
  params = _DropoutNet().init(jax.random.key(0), jnp.ones((1, 4, 32)))["params"]
  key = jax.random.key(1)
  x = jnp.asarray(np.random.RandomState(0).randn(4, 512, 32).astype(np.float32))
  a = symmem.analyze(_dropout_step, params, x, key, polymorphic_shapes=(None, "b, s, 32", None),
                     constraints=("b <= 4", "s <= 512"))
  k, dims = len(a.rounds) - 1, {"b": 4, "s": 512}
  r, env = a.rounds[k], a.graph.constraints.complete(dims)
  draws = [n for n in r.program.nodes if n.name == "random_bits"]
  elements = lambda v: r.graph.evaluate(v, **dims) // r.graph.values[v].itemsize
  big = {n.index for n in draws if 16 * elements(n.outputs[0]) >= fence.MIN_BYTES}
  pinned = fence.pinned_draws(r.graph, r.program, env, fence.MIN_BYTES)
  assert pinned == big and pinned
  assert fence.pinned_draws(r.graph, r.program, a.graph.constraints.complete({"b": 1, "s": 8}),
                            fence.MIN_BYTES) == frozenset()   # small draws stay XLA's

  flat = jax.tree_util.tree_leaves((params, x, key))
  options = variants.round_options(a, k)
  program, order = tracing.specialize_program(r.program, env), a.round_order(k, dims)
  loose = jax.jit(lambda *z: tuple(interpret.run(program, z, order))).lower(*flat).compile(options)
  held = jax.jit(variants.round_function(a, k, dims)).lower(*flat).compile(options)
  assert variants.footprint(held) < variants.footprint(loose)
  want = jax.tree_util.tree_leaves(jax.jit(_dropout_step)(params, x, key))
  for got, w in zip(held(*flat), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_a_pinned_draws_mask_is_stored_in_place_of_its_bits(monkeypatch):
  """What a dropout keeps for the backward pass is its boolean mask: stored from the
  fence (`fence.kept_values`), one byte per element, where XLA would otherwise keep the
  draw's 32-bit result and recompute the mask in each reader. Where a round keeps masks
  across its peak, XLA's footprint falls; the numbers stay jax.jit's."""
  from jax_symmem._src import variants
  from tests.test_remat import _DropoutNet, _dropout_step
  params = _DropoutNet().init(jax.random.key(0), jnp.ones((1, 4, 32)))["params"]
  key = jax.random.key(1)
  x = jnp.asarray(np.random.RandomState(0).randn(4, 512, 32).astype(np.float32))
  a = symmem.analyze(_dropout_step, params, x, key, polymorphic_shapes=(None, "b, s, 32", None),
                     constraints=("b <= 4", "s <= 512"))
  k, dims = len(a.rounds) // 2, {"b": 4, "s": 512}
  r = a.rounds[k]
  pinned = fence.pinned_draws(r.graph, r.program, a.graph.constraints.complete(dims),
                              fence.MIN_BYTES)
  kept = fence.kept_values(r.program, pinned)
  assert set(kept) == pinned and all(r.graph.values[v].dtype == "bool" for v in kept.values())
  flat = jax.tree_util.tree_leaves((params, x, key))
  options = variants.round_options(a, k)
  masks = jax.jit(variants.round_function(a, k, dims)).lower(*flat).compile(options)
  monkeypatch.setattr(fence, "kept_values", lambda program, pinned: {})
  bits = jax.jit(variants.round_function(a, k, dims)).lower(*flat).compile(options)
  assert variants.footprint(masks) < variants.footprint(bits)
  want = jax.tree_util.tree_leaves(jax.jit(_dropout_step)(params, x, key))
  for got, w in zip(masks(*flat), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
