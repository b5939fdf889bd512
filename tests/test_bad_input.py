"""Bad input to `symmem.jit`: a clear error naming the cause, or one logged warning and
plain `jax.jit` with the same result; never a wrong result. One test per row of the
README's "Bad input" table."""

from concurrent import futures
import functools
import logging as py_logging

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import variants
from tests import budgets


def _fallback_warnings(caplog):
  return [r for r in caplog.records if "falls back to jax.jit" in r.getMessage()]


def _sum_rows(x, y):
  return jnp.sum(x, axis=1) + jnp.sum(y)


# -- shapes --------------------------------------------------------------------------


def test_constant_axis_whose_size_changes():
  f = symmem.jit(_sum_rows, polymorphic_shapes=("b, 4", None))
  f(jnp.ones((2, 4)), jnp.ones(3))
  with pytest.raises(symmem.ShapeError,
                     match=r"args\[0\] has shape \(2, 5\), but axis 1 was traced as a constant 4"
                           r".*must be a symbolic dim"):
    f(jnp.ones((2, 5)), jnp.ones(3))


def test_none_spec_whose_shape_changes():
  f = symmem.jit(_sum_rows, polymorphic_shapes=("b, _", None))
  np.testing.assert_allclose(f(jnp.ones((2, 4)), jnp.ones(3)), [7.0, 7.0])
  with pytest.raises(symmem.ShapeError,
                     match=r"args\[1\] has shape \(5,\), but axis 0 was traced as a constant 3"):
    f(jnp.ones((2, 4)), jnp.ones(5))
  with pytest.raises(symmem.ShapeError, match=r"args\[1\] has shape \(3, 1\), expected rank 1"):
    f(jnp.ones((2, 4)), jnp.ones((3, 1)))


def test_shape_outside_the_constraints():
  f = symmem.jit(lambda x: jnp.sum(x * x), polymorphic_shapes=("b, s",),
                 constraints=("s <= 64", "b >= 2"))
  assert float(f(jnp.ones((2, 16)))) == 32.0
  with pytest.raises(symmem.ShapeError, match=r"s = 72 is outside \[1, 64\].*s <= 64"):
    f(jnp.ones((2, 72)))
  with pytest.raises(symmem.ShapeError, match=r"b = 1 is outside \[2, inf\].*b >= 2"):
    f(jnp.ones((1, 16)))
  # A declared multiple: s = 8*k, so the bound on s is one on k.
  g = symmem.jit(lambda x: jnp.sum(x * x), polymorphic_shapes=("b, s",),
                 constraints=("s <= 64", "s == 8*k"))
  assert float(g(jnp.ones((2, 16)))) == 32.0
  with pytest.raises(symmem.ShapeError,
                     match=r"axis 1 must be 8\*k for some integer k >= 1 \(constraints: s == 8\*k\), "
                           r"and 12 is not"):
    g(jnp.ones((2, 12)))
  with pytest.raises(symmem.ShapeError, match=r"k = 9 is outside \[1, 8\].*s == 8\*k"):
    g(jnp.ones((2, 72)))
  assert f.cache_info()["compiles"] == g.cache_info()["compiles"] == 1


