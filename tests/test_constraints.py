"""Constraint normalization: bounds, substitutions, general inequalities, contradictions."""

import itertools
import random

import pytest

from jax_symmem._src import constraints as constraints_lib
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


# --------------------------------------------------------------------------
# The normalization cache (keyed by the constraint strings)
# --------------------------------------------------------------------------


def test_normalization_is_cached_by_the_strings_and_variables_only_add_bounds():
  constraints_lib.normalize.cache_clear()
  src = ("s == 128*k", "s <= 4096", "b*k <= 64")
  base = parse_constraints(src)
  assert parse_constraints(list(src)) is base   # same strings: the cached object
  wide = parse_constraints(src, ["b", "s", "t", "k"])
  assert wide.bounds_map == {**base.bounds_map, "t": (1, None)}
  assert "s" not in wide.bounds_map             # eliminated stays eliminated
  assert (wide.substitutions, wide.inequalities, wide.source) == (
      base.substitutions, base.inequalities, base.source)
  assert base.bounds_map == {"b": (1, None), "k": (1, 32)}   # the cached object is unchanged
  assert constraints_lib.normalize.cache_info().hits >= 2


def test_different_strings_never_share_a_normalization():
  a = parse_constraints(("s <= 4096",), ["s"])
  b = parse_constraints(("s <= 4095",), ["s"])
  c = parse_constraints(("s < 4096",), ["s"])
  assert a.bounds_map["s"] == (1, 4096) and b.bounds_map["s"] == (1, 4095)
  assert c.bounds_map["s"] == (1, 4095) and c.source != b.source
  assert len({a, b, c}) == 3


def test_eliminated_dimension_keeps_its_lower_bound():
  # s >= 1 is not a no-op once s is eliminated: s == k - 5 forces k >= 6.
  c = parse_constraints(("s == k - 5",), ["s", "k"])
  assert c.bounds_map == {"k": (6, None)}
  c = parse_constraints(("s == b*k - 3",), ["b", "k", "s"])
  assert c.inequalities and c.violation({"b": 1, "k": 3, "s": 0}) is not None


def test_errors_are_raised_every_time():
  for _ in range(2):
    with pytest.raises(ConstraintError, match="contradict"):
      parse_constraints(("s >= 10", "s <= 5"), ["s"])


_MIRROR = {"<=": ">=", ">=": "<=", "<": ">", ">": "<"}


@pytest.mark.parametrize("rel", ["<=", ">=", "<", ">"])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 4096])
@pytest.mark.parametrize("eliminated", [False, True])
def test_plain_bounds_match_the_algebra(rel, n, eliminated):
  # "s <= 4096" takes a shortcut (no parsing, no polynomial algebra); the same relation
  # written so that it needs the parser and the algebra must normalize identically.
  extra = ("s == 4*k",) if eliminated else ()
  routes = [(f"s {rel} {n}",), (f" s{rel}{n} ",), (f"s {rel} {n} + 0",), (f"{n} {_MIRROR[rel]} s",),
            (f"s - {n} {rel} 0",), (f"2*s {rel} 2*{n}",)]
  results = []
  for route in routes:
    try:
      c = parse_constraints(extra + route, ["s"])
      results.append((c.bounds, c.substitutions, c.inequalities))
    except ConstraintError as e:
      results.append(str(e).split(":")[0][:20])   # which kind of contradiction
  assert all(r == results[0] for r in results), (rel, n, eliminated, results)


@pytest.mark.parametrize("before", [(), ("h == 2*b",), ("k == 3*b",), ("s <= 4096",)])
@pytest.mark.parametrize("after", [(), ("s <= 4096",), ("k >= 2", "s < 1000"), ("b*k <= 64",)])
def test_declared_multiple_matches_the_algebra(before, after):
  # "s == 128*k" takes a shortcut when it is the first equality; spelled so that it
  # needs the parser and the algebra, it must normalize identically.
  results = []
  for eq in ("s == 128*k", " s==128 * k ", "s == 128*k + 0", "s == k*128"):
    try:
      c = parse_constraints(before + (eq,) + after, ["b", "s"])
      results.append((c.bounds, c.substitutions, c.inequalities))
    except ConstraintError as e:
      results.append(str(e).split(":")[0][:20])
  assert all(r == results[0] for r in results), results


