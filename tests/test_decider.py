"""The shared comparison policy: decided / depends / fallback, and the counts' dict shape."""

import pytest

from jax_symmem import symbolic
from jax_symmem._src.decider import Decider, DecisionCounts
from jax_symmem._src.poly import Poly

b, s = Poly.var("b"), Poly.var("s")
CONS = symbolic.parse_constraints(["b <= 8", "s <= 8"], variables="bs")


def test_counts_add_and_keep_the_stats_dict_shape():
  a, c = DecisionCounts(3, 1, 1, 1), DecisionCounts(comparisons=2, decided=2)
  assert a + c == DecisionCounts(5, 3, 1, 1)
  assert sum([a, c], DecisionCounts()) == a + c
  assert list((a + c).as_dict().items()) == [
      ("comparisons", 5), ("decided", 3), ("depends", 1), ("fallback", 1)]
  stats = {"choices": 9, "comparisons": 5, "decided": 3, "depends": 1, "fallback": 1, "rounds": 2}
  assert DecisionCounts.from_stats(stats) == a + c
  assert DecisionCounts.from_stats({}) == DecisionCounts()


def test_symbolic_decides_resolves_depends_at_the_shape_and_falls_back():
  decider = Decider(CONS, {"b": 8, "s": 2})
  assert decider.decide(b * s, s) == (1, True)                   # GE
  assert decider.decide(s, b * s) == (-1, True)                  # LE
  assert decider.decide(2 * b, b + b) == (0, True)               # EQ
  assert decider.decide(b, s) == (1, False)                      # DEPENDS, b > s at the shape
  assert decider.decide(2 * s, b - 4) == (0, False)              # DEPENDS, equal at the shape
  unknown = symbolic.parse("mod(b, s - b)")
  assert symbolic.compare_polys(unknown, b, CONS).kind == "UNKNOWN"
  assert decider.decide(unknown, b) == (None, False)             # the caller's rule
  assert decider.sign_at(unknown, b) == -1                       # mod(8, -6) = -4 < 8
  assert decider.counts == DecisionCounts(comparisons=6, decided=3, depends=2, fallback=1)


def test_the_ablation_never_compares_and_static_dims_count_nothing():
  ablation = Decider(CONS, {"b": 8, "s": 8}, "fallback")
  assert ablation.decide(b * s, s) == (None, False)
  assert ablation.counts == DecisionCounts(comparisons=1, fallback=1)
  static = Decider(CONS, {"b": 2, "s": 3}, "static")
  assert static.decide(b, s) == (-1, True) and static.decide(3 * b, 2 * s) == (0, True)
  assert static.counts == DecisionCounts()
  with pytest.raises(ValueError, match="mode"):
    Decider(CONS, {}, "exact")
