"""Properties of random programs over symbolic dims (b, s), at random allowed shapes.

(a) `symmem.jit` returns what `jax.jit` returns: value and gradients, with and
    without a budget tight enough to dispatch rematerialization rounds;
(b) every order it plans is a topological order of its program;
(c) the modeled peak equals what the reference executor tracks, step by step;
(d) any budget at or above the smallest achievable modeled peak is met by the
    dispatched plan, and one below it raises BudgetError.
"""

import dataclasses
import re
from unittest import mock

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import executor
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import memory
from jax_symmem._src import schedule
from jax_symmem._src import tracing
from tests import budgets
from tests.tiers import own_database_key

D = 8
SPECS = ("b, s, _", None, None)
CONSTRAINTS = ("s >= 2", "b <= 4", "s <= 24")
MAX = {"b": 4, "s": 24}
SHAPES = st.fixed_dictionaries({"b": st.integers(1, MAX["b"]), "s": st.integers(2, MAX["s"])})


def _roll(a, c, w, w2):        # slices and a concatenate along the symbolic axis s
  return jnp.concatenate([a[:, 1:], a[:, :1]], axis=1) * 0.5 + c * 0.5


def _fold(a, c, w, w2):        # concatenate to (b, 2s), reshape and reduce back to (b, s)
  b, s = a.shape[0], a.shape[1]
  return jnp.concatenate([a, c], axis=1).reshape(b, 2, s, D).mean(axis=1)


def _dense(a, c, w, w2):       # dot_general through a (b*s, D) reshape
  b, s = a.shape[0], a.shape[1]
  return jnp.tanh(a.reshape(b * s, D) @ w).reshape(b, s, D)


def _attend(a, c, w, w2):      # (b, s, s) scores: the quadratic values remat targets
  scores = jnp.einsum("bsd,btd->bst", a, c) / np.sqrt(D)
  return jax.nn.softmax(scores, axis=-1) @ c


def _mix(a, c, w, w2):         # concatenate on the static axis, then a weight
  return jnp.tanh(jnp.concatenate([a, c], axis=-1) @ w2)


OPS = {
    "add": lambda a, c, w, w2: a + c,
    "mul": lambda a, c, w, w2: a * jnp.tanh(c),
    "sin": lambda a, c, w, w2: jnp.sin(a),
    "center": lambda a, c, w, w2: a - jnp.mean(a, axis=-1, keepdims=True),
    "pool": lambda a, c, w, w2: a * jnp.mean(c, axis=1, keepdims=True),   # divides by s
    "max": lambda a, c, w, w2: a - jnp.max(c, axis=(1, 2), keepdims=True),
    "roll": _roll, "fold": _fold, "dense": _dense, "attend": _attend, "mix": _mix,
}
PROGRAMS = st.lists(st.tuples(st.sampled_from(sorted(OPS)), st.integers(0, 15),
                              st.integers(0, 15)), min_size=1, max_size=8)


def _step(ops):
  """value_and_grad of a random DAG over x: (b, s, D) and weights w: (D, D), w2: (2D, D)."""
  def loss(x, w, w2):
    values = [x]
    for op, i, j in ops:
      values.append(OPS[op](values[i % len(values)], values[j % len(values)], w, w2))
    return sum(jnp.mean(v * v) for v in values[-2:])
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _args(b, s, seed=0):
  rng = np.random.RandomState(seed)
  return (jnp.asarray(rng.randn(b, s, D), jnp.float32),
          jnp.asarray(rng.randn(D, D) / np.sqrt(D), jnp.float32),
          jnp.asarray(rng.randn(2 * D, D) / np.sqrt(2 * D), jnp.float32))


def _assert_tree_close(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.nanmax(np.abs(w), initial=1.0)))


def _analyze(fun):
  return symmem.analyze(fun, *_args(2, 5), polymorphic_shapes=SPECS, constraints=CONSTRAINTS)


def _peaks(a, dims):
  return [a.round_peak(k, dims) for k in range(len(a.rounds))]


def _check_jit_matches_jax_jit(ops, shapes, budgeted):
  fun = _step(ops)
  budget = None
  if budgeted:
    # Halfway between the smallest and the unoptimized modeled peak at the largest
    # shape: remat rounds are dispatched there where the program has any.
    peaks = _peaks(_analyze(fun), MAX)
    budget = (min(peaks) + peaks[0]) // 2 + 1
  step = symmem.jit(fun, polymorphic_shapes=SPECS, constraints=CONSTRAINTS, memory_budget=budget)
  calls = [MAX] + shapes
  ran = set()
  # Arrays other tests left alive must not count against these tiny budgets.
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    for dims in calls:
      args = _args(**dims, seed=dims["s"])
      try:
        got = step(*args)
      except symmem.BudgetError as e:
        # Refused only once XLA reported the planner's last round over the budget too.
        last = len(_analyze(fun).rounds) - 1
        assert budget is not None and re.search(rf"rounds compiled: .*\b{last}\b", str(e)), str(e)
        continue
      ran.add(tuple(sorted(dims.items())))   # a shape, whatever its key order
      # The reference: jax.jit compiled with the XLA options of the variant that ran
      # (the memory-saving ones change reduction order).
      _assert_tree_close(got, budgets.same_options_reference(step, fun, args))
  info = step.cache_info()
  assert info["fallback_calls"] == 0
  assert info["compiles"] >= len(ran)



