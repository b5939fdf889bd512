"""The memory model against the reference executor: equal, step by step, at every shape."""

import functools

import jax
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import executor
from jax_symmem._src import memory
from jax_symmem._src import schedule
from tests.programs import CASES

CASE_IDS = [c.name for c in CASES]


@functools.lru_cache(maxsize=None)
def _analysis(name):
  case = next(c for c in CASES if c.name == name)
  args = case.make_args(**case.shapes[-1])
  traced = symmem.trace(case.fun, *args, polymorphic_shapes=case.polymorphic_shapes,
                        constraints=case.constraints)
  graph = symmem.shape_graph(traced)
  return case, traced, graph


def _check_model_equals_executor(name, shapes):
  case, traced, graph = _analysis(name)
  order = schedule.schedule(graph).order
  # Every shape in trace order; the scheduled order at the extremes (same code path).
  for order_name, o, at in (("trace", None, shapes),
                            ("scheduled", order, shapes[::max(1, len(shapes) - 1)])):
    prof = memory.profile(graph, order=o)
    for dims in at:
      args = case.make_args(**dims)
      run = executor.execute(traced, args, order=o)
      assert prof.arguments.evaluate(graph.constraints.complete(dims)) == run.arguments
      assert prof.live_bytes(include_transients=False, **dims) == list(run.live_during), (
          order_name, dims)
      assert prof.peak_bytes(include_transients=False, **dims) == run.peak
      # ... and it computes what jax.jit computes (op by op, so XLA's fusion rounds
      # differently: float32 tolerance relative to each output's scale).
      for got, want in zip(jax.tree_util.tree_leaves(run.outputs),
                           jax.tree_util.tree_leaves(jax.jit(case.fun)(*args))):
        scale = float(np.max(np.abs(want), initial=1.0))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


# The transformer step op by op costs ~10-15 s per shape (each primitive compiles per
# shape): all five shapes in the slow tier. Its fast cover:
# test_remat.test_every_round_computes_the_same_outputs_op_by_op_and_matches_the_model
# runs a transformer step op by op (round 0 is the step in its scheduled order, then
# two remat rounds) and checks the model's live bytes at every step and the outputs
# against jax.jit; the other programs here cover trace order and the arguments fast.
# Each shape compiles every primitive anew (~1.5-3 s a shape for the other programs): the
# fast tier runs each program at the first, middle and last of its five shapes (the
# smallest, b=1, first; trace order at all three, the scheduled order at the first and
# last, as with five), the slow tier at all five.
@pytest.mark.parametrize("name,shapes", [
    pytest.param(n, k, marks=pytest.mark.slow) if n == "transformer_step" or k == "all" else (n, k)
    for n in CASE_IDS for k in ("first_middle_last", "all")
    if not (n == "transformer_step" and k != "all")])
def test_model_equals_reference_executor_at_every_step(name, shapes):
  case = next(c for c in CASES if c.name == name)
  at = case.shapes if shapes == "all" else case.shapes[::len(case.shapes) // 2]
  assert shapes == "all" or len(at) == 3
  _check_model_equals_executor(name, at)


@pytest.mark.parametrize("name", ["scan", "cond"])
def test_control_flow_bodies_add_their_working_set(name):
  case, traced, graph = _analysis(name)
  prof = memory.profile(graph)
  flow = [s for s in prof.steps if traced.program.nodes[s.node].subprograms]
  assert flow
  dims = case.shapes[-1]
  env = graph.constraints.complete(dims)
  assert any(s.transient.evaluate(env) > 0 for s in flow)
  assert prof.peak_bytes(**dims) >= prof.peak_bytes(include_transients=False, **dims)


@pytest.mark.parametrize("name", ["scan", "cond"])
def test_control_flow_model_equals_running_its_bodies_op_by_op(name):
  # A scan: its outputs when it starts, one iteration's working set at a time; a
  # cond: the largest branch's working set, whichever runs. The executor runs every
  # iteration's body (every branch) op by op and tracks the same bytes.
  case, traced, graph = _analysis(name)
  prof = memory.profile(graph)
  for dims in case.shapes[::2]:
    run = executor.execute(traced, case.make_args(**dims), loops_op_by_op=True)
    assert prof.live_bytes(**dims) == list(run.live_during), dims
    assert prof.peak_bytes(**dims) == run.peak


def test_peak_is_the_max_over_its_pieces():
  case, traced, graph = _analysis("attention_grad")
  prof = memory.profile(graph)
  for dims in case.shapes:
    assert prof.peak.evaluate(**dims) == prof.peak_bytes(**dims)
  pos, val = prof.peak.argmax(**case.shapes[-1])
  assert prof.live_bytes(**case.shapes[-1])[pos] == val


def test_donated_arguments_are_freed_after_last_use():
  case, traced, graph = _analysis("mlp_grad")
  dims = {"b": 100}
  held = memory.profile(graph)
  donated = memory.profile(graph, donated=[0])
  assert held.peak_bytes(**dims) - donated.peak_bytes(**dims) in (0, 100 * 24 * 4)
  run = executor.execute(traced, case.make_args(**dims), donated=[0])
  assert list(run.live_during) == donated.live_bytes(include_transients=False, **dims)
  assert donated.live_bytes(**dims)[-1] < held.live_bytes(**dims)[-1]


def test_dead_code_is_dropped_and_timeline():
  """Values nothing reads are not computed (XLA removes them), so not counted; and a
  dead value's producers go with it."""
  def f(x):
    _ = jax.numpy.sin(x) * 3.0    # computed, never used
    return x + 1.0
  traced = symmem.trace(f, jax.ShapeDtypeStruct((4,), np.float32), polymorphic_shapes="n")
  assert [n.name for n in traced.program.nodes] == ["add"]
  graph = symmem.shape_graph(traced)
  prof = memory.profile(graph)
  run = executor.execute(traced, (np.ones(10, np.float32),))
  assert prof.live_bytes(n=10) == list(run.live_during)
  assert prof.steps[-1].live_after.evaluate({"n": 10}) == 80   # argument + output
  text = prof.timeline(n=10)
  assert "<- peak" in text and "add" in text and "sin" not in text


def test_order_must_be_a_permutation():
  _, _, graph = _analysis("mlp_grad")
  with pytest.raises(ValueError, match="permutation"):
    memory.profile(graph, order=[0, 0])


def test_zero_size_static_dims_cost_nothing_and_match_the_executor():
  def f(x, empty):
    return jax.numpy.sum(x * 2.0) + jax.numpy.sum(empty), empty * 3.0
  traced = symmem.trace(f, jax.ShapeDtypeStruct((4,), np.float32),
                        jax.ShapeDtypeStruct((0, 5), np.float32), polymorphic_shapes=("n", None))
  graph = symmem.shape_graph(traced)
  prof = memory.profile(graph)
  run = executor.execute(traced, (np.ones(7, np.float32), np.ones((0, 5), np.float32)))
  assert prof.live_bytes(include_transients=False, n=7) == list(run.live_during)
  assert all(graph.evaluate(v, n=7) == 0 for v in graph.values if 0 in
             [d.evaluate({"n": 7}) for d in graph.values[v].dims])
