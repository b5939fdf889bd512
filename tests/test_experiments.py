"""Helpers the benchmarks report with (experiments/_common.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import _common


def test_deviation_tells_adamws_sign_flips_from_gradients():
  # Two gradients a rounding step apart, one element near zero on either side of it:
  # AdamW's first update moves that parameter by about +lr and -lr, while the first
  # moments (0.1 x the gradient) stay a rounding step apart.
  lr = 1e-3
  params = {"w": jnp.full((4, 4), 0.05)}
  tx = optax.adamw(lr)
  g = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)
  g[0, 0] = 3e-7
  g_other = g.copy()
  g_other[0, 0] = -3e-7
  def step(grad):
    updates, opt_state = tx.update({"w": jnp.asarray(grad)}, tx.init(params), params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}
  a, b = step(g), step(g_other)

  d = _common.deviation(a, b)
  assert not _common.trees_close(a, b)
  assert d["elements_off"] == 1   # the flipped parameter (its first moments are close)
  # The parameter moved by about 2 x lr, 4 % of the leaf's largest (0.05 + lr).
  np.testing.assert_allclose(d["largest_off"], 2 * lr, rtol=0.05)
  assert d["worst_leaf"] > 0.03
  # The first moments differ by 0.1 x 6e-7 against a largest of 0.1 x 1.
  np.testing.assert_allclose(d["first_moment_worst_leaf"], 6e-7, rtol=1e-2)
  assert _common.deviation(a, a) == {"worst_leaf": 0.0, "elements_off": 0,
                                     "elements": d["elements"], "largest_off": 0.0,
                                     "first_moment_worst_leaf": 0.0}


def test_a_nan_in_one_tree_is_off_and_in_both_is_equal():
  a = {"w": jnp.asarray([1.0, np.nan, 3.0])}
  assert _common.trees_close(a, a)
  assert _common.deviation(a, a)["elements_off"] == 0
  b = {"w": jnp.asarray([1.0, 2.0, 3.0])}
  assert not _common.trees_close(a, b)
  d = _common.deviation(a, b)
  assert d["elements_off"] == 1 and d["worst_leaf"] == np.inf and d["largest_off"] == np.inf
  assert _common.deviation(b, a)["elements_off"] == 1


def test_xla_peak_reads_what_xla_holds_at_its_peak():
  from experiments import xla_peak
  x = jnp.ones((256, 256), jnp.float32)   # 256 KiB each: the argument, exp(x), the product
  if jax.__version_info__ < (0, 10):
    with pytest.raises(RuntimeError, match="0 live-range reports"):   # jax 0.9's XLA writes none
      xla_peak.compile_and_read(lambda a: jnp.exp(a) @ a.T, (x,), {}, "exp_dot")
    return
  got = xla_peak.compile_and_read(lambda a: jnp.exp(a) @ a.T, (x,), {}, "exp_dot")
  assert got["by_op"] == {"arguments": 262144, "exp": 262144, "dot_general": 262144}
  assert got["peak"] == sum(got["by_op"].values()) == 3 * 262144
  assert got["footprint"] == _common.xla_memory(jax.jit(lambda a: jnp.exp(a) @ a.T).lower(x)
                                                .compile())["footprint"]
  assert got["packing"] == got["footprint"] - got["peak"]
  assert [size for _, size in got["largest_values"]] == [262144] * 3


def test_bench_compares_brute_force_counts_only_the_points_the_inequalities_allow():
  # Under t <= s, 4*b*t <= 4*b*s at every allowed point though not over the whole box.
  from experiments import bench_compare
  from jax_symmem._src.constraints import parse_constraints
  from jax_symmem._src.poly import Poly
  b, s, t = (Poly.var(n) for n in "bst")
  ranges = {"b": 2, "s": 6, "t": 6}
  cons = parse_constraints(("b <= 2", "s <= 6", "t <= 6", "t <= s"), variables="bst")
  signs, _ = bench_compare.brute_force_signs(4 * b * t, 4 * b * s, cons, ranges, None)
  assert signs == {0, -1}
  box = parse_constraints(("b <= 2", "s <= 6", "t <= 6"), variables="bst")
  assert bench_compare.brute_force_signs(4 * b * t, 4 * b * s, box, ranges, None)[0] == {-1, 0, 1}
  # The signs along one dim, as sign pieces are checked: at s = 1 only t = 1 is allowed.
  _, by_dim = bench_compare.brute_force_signs(t, Poly.const(1), cons, ranges, "s")
  assert by_dim[1] == {0} and by_dim[6] == {0, 1}
