"""Constraint normalization: bounds, substitutions, general inequalities, contradictions."""

import pytest

from jax_symmem._src.constraints import parse_constraints
from jax_symmem._src.errors import ConstraintError
from jax_symmem._src.poly import Poly


def test_bounds_from_linear_constraints():
  c = parse_constraints(("s <= 4096", "b <= 64", "b >= 2", "3*s > 6"), ["b", "s"])
  assert c.bounds_map == {"b": (2, 64), "s": (3, 4096)}
  assert c.inequalities == () and c.substitutions == ()


def test_default_bounds_are_positive_and_unbounded():
  c = parse_constraints((), ["b", "s"])
  assert c.bounds_map == {"b": (1, None), "s": (1, None)}


def test_divisibility_by_substitution():
  c = parse_constraints(("s == 128*k", "s <= 4096"), ["b", "s"])
  assert c.bounds_map["k"] == (1, 32)
  assert "s" not in c.bounds_map and c.eliminated == {"s"}
  assert c.reduce(Poly.var("s") * Poly.var("b")) == 128 * Poly.var("k") * Poly.var("b")
  assert c.complete({"k": 3, "b": 1}) == {"k": 3, "b": 1, "s": 384}
  assert c.violation({"b": 1, "k": 3, "s": 385}) is not None


def test_general_inequality_is_kept_and_checked():
  c = parse_constraints(("b*s <= 65536", "s <= 4096"), ["b", "s"])
  assert len(c.inequalities) == 1
  assert c.violation({"b": 16, "s": 4096}) is None
  assert "fails" in c.violation({"b": 17, "s": 4096})
  assert "outside" in c.violation({"b": 1, "s": 4097})


@pytest.mark.parametrize("bad,match", [
    (("s >= 10", "s <= 5"), "contradict"),
    (("s <= 0",), "contradict"),
    (("s == s + 1",), "contradicts"),
    (("3 <= 2",), "never hold"),
    (("s <> 3",), "cannot parse"),
    (("s ~ 3",), "cannot parse"),
    (("s*s == 4*k",), "var == expression"),
    ((5,), "must be a string"),
    ("s <= 4", "sequence of strings"),
])
def test_bad_constraints_raise_clear_errors(bad, match):
  with pytest.raises(ConstraintError, match=match):
    parse_constraints(bad, ["s"])