def test_an_empty_batch_runs_as_jax_jit_runs_it():
  # jax.export's dims are >= 1; a batch with b = 0 (or s = 0) has nothing to recompute.
  def step(w, x, mask):
    def loss(w):
      return jnp.sum(jnp.tanh(x @ w).sum(-1) * mask) / jnp.maximum(mask.sum(), 1.0)
    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value
  w = jnp.full((8, 8), 0.1)
  batches = [(jnp.ones((b, s, 8)), jnp.ones((b, s))) for b, s in ((2, 16), (0, 16), (2, 0))]
  expected = [jax.jit(step)(w, *batch) for batch in batches]
  f = symmem.jit(step, polymorphic_shapes=(None, "b, s, _", "b, s"), constraints=("b <= 4", "s <= 64"))
  for batch, want in zip(batches, expected):
    chex.assert_trees_all_close(f(w, *batch), want, rtol=0, atol=0)
  assert f.cache_info()["empty_batches"] == 2
  assert f.last_call["empty_batch"] and f.last_call["round"] == 0
  assert f.last_call["dims"] == {"b": 2, "s": 0}
  # Under a budget: XLA's figure of the step as jax.jit compiles it, checked once per shape.
  g = symmem.jit(step, polymorphic_shapes=(None, "b, s, _", "b, s"), constraints=("b <= 4", "s <= 64"), memory_budget="64MiB")
  chex.assert_trees_all_close(g(w, *batches[1]), expected[1], rtol=0, atol=0)
  chex.assert_trees_all_close(g(w, *batches[1]), expected[1], rtol=0, atol=0)
  assert 0 < g.last_call["xla_bytes"] <= 64 * 2**20 and g.cache_info()["compiles"] == 1
  tight = symmem.jit(step, polymorphic_shapes=(None, "b, s, _", "b, s"),
                     constraints=("b <= 4", "s <= 64"), memory_budget=64)
  with pytest.raises(symmem.BudgetError, match=r"an empty axis: XLA's memory_analysis\(\) reports"):
    tight(w, *batches[1])
  # Other bad shapes keep their errors.
  with pytest.raises(symmem.ShapeError, match=r"axis 2 was traced as a constant 8"):
    f(w, jnp.ones((0, 16, 3)), jnp.ones((0, 16)))


def test_spec_of_the_wrong_rank():
  f = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("b",))
  with pytest.raises(symmem.ShapeSpecError, match=r"args\[0\] has rank 1 .* shape \(2, 3\)"):
    f(jnp.ones((2, 3)))


def test_a_spec_with_a_static_axis_the_argument_lacks_names_the_argument():
  # jax.export's own message ("cannot resolve placeholder '_'") names neither.
  f = symmem.jit(lambda w, b: (b["x"].sum(-1) * b["mask"]).sum() * w,
                 polymorphic_shapes=(None, {"x": "b, s, _", "mask": "b, s, _"}))
  batch = {"x": jnp.ones((2, 3, 4)), "mask": jnp.ones((2, 3))}
  with pytest.raises(symmem.ShapeSpecError,
                     match=r"args\[1\]\['mask'\] has rank 3 \('b, s, _'\) .* shape \(2, 3\)"):
    f(1.0, batch)
  g = symmem.jit(lambda w, b: b["x"].sum() * w, polymorphic_shapes=(None, "b, s, _"))
  with pytest.raises(symmem.ShapeSpecError, match=r"args\[1\]\['mask'\] has rank 3"):
    g(1.0, batch)   # one spec for every leaf of the batch
  assert float(symmem.jit(g.__wrapped__, polymorphic_shapes=(None, "b, ..."))(1.0, batch)) == 24.0


def test_contradictory_constraints():
  with pytest.raises(symmem.ConstraintError, match="contradict"):   # where given
    symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("b",), constraints=("b >= 8", "b <= 4"))


def test_constraints_given_as_one_string():
  with pytest.raises(symmem.ConstraintError, match=r"write constraints=\('s <= 512',\)"):
    symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("s",), constraints="s <= 512")


def test_constraint_on_a_dim_no_argument_has():
  f = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("b, s",),
                 constraints=("s >= 2", "sl <= 512"))   # a typo for s: the bound would vanish
  with pytest.raises(symmem.ConstraintError, match=r"'sl <= 512' names 'sl'.*dims: b, s"):
    f(jnp.ones((2, 600)))
  # A dim of its own, tied to the arguments' by an equality, is fine in any order.
  g = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("b, s",),
                 constraints=("k <= 4", "s == 8*k"))
  np.testing.assert_array_equal(g(jnp.ones((2, 16))), 2.0)
  with pytest.raises(symmem.ShapeError):
    g(jnp.ones((2, 40)))   # k = 5