# Each property runs a few random programs in the fast tier and more in the slow one.
def _jit_property(max_examples, examples=()):
  @hypothesis.settings(max_examples=max_examples, deadline=None)
  @hypothesis.given(ops=PROGRAMS, shapes=st.lists(SHAPES, min_size=1, max_size=2),
                    budgeted=st.booleans())
  @hypothesis.example(ops=[("attend", 0, 0), ("dense", 1, 0), ("attend", 2, 1), ("fold", 3, 2)],
                      shapes=[{"b": 3, "s": 17}], budgeted=True)   # always one run with rounds
  def test(ops, shapes, budgeted):
    _check_jit_matches_jax_jit(ops, shapes, budgeted)
  own_database_key(test, max_examples)
  for example in examples:
    test = hypothesis.example(**example)(test)
  return test


test_jit_matches_jax_jit_values_and_gradients = _jit_property(1)
# Found by the slow tier (2026-11-30): a budget of a few KiB that symmem.jit ran at
# (4, 24) with a warning (XLA's footprint above it for every round) and refused at
# (4, 23) on the model's word. Now both follow XLA: refused when XLA reports every
# variant tried, the last round included, over the budget. Kept as an example.
test_jit_matches_jax_jit_values_and_gradients_many = pytest.mark.slow(_jit_property(16, [
    dict(ops=[("add", 0, 0), ("mix", 0, 0)], shapes=[{"b": 4, "s": 23}], budgeted=True)]))


def _check_orders_model_and_budgets(ops, dims, fraction):
  fun = _step(ops)
  a = _analyze(fun)
  program = a.traced.program
  # (b) Every order planned is topological: schedule candidates, rounds, per-shape picks.
  assert schedule.is_valid_order(program, a.schedule.order)
  assert all(schedule.is_valid_order(program, o) for o in a.schedule.candidates.values())
  assert all(schedule.is_valid_order(r.program, r.order) for r in a.rounds)
  # The executor runs op by op, as eager JAX does: compared with eager `fun`, not jax.jit's
  # fused program. A max's gradient compares its operand with the max, and XLA can round a
  # fused recomputation of the operand apart from it: a slow-tier draw (add, pool, attend,
  # roll, pool, add, add, max at b=2, s=4) had eager `fun` and jax.jit(fun) 3.04 apart in
  # one gradient, round 0 and every round equal to eager `fun`. (symmem.jit against
  # jax.jit, both compiled: `test_jit_matches_jax_jit_values_and_gradients`.)
  want = fun(*_args(**dims))
  for at in (dims, MAX):
    env = a.graph.constraints.complete(at)
    flat = jax.tree_util.tree_leaves(_args(**at))
    # (c) The model equals the reference executor at every step, for round 0 in
    # its per-shape order and for the last round (every eviction applied).
    for k in sorted({0, len(a.rounds) - 1}):
      r, order = a.rounds[k], a.round_order(k, at)
      assert schedule.is_valid_order(r.program, order)
      outs, live, arguments = executor.run_tracked(
          tracing.specialize_program(r.program, env), flat, order)
      profile = memory.profile(r.graph, r.program, order)
      assert profile.live_bytes(include_transients=False, **at) == live, (k, at)
      assert a.round_peak(k, at) == max([arguments] + live), (k, at)
      if at is dims:   # recomputation computes what was evicted
        for got, w in zip(outs, jax.tree_util.tree_leaves(want)):
          np.testing.assert_allclose(got, w, rtol=1e-4,
                                     atol=1e-5 * float(np.nanmax(np.abs(w), initial=1.0)))
    # (d) Budgets at or above the smallest achievable peak are met by the dispatched
    # round (the smallest that fits); below it, BudgetError names the minimum.
    peaks = _peaks(a, at)
    lowest = min(peaks)
    for budget in (lowest, lowest + int(fraction * (peaks[0] - lowest)), peaks[0], 2 * peaks[0]):
      budgeted = dataclasses.replace(a, memory_budget=budget)
      assert budgeted.peak_bytes(**at) <= budget
      k = a.choose_round(at, budget)
      assert all(p > budget for p in peaks[:k])
    with pytest.raises(symmem.BudgetError, match="smallest achievable peak"):
      dataclasses.replace(a, memory_budget=lowest - 1).peak_bytes(**at)


def _orders_property(max_examples):
  @hypothesis.settings(max_examples=max_examples, deadline=None)
  @hypothesis.given(ops=PROGRAMS, dims=SHAPES, fraction=st.floats(0, 1))
  def test(ops, dims, fraction):
    _check_orders_model_and_budgets(ops, dims, fraction)
  own_database_key(test, max_examples)
  return test


test_orders_model_and_budgets = _orders_property(2)
test_orders_model_and_budgets_many = pytest.mark.slow(_orders_property(20))
