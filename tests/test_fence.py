"""Fencing an order into XLA: same numbers as jax.jit, barriers survive compilation."""

import jax
import numpy as np

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