def test_another_pytree_structure_is_traced_anew_as_jax_jit_does():
  # jax.jit traces once per structure of its arguments; so does symmem.jit (and plans once).
  f = lambda p, x: sum(v * x for v in jax.tree_util.tree_leaves(p))
  g = symmem.jit(f, polymorphic_shapes=(None, "n"))
  for p, n in (({"w": jnp.ones(())}, 3), ({"w": jnp.ones(()), "v": 2 * jnp.ones(())}, 3),
               ({"w": jnp.ones(())}, 5), ([jnp.ones(())], 4)):
    np.testing.assert_allclose(g(p, jnp.arange(n, dtype=jnp.float32)),
                               jax.jit(f)(p, jnp.arange(n, dtype=jnp.float32)), rtol=1e-6)
  assert g.cache_info()["compiles"] == 4 and len(g.calibration()) == 3   # three traced
  # A spec dict may name entries a batch has at some calls only (an optional mask).
  def masked(w, batch):
    y = batch["x"].sum(-1) * w
    return (y * batch["mask"]).sum() if "mask" in batch else y.sum()
  m = symmem.jit(masked, polymorphic_shapes=(None, {"x": "b, s, _", "mask": "b, s"}))
  x, mask = jnp.ones((2, 3, 4)), jnp.asarray([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
  for batch in ({"x": x}, {"x": x, "mask": mask}, {"x": x[:1]}):
    assert float(m(2.0, batch)) == float(jax.jit(masked)(2.0, batch))
  assert len(m._entries) == 2
  # A structure the step cannot take: its own error, as jax.jit raises it.
  h = symmem.jit(lambda p, x: p["w"] * x, polymorphic_shapes=(None, "n"))
  h({"w": jnp.ones(())}, jnp.ones(3))
  with pytest.raises(KeyError, match="'w'"):
    h({"v": jnp.ones(())}, jnp.ones(3))


# -- functions the planner cannot handle --------------------------------------------


def test_unsupported_primitive_falls_back(caplog):
  # pure_callback's result shapes are a parameter the planner cannot specialize. The
  # step as written compiles from the function itself and runs; a program the planner
  # built (here: its order fenced in, as a rewritten round would be) fails to compile,
  # so the step runs under jax.jit.
  def f(x):
    y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return y * 2.0
  as_written = symmem.jit(f, polymorphic_shapes=("n",))
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    np.testing.assert_allclose(as_written(jnp.arange(3.0)), jax.jit(f)(jnp.arange(3.0)))
  assert not _fallback_warnings(caplog) and as_written.cache_info()["fallback_calls"] == 0
  g = symmem.jit(f, polymorphic_shapes=("n",), impose_schedule=True)
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    for n in (3, 5, 3):
      x = jnp.arange(n, dtype=jnp.float32)
      np.testing.assert_allclose(g(x), jax.jit(f)(x), rtol=1e-6)
  (warning,) = _fallback_warnings(caplog)
  assert "compiling at {'n': 3}" in warning.getMessage()
  assert g.cache_info()["fallback_calls"] == 3


def test_python_control_flow_on_a_dim_falls_back(caplog):
  def f(x):
    return x * 2.0 if x.shape[0] > 3 else x + 1.0
  g = symmem.jit(f, polymorphic_shapes=("n",))
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    for n in (2, 5):
      np.testing.assert_allclose(g(jnp.ones(n)), jax.jit(f)(jnp.ones(n)))
  (warning,) = _fallback_warnings(caplog)
  assert "add a constraint that decides it ('n >= 4' if n > 3 holds for all your batches, " \
         "'n <= 3' if it never does)" in warning.getMessage()


def _masked_sum(tokens, segments, mask):
  return jnp.sum(tokens * segments * mask)


def test_an_argument_left_static_says_which_spec_to_give(caplog):
  x = jnp.ones((2, 64))
  g = symmem.jit(_masked_sum, polymorphic_shapes=("b, s", None, "b, s"), memory_budget=2**30)
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    np.testing.assert_allclose(g(x, x, x), 128.0)
  (warning,) = _fallback_warnings(caplog)
  message = warning.getMessage()
  assert "args[1] has a static spec and shape (2, 64)" in message
  assert "give it the spec 'b, s'" in message
  assert "memory budget (1073741824) is not enforced" in message
  assert g.cache_info()["fallback_calls"] == 1


def test_a_parameter_whose_sizes_match_the_dims_by_chance_is_not_named():
  # The error is the step's own (a length off by one); the (4, 8) weight is not in it.
  def f(w, x):
    return jnp.sum(x[:, 1:] * x) + jnp.sum(w)
  with pytest.raises(symmem.TracingError) as e:
    symmem.trace(f, jnp.ones((4, 8)), jnp.ones((4, 8)), polymorphic_shapes=(None, "b, s"))
  assert "incompatible shapes" in str(e.value) and "static spec" not in str(e.value)


def test_an_argument_left_static_is_named_where_a_scan_meets_it():
  def accumulate(tokens, weights):   # microbatches: a scan over both arguments
    return lax.scan(lambda c, xw: (c + jnp.sum(xw[0] * xw[1]), None), 0.0, (tokens, weights))[0]
  x = jnp.ones((3, 2, 8))
  with pytest.raises(symmem.TracingError, match=r"different leading axis sizes.*\n.*args\[1\] "
                     r"has a static spec and shape \(3, 2, 8\).*the spec 'm, b, s'"):
    symmem.trace(accumulate, x, x, polymorphic_shapes=("m, b, s", None))


def test_one_dim_spelled_two_ways_is_named(caplog):
  x = jnp.ones((2, 64))
  g = symmem.jit(_masked_sum, polymorphic_shapes=("b, s", "b, S", "b, s"))
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    np.testing.assert_allclose(g(x, x, x), 128.0)
  (warning,) = _fallback_warnings(caplog)
  assert "dims S, s are all 64 at this call" in warning.getMessage()
  assert "not enforced" not in warning.getMessage()   # no budget was asked for


def test_reshape_without_a_divisible_dim_falls_back(caplog):
  def f(x):
    return jnp.sum(x.reshape(x.shape[0], -1, 4) ** 2, axis=1)
  g = symmem.jit(f, polymorphic_shapes=("b, s",))
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    x = jnp.arange(24, dtype=jnp.float32).reshape(2, 12)
    np.testing.assert_allclose(g(x), jax.jit(f)(x))
  (warning,) = _fallback_warnings(caplog)
  assert "declare it as a multiple" in warning.getMessage()
  # Declaring the multiple traces it symbolically.
  h = symmem.jit(f, polymorphic_shapes=("b, 4*k",))
  np.testing.assert_allclose(h(x), jax.jit(f)(x))
  assert h.cache_info()["fallback_calls"] == 0


def test_data_dependent_shape(caplog):
  nonzero = lambda x: jnp.nonzero(x)[0]
  g = symmem.jit(nonzero, polymorphic_shapes=("n",))
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    for _ in range(2):   # jax.jit cannot run it either: its own error, every call
      with pytest.raises(jax.errors.ConcretizationTypeError, match="size argument of jnp.nonzero"):
        g(jnp.array([0.0, 1.0, 2.0]))
  assert not _fallback_warnings(caplog)   # the step's own error: nothing to fall back to
  assert g.cache_info()["fallback_calls"] == 0
  # With a static size it traces symbolically.
  sized = symmem.jit(lambda x: jnp.nonzero(x, size=2)[0], polymorphic_shapes=("n",))
  np.testing.assert_array_equal(sized(jnp.array([0.0, 1.0, 2.0, 0.0])), [1, 2])
  assert sized.cache_info()["fallback_calls"] == 0


def test_an_error_in_the_step_itself_is_jax_jits_error_not_a_fallback(caplog):
  # A shape mismatch fails the symbolic trace and jax.jit's alike: before, a warning
  # blamed the symbolic dims ("see the shape polymorphism guide") and the step fell back.
  def step(w, x):
    return jnp.sum(x @ w.T[:3])   # (b, 8) @ (3, 8)
  g = symmem.jit(step, polymorphic_shapes=(None, "b, _"), memory_budget="1GiB")
  args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
  with pytest.raises(TypeError) as want:
    jax.jit(step)(*args)
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    with pytest.raises(TypeError) as got:
      g(*args)
  assert str(got.value) == str(want.value) and not _fallback_warnings(caplog)
  assert g.cache_info()["fallback_calls"] == 0


@pytest.mark.filterwarnings("ignore:backend and device argument on jit is deprecated")
def test_unsupported_jit_options_fall_back(caplog):
  g = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("n",), backend="cpu")
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    np.testing.assert_allclose(g(jnp.ones(3)), 2 * np.ones(3))
    np.testing.assert_allclose(g(jnp.ones(4)), 2 * np.ones(4))
  (warning,) = _fallback_warnings(caplog)
  assert "backend" in warning.getMessage()
  assert g.cache_info()["fallback_calls"] == 2


def test_jit_without_polymorphic_shapes_says_what_to_give():
  # jax.jit(f) has no such argument: a user swapping in symmem.jit learns what it means.
  for call in (lambda: symmem.jit(lambda x: x), lambda: symmem.jit(),
               lambda: symmem.nnx_jit(lambda m, x: x)):
    with pytest.raises(TypeError, match=r"needs polymorphic_shapes.*'b, s'.*constraints"):
      call()


def test_a_partial_is_named_by_its_function():
  # functools.partial has no __name__: the error paths read the wrapped function's.
  def loss(x, mask=None, *, scale=1.0):
    return jnp.sum(jnp.tanh(x) * scale)
  step = symmem.jit(functools.partial(loss, scale=2.0), polymorphic_shapes=("b, s",))
  x = jnp.ones((2, 5))
  assert step.__name__ == "loss" and float(step(x)) == float(jax.jit(step.__wrapped__)(x))
  with pytest.raises(TypeError, match=r"^loss: argument args\[0\] of type str"):
    step("tokens")
  with pytest.raises(symmem.ShapeSpecError, match="has 1 entry for 2 array arguments"):
    step(x, x)   # one spec for two arguments


def test_a_misspelt_jit_option_is_a_type_error_at_once():
  # As jax.jit raises at decoration, not at a first call that falls back first.
  with pytest.raises(TypeError, match=r"donate_argnum\b.*jax.jit's options are"):
    symmem.jit(lambda x: x, polymorphic_shapes=("n",), donate_argnum=0)
  with pytest.raises(TypeError, match="static_argnum"):
    symmem.jit(polymorphic_shapes=("n",), static_argnum=0)


# -- budgets -------------------------------------------------------------------------


def test_budget_below_the_minimum(caplog):
  def loss(x, w):   # SiLU: the same rounds in every jax the pin allows (tests/test_jit.py)
    return jnp.sum(jax.nn.silu(jax.nn.silu(jax.nn.silu(x @ w) @ w.T) @ w) ** 2)
  args = lambda b: (jnp.ones((b, 256)), jnp.ones((256, 256)) / 256)
  dims = {"b": 512}
  probe = symmem.analyze(jax.grad(loss, argnums=1), *args(8), polymorphic_shapes=("b, _", None),
                         constraints=("b <= 512",))
  lowest = min(probe.round_peak(k, dims) for k in range(len(probe.rounds)))
  step = symmem.jit(jax.grad(loss, argnums=1), polymorphic_shapes=("b, _", None),
                    constraints=("b <= 512",), memory_budget=lowest // 2)
  # The model's verdict names the smallest modeled peak; symmem.jit refuses only once
  # XLA confirms that nothing the planner builds (nor round 0, as jax.jit) fits.
  with pytest.raises(symmem.BudgetError,
                     match=rf"smallest achievable peak at {{'b': 512}}: {lowest / 2**20:.1f} MiB"):
    probe.choose_round(dims, lowest // 2)
  refused = r"at \{'b': 512\}: XLA's memory_analysis\(\) reports"
  with caplog.at_level(py_logging.WARNING, logger="absl"), pytest.raises(symmem.BudgetError,
                                                                         match=refused) as e:
    step(*args(512))
  assert step.cache_info()["budget_errors"] == 1
  # A search past a few compiles says so once, before the compiles that follow.
  (long_search,) = [r.getMessage() for r in caplog.records
                    if "rounds compiled and none" in r.getMessage()]
  assert f"{variants.LONG_SEARCH} rounds compiled" in long_search
  assert f"the other rounds ({len(probe.rounds) - variants.LONG_SEARCH})" in long_search
  # Every round, then the refusal (and round 0 with XNNPACK's fusions first, not a round).
  assert sorted(budgets.rounds_compiled(e.value)) == list(range(len(probe.rounds)))


def test_fractional_budget_without_a_device_limit():
  if jit_lib._device_memory()[1] is not None:
    pytest.skip("this device reports a memory limit: fractions are allowed")
  g = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("n",), memory_budget=0.5)
  with pytest.raises(ValueError, match="reports no memory limit; give the budget in bytes"):
    g(jnp.ones(3))


@pytest.mark.usefixtures("own_arrays_only")   # a budget of a few KiB to 1 MiB
def test_budget_as_a_size_string():
  x = jnp.ones((4, 8))
  for given, expected in (("200MiB", 200 * 2**20), ("1.5 GiB", 3 * 2**29), ("4096B", 4096)):
    g = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("b, _",), memory_budget=given)
    np.testing.assert_array_equal(g(x), 2.0)
    assert g.last_call["budget"] == expected
  for wrong in ("200MB", "lots", "-5MiB"):   # MB could mean 10**6 or 2**20: not guessed
    with pytest.raises(ValueError, match=r"memory_budget=.*give bytes .* such as '200MiB'"):
      symmem.jit(lambda x: x, polymorphic_shapes=("b",), memory_budget=wrong)
  with pytest.raises(TypeError, match="memory_budget must be bytes"):
    symmem.jit(lambda x: x, polymorphic_shapes=("b",), memory_budget=[1])
  for wrong in (0, -1, 1.5, "0MiB"):   # refused where given, not at the first call
    with pytest.raises(ValueError, match="must be positive|must be in \\(0, 1\\]"):
      symmem.jit(lambda x: x, polymorphic_shapes=("b",), memory_budget=wrong)
  # Bytes computed as a float (a peak times 1.25) are not taken as a fraction, nor guessed.
  with pytest.raises(ValueError, match=r"got 2000000000.0 \(bytes as a float\? pass "
                                       r"int\(2000000000.0\)\)"):
    symmem.jit(lambda x: x, polymorphic_shapes=("b",), memory_budget=2e9)
  assert symmem.jit(lambda x: x, polymorphic_shapes=("b",), memory_budget=np.int64(2**20))(
      x[0]).shape == (8,)


def test_a_budget_under_a_mebibyte_is_printed_in_bytes():
  g = symmem.jit(lambda x: jnp.sin(x) @ x.T, polymorphic_shapes=("b, _",), memory_budget=1024)
  # "above the 1,024 bytes budget", or, where arrays of earlier tests in this process are
  # still live, "above the N bytes that the 1,024 bytes budget leaves beside them".
  with pytest.raises(symmem.BudgetError, match=r"the 1,024 bytes budget"):
    g(jnp.ones((512, 512)))


def test_a_dim_without_an_upper_bound_under_a_budget_says_where_the_plan_is_made(caplog):
  def step(x):
    return jnp.sum(jnp.tanh(x @ x.T))
  def unbounded_warnings(constraints, budget="1GiB"):
    caplog.clear()
    with caplog.at_level(py_logging.WARNING):
      g = symmem.jit(step, polymorphic_shapes=("b, s",), constraints=constraints,
                     memory_budget=budget)
      np.testing.assert_allclose(g(jnp.ones((4, 8))), jax.jit(step)(jnp.ones((4, 8))))
    return [r.getMessage() for r in caplog.records if "no upper bound" in r.getMessage()]
  (w,) = unbounded_warnings(("b <= 64",))
  assert "no upper bound on 's'" in w and "made at s = 1" in w and "'s <= 4096'" in w
  assert unbounded_warnings(("b <= 64", "s <= 512")) == []
  assert unbounded_warnings(("s <= 512", "b*s <= 4096")) == []   # b <= 4096 implied
  assert unbounded_warnings((), budget=None) == []   # no budget: the plan is not used


# -- arguments that are not arrays ---------------------------------------------------


def test_python_numbers_are_weakly_typed_scalars_as_under_jax_jit():
  # flax's TrainState.create keeps step=0 a Python int; a learning rate is often a float.
  scale = lambda x, a: (x * a, a + 1)
  x = jnp.ones(3, jnp.bfloat16)
  for values in ((2.0, 2.5, jnp.float32(2.0), jnp.float32(0.5)), (3, 0), (True, False)):
    g = symmem.jit(scale, polymorphic_shapes=("n", None))
    for a in values:
      got, want = g(x, a), jax.jit(scale)(x, a)
      for u, v in zip(got, want):   # a weak float keeps x's bfloat16; a strong one does not
        assert (u.dtype, u.weak_type) == (v.dtype, v.weak_type), (a, u.dtype, v.dtype)
        np.testing.assert_array_equal(u, v)
    # One trace per weak-type pattern, as jax.jit (Python float vs float32 array).
    assert g.cache_info()["fallback_calls"] == 0
    assert len(g.variants()) == len({getattr(a, "weak_type", True) for a in values})
  static = symmem.jit(scale, polymorphic_shapes=("n", None), static_argnums=1)
  np.testing.assert_allclose(static(jnp.ones(3), 2.0)[0], 2 * np.ones(3))


def test_string_argument():
  def f(x, mode):
    return jnp.sum(x) if mode == "sum" else jnp.max(x)
  g = symmem.jit(f, polymorphic_shapes=("n", None))
  with pytest.raises(TypeError, match=r"args\[1\] of type str \('sum'\) is not an array; mark it static"):
    g(jnp.ones(3), "sum")
  static = symmem.jit(f, polymorphic_shapes=("n",), static_argnames="mode")
  assert float(static(jnp.arange(4.0), mode="sum")) == 6.0
  assert float(static(jnp.arange(4.0), mode="max")) == 3.0


def test_another_dtype_is_traced_anew_as_jax_jit_does():
  g = symmem.jit(jnp.sum, polymorphic_shapes=("n",))
  assert int(g(jnp.array([True, False, True]))) == 2
  # Run by the bool-traced program, floats would be cast to int (0.5 + 1.5 -> 1): they get
  # their own trace, as under jax.jit, and the bool one stays.
  for x in (jnp.array([0.5, 1.5, 1.0]), jnp.array([0.5, 1.5]), jnp.array([True, True])):
    out = g(x)
    assert out.dtype == jax.jit(jnp.sum)(x).dtype
    np.testing.assert_array_equal(out, jax.jit(jnp.sum)(x))
  assert len(g._entries) == 2 and g.cache_info()["compiles"] == 4   # each dtype at n = 3 and 2
  f = symmem.jit(lambda x: x * 2.0, polymorphic_shapes=("n",))
  f(jnp.ones(3))
  np.testing.assert_allclose(f(np.ones(4)), 2 * np.ones(4))   # float64 is float32 without x64
  assert len(f._entries) == 1
  # Typed and raw PRNG keys each have their trace too; the draws are jax.jit's.
  def noise(x, key):
    return x + jax.random.normal(key, x.shape)
  h = symmem.jit(noise, polymorphic_shapes=("n", None))
  for key in (jax.random.key(0), jax.random.PRNGKey(0), jax.random.key(1)):
    np.testing.assert_array_equal(h(jnp.ones(3), key), jax.jit(noise)(jnp.ones(3), key))
  assert len(h._entries) == 2
  # The other way round, and another key implementation: typed keys are extended dtypes.
  raw_first = symmem.jit(noise, polymorphic_shapes=("n", None))
  for key in (jax.random.PRNGKey(0), jax.random.key(0), jax.random.key(0, impl="rbg")):
    np.testing.assert_array_equal(raw_first(jnp.ones(3), key), jax.jit(noise)(jnp.ones(3), key))
  assert len(raw_first._entries) == 3
  assert h.analyze(jnp.ones(3), jax.random.PRNGKey(0)) is not h.analyze(jnp.ones(3),
                                                                          jax.random.key(0))


def test_keyword_arguments_that_have_no_position_to_go_to():
  # Dynamic keyword arguments go to their parameters' positions (test_jit's
  # test_dynamic_arguments_by_keyword_take_their_positions_as_jax_jit_traces_them).
  def step(w, x, scale=0.5, bias=None, *, y=None, **extra):
    return x * scale
  g = symmem.jit(step, polymorphic_shapes=(None, "n"))
  x = jnp.ones(3)
  with pytest.raises(TypeError, match=r"'bias' is passed by keyword.*'scale' before it is not "
                     r"passed and its default \(0.5\) would become a traced argument"):
    g(1.0, x, bias=x)
  with pytest.raises(TypeError, match="'y' has no position among the step's parameters"):
    g(1.0, x, y=x)
  with pytest.raises(TypeError, match="'z' has no position"):
    g(1.0, x, z=x)
  with pytest.raises(TypeError, match="multiple values for argument 'x'"):   # Python's own
    g(1.0, x, x=x)


# -- donation and threads ------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, 2**30])
def test_donated_argument_that_is_also_returned(budget):
  def f(w, x):
    return w, w * 2.0 + jnp.sum(x)
  g = symmem.jit(f, polymorphic_shapes=("n", "m"), donate_argnums=0, memory_budget=budget)
  ref = jax.jit(f, donate_argnums=0)
  for n in (5, 5, 7):
    w, x = jnp.arange(n, dtype=jnp.float32), jnp.ones(3)
    got = g(w, x)
    assert w.is_deleted()   # donated, as jax.jit does
    want = ref(jnp.arange(n, dtype=jnp.float32), x)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[0], np.arange(n))   # the alias holds the input's values
  assert g.cache_info()["compiles"] == 2 and g.cache_info()["fallback_calls"] == 0


