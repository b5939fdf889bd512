"""Poly arithmetic and evaluation against Python integer arithmetic."""

import random

import pytest

from jax_symmem._src.poly import ONE, ZERO, Poly, product

b, s, h = Poly.var("b"), Poly.var("s"), Poly.var("h")


def _random_poly(rng, depth=2):
  if depth == 0 or rng.random() < 0.3:
    return rng.choice([b, s, h, Poly.const(rng.randint(-5, 9))])
  x, y = _random_poly(rng, depth - 1), _random_poly(rng, depth - 1)
  op = rng.choice(["+", "-", "*", "floordiv", "mod", "max", "min"])
  if op in ("floordiv", "mod"):
    return getattr(x, op)(rng.choice([2, 3, 8]))
  return {"+": x + y, "-": x - y, "*": x * y}.get(op) or getattr(x, op)(y)


def _eval_reference(p, env):
  return p.evaluate(env)


def test_arithmetic_matches_integers():
  rng = random.Random(0)
  for _ in range(300):
    p, q = _random_poly(rng), _random_poly(rng)
    for env in ({"b": 1, "s": 7, "h": 3}, {"b": 13, "s": 4096, "h": 64}):
      pv, qv = p.evaluate(env), q.evaluate(env)
      assert (p + q).evaluate(env) == pv + qv
      assert (p - q).evaluate(env) == pv - qv
      assert (p * q).evaluate(env) == pv * qv
      assert p.floordiv(3).evaluate(env) == pv // 3
      assert p.mod(8).evaluate(env) == pv % 8
      assert p.max(q).evaluate(env) == max(pv, qv)
      assert p.min(q).evaluate(env) == min(pv, qv)


def test_canonical_form_makes_equal_polys_equal():
  assert (b + s) * (b - s) == b * b - s * s
  assert hash((b + s) ** 2) == hash(b * b + 2 * b * s + s * s)
  assert (b - b) == ZERO and (b * 0 + 1) == ONE
  assert product([b, s, 4]) == 4 * b * s


def test_no_overflow_for_realistic_byte_sizes():
  p = 4 * b * s * s * 32 * 11008
  assert p.evaluate({"b": 64, "s": 4096}) == 4 * 64 * 4096 * 4096 * 32 * 11008
  assert p.evaluate({"b": 64, "s": 4096}) > 2**40


def test_operations_fold_only_when_exact():
  assert (8 * s).floordiv(8) == s
  assert (8 * s + 16 * b).mod(8) == ZERO
  assert str((8 * s + 1).floordiv(8)) == "floordiv(8*s + 1, 8)"
  assert Poly.const(7).floordiv(-2) == Poly.const(-4)  # Python semantics
  assert s.max(s) == s
  with pytest.raises(ZeroDivisionError):
    s.mod(0)


def test_printing_and_sympy():
  p = 3 * s * s - 2 * b + 1
  assert str(p) == "3*s^2 - 2*b + 1"
  assert str(-s) == "-s"
  assert str(p.to_sympy()) == "-2*b + 3*s**2 + 1"


def test_substitute_and_queries():
  k = Poly.var("k")
  p = (s * s + b * s.floordiv(2)).substitute({next(iter(s.atoms())): 128 * k})
  assert p.variables() == {"b", "k", "s"}  # floordiv(s, 2) keeps its operand
  assert (b * s + 1).degree() == 2 and (b * s + 7).constant == 7
  with pytest.raises(KeyError, match="dimension 'b'"):
    (b + 1).evaluate({"s": 1})
  with pytest.raises(TypeError):
    Poly.lift("s")


def _substitute_reference(p, mapping):
  """Poly.substitute by multiplying out every factor (the definition)."""
  out = ZERO
  for m, c in p.terms:
    t = Poly.const(c)
    for a, e in m:
      t = t * (mapping[a] if a in mapping else Poly.atom(a)) ** e
    out = out + t
  return out


def test_substitute_matches_multiplying_out():
  # Monomial replacements (atoms, constants, 128*k) take a shortcut; all must agree
  # with the definition, including replacements that merge or cancel terms.
  rng = random.Random(4)
  k = Poly.var("k")
  for _ in range(400):
    p = _random_poly(rng, depth=3)
    atoms = sorted(p.atoms(), key=lambda a: a.sort_key)
    mapping = {}
    for a in rng.sample(atoms, rng.randint(0, len(atoms))):
      mapping[a] = rng.choice([b, s, h, k, ZERO, Poly.const(rng.randint(-3, 5)), 128 * k,
                               -2 * b * s, b + 1, s - k, _random_poly(rng, depth=1)])
    assert p.substitute(mapping) == _substitute_reference(p, mapping), (p, mapping)


def test_pickles_carry_no_cached_hash():
  # A hash cached in one process (string-hash seed) must not travel to another.
  import copy
  import pickle
  p = b * s.floordiv(2) + 3
  hash(p), p.variables(), p.atoms()
  (atom,) = [a for a in p.atoms() if not isinstance(a, type(b.terms[0][0][0][0]))]
  hash(atom)
  for q in (pickle.loads(pickle.dumps(p)), copy.copy(p), copy.deepcopy(p)):
    assert q == p and set(q.__dict__) == {"terms"} and hash(q) == hash(p)
  a2 = pickle.loads(pickle.dumps(atom))
  assert a2 == atom and set(a2.__dict__) == {"op", "operands"}
