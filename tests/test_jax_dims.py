"""The bridge to JAX's private `_DimExpr`: fails loudly if JAX changes its layout."""

import itertools
from pathlib import Path
import re

import jax
from jax import export
import pytest

from jax_symmem._src import jax_dims
from jax_symmem._src.poly import OpAtom, Poly

EXPRS = ["4*b*s*11008", "b*s^2 - 3*b + 7", "floordiv(s, 2)*b + mod(b*s, 8)",
         "max(b, s) - min(b, 2*s)", "b^3 - 2*b*s*h + h", "floordiv(b*s + 3, 4)"]


@pytest.mark.parametrize("expr", EXPRS)
def test_dimexpr_converts_exactly(expr):
  (dim,) = export.symbolic_shape(expr)
  assert jax_dims.is_symbolic(dim)
  p = jax_dims.to_poly(dim)
  for b, s, h in itertools.product((1, 2, 7, 64), (1, 3, 4096), (1, 5)):
    env = {"b": b, "s": s, "h": h}
    # JAX's own evaluation overflows int32 for big sizes (DESIGN.md F9): compare in small range.
    expected = eval(expr.replace("^", "**").replace("floordiv", "_fd").replace("mod", "_md"),
                    {"_fd": lambda x, y: x // y, "_md": lambda x, y: x % y, "max": max, "min": min},
                    env)
    assert p.evaluate(env) == expected


def test_private_layout_is_what_we_read():
  # If this fails, JAX changed _DimExpr's internals: update jax_dims.py and the pinned range.
  (dim,) = export.symbolic_shape("3*b*floordiv(s, 2) + 1")
  terms = dim._sorted_terms
  assert all(isinstance(c, int) for _, c in terms)
  factors = [f for t, _ in terms for f, _ in t._factors]
  assert {f.var for f in factors} >= {"b"}
  assert any(f.operation == "floordiv" for f in factors)


def test_a_dims_scope_constraints_are_read():
  # symbolic.compare takes a JAX dim's scope constraints along (test_compare.py): read here.
  k, s = export.symbolic_shape("k, s", constraints=("k >= 10", "s <= 64"))
  assert jax_dims.scope_constraints(k) == ("k >= 10", "s <= 64")
  assert jax_dims.scope_constraints(3 * k + 1) == ("k >= 10", "s <= 64")
  assert jax_dims.scope_constraints(export.symbolic_shape("b")[0]) == ()
  assert jax_dims.scope_constraints(5) == jax_dims.scope_constraints("k") == ()


def test_operation_atoms_and_strings():
  p = jax_dims.parse("floordiv(s, 2)")
  (atom,) = p.atoms()
  assert isinstance(atom, OpAtom) and atom.op == "floordiv"
  assert jax_dims.to_poly(5) == Poly.const(5)
  assert jax_dims.to_poly("b*s") == Poly.var("b") * Poly.var("s")
  with pytest.raises(ValueError, match="cannot parse"):
    jax_dims.parse("b +* s")
  with pytest.raises(ValueError, match="one dimension"):
    jax_dims.parse("b, s")


def test_jax_version_is_in_the_tested_range():
  pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
  lo, hi = re.search(r'"jax>=([0-9.]+),<([0-9.]+)"', pyproject).groups()
  version = lambda text: tuple(int(x) for x in text.split("."))
  assert version(lo) <= jax.__version_info__ < version(hi), (
      f"jax_symmem is tested with jax >= {lo}, < {hi} (pyproject.toml), not {jax.__version__}")