def test_calls_from_several_threads():
  def f(x, w):
    return jnp.tanh(x @ w).sum(axis=0), jnp.mean(x)
  g = symmem.jit(f, polymorphic_shapes=("b, d", "d, _"), constraints=("b <= 64", "d <= 64"))
  ref = jax.jit(f)
  shapes = [(2, 3), (8, 3), (2, 16), (33, 7)]
  def call(i):
    b, d = shapes[i % len(shapes)]
    x = jnp.asarray(np.random.RandomState(i).randn(b, d), jnp.float32)
    w = jnp.ones((d, 4)) / d
    return g(x, w), ref(x, w)
  with futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(call, range(40)))
  for got, want in results:
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  info = g.cache_info()
  assert info["compiles"] == len(shapes) and info["hits"] == 40 - len(shapes)
  assert info["fallback_calls"] == 0


def test_calls_from_several_threads_that_fall_back(caplog):
  def f(x):
    return jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2.0
  g = symmem.jit(f, polymorphic_shapes=("n",), impose_schedule=True)   # the planner's program
  with caplog.at_level(py_logging.WARNING, logger="absl"):
    with futures.ThreadPoolExecutor(8) as pool:
      results = list(pool.map(lambda i: (i, g(jnp.arange(i % 3 + 2.0))), range(24)))
  for i, got in results:
    np.testing.assert_allclose(got, 2 * np.cos(np.arange(i % 3 + 2.0)), rtol=1e-6)
  assert len(_fallback_warnings(caplog)) == 1
  assert g.cache_info()["fallback_calls"] == 24