def test_shortcut_matches_the_general_route():
  # Bounds 'var REL int' and one declared multiple 'v == n*w' normalize without the
  # general route's bookkeeping; written with '+ 0' each takes the parser and the
  # algebra, and must normalize identically (contradictions included).
  rng = random.Random(0)
  for _ in range(600):
    source = [f"{rng.choice('bsk')} {rng.choice(['<=', '>=', '<', '>'])} {rng.choice([0, 1, 2, 5, 64, 4096])}"
              for _ in range(rng.randint(0, 4))]
    if rng.random() < 0.5:
      v, w = rng.sample("bsk", 2)
      source.insert(rng.randint(0, len(source)), f"{v} == {rng.choice([1, 2, 128])}*{w}")
    source = tuple(source)
    results = []
    for src in (source, tuple(c + " + 0" for c in source)):
      constraints_lib.normalize.cache_clear()
      try:
        c = constraints_lib.normalize(src)
        results.append((c.bounds, c.substitutions, c.inequalities))
      except ConstraintError as e:
        results.append(str(e).replace(" + 0", ""))   # the message quotes the strings
    assert results[0] == results[1], source
    if not isinstance(results[0], str):
      assert constraints_lib._shortcut(source) == constraints_lib.normalize(source)


def test_a_bound_that_comes_through_a_multiple_names_its_constraint():
  # h == 8*k and h <= 128 bound k to [1, 16]: the message for k = 17 cites both.
  c = parse_constraints(("h <= 128", "h == 8*k"), variables=("k",))
  msg = c.violation({"k": 17})
  assert "k = 17 is outside [1, 16]" in msg and "h <= 128" in msg and "h == 8*k" in msg


def test_cut_corners_are_the_largest_points_a_general_inequality_allows():
  c = parse_constraints(("b <= 64", "s <= 256", "s >= 2", "b*s <= 2048"), ["b", "s"])
  assert c.cut_corners() == [{"b": 64, "s": 32}, {"b": 8, "s": 256}]
  # Through a declared multiple: the corners are in the free dims (s == 128*k: k).
  c = parse_constraints(("s == 128*k", "b <= 16", "s <= 1024", "b*s <= 4096"), ["b", "s"])
  assert [c.complete(p) for p in c.cut_corners()] == [{"b": 16, "k": 2, "s": 256},
                                                       {"b": 4, "k": 8, "s": 1024}]
  # Nothing cut off: the box's corner is allowed.
  assert parse_constraints(("b <= 8", "s <= 64", "b*s <= 512"), ["b", "s"]).cut_corners() == []
  assert parse_constraints(("b <= 8", "s <= 64"), ["b", "s"]).cut_corners() == []


@pytest.mark.parametrize("seed", range(40))
def test_cut_corners_match_brute_force_on_downward_closed_constraints(seed):
  # Inequalities whose allowed set is closed downwards (a point below an allowed one is
  # allowed): each corner is the lexicographically largest allowed point, its dim first,
  # the others in their order after it (so no dim can grow at a corner).
  rng = random.Random(seed)
  his = {v: rng.randint(2, 12) for v in "abc"}
  terms = [rng.choice(["a*b", "b*c", "a*c", "a*b*c", "a", "b", "c", "a^2"])
           for _ in range(rng.randint(1, 3))]
  total = " + ".join(f"{rng.randint(1, 3)}*{t}" for t in terms)
  limit = rng.randint(3, 200)
  c = parse_constraints((*(f"{v} <= {h}" for v, h in his.items()), f"{total} <= {limit}"),
                        list("abc"))
  box = [dict(zip("abc", p)) for p in itertools.product(*(range(1, his[v] + 1) for v in "abc"))]
  allowed = [p for p in box if c.allows(p)]
  want = []
  if allowed and not c.allows(his):
    for i in range(3):
      order = "abc"[i:] + "abc"[:i]
      best = max(allowed, key=lambda p: tuple(p[v] for v in order))
      if best not in want:
        want.append(best)
  assert c.cut_corners() == want


def test_planning_bounds_add_what_general_inequalities_imply():
  c = parse_constraints(("s <= 1024", "s >= 2", "b*s <= 8192"), ["b", "s"])
  assert c.bounds == (("b", 1, None), ("s", 2, 1024))   # what comparisons use: unchanged
  assert c.planning_bounds() == (("b", 1, 4096), ("s", 2, 1024))
  assert c.cut_corners() == [{"b": 4096, "s": 2}, {"b": 8, "s": 1024}]
  # Capped by another dim's upper bound rather than its lower one.
  c = parse_constraints(("s <= 512", "b <= s"), ["b", "s"])
  assert c.planning_bounds() == (("b", 1, 512), ("s", 1, 512))
  # Nothing caps b: it stays unbounded (planned at its lower bound).
  c = parse_constraints(("s <= 512", "b*s >= 4"), ["b", "s"])
  assert c.planning_bounds() == (("b", 1, None), ("s", 1, 512))
