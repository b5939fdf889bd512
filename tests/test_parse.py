"""The fast polynomial parser against jax.export's own parser.

For every string, `jax_dims.parse` (fast parser, deferring to jax.export) must
give what `jax_dims.parse_with_jax` (jax.export alone) gives: the same Poly, or
an exception of the same type with the same message. The corpus: random
polynomials printed in several syntaxes, random strings over the grammar's
alphabet (mostly malformed), and strings that must defer.
"""

import re

import hypothesis
import pytest
from hypothesis import strategies as st

from jax_symmem import symbolic
from jax_symmem._src import compare as compare_lib
from jax_symmem._src import jax_dims
from jax_symmem._src import parse as parse_lib
from jax_symmem._src.parse import parse_operation, parse_polynomial
from jax_symmem._src.poly import Poly
from tests.tiers import own_database_key

_SETTINGS = hypothesis.settings(max_examples=300, deadline=None, derandomize=True,
                                suppress_health_check=[hypothesis.HealthCheck.too_slow])


def _outcome(fn, expr):
  try:
    return ("ok", fn(expr))
  except Exception as e:  # noqa: BLE001 - the point is to compare whatever is raised
    return ("raised", type(e), str(e))


def assert_same_as_jax(expr: str) -> None:
  assert _outcome(jax_dims.parse, expr) == _outcome(jax_dims.parse_with_jax, expr), expr


# --------------------------------------------------------------------------
# Random polynomials, printed several ways
# --------------------------------------------------------------------------
NAMES = ["b", "s", "h", "k", "seq_len", "B2", "_x", "x_1", "if", "MAX", "floordiv_"]

coeffs = st.one_of(st.integers(-20, 20), st.sampled_from([11008, 4096, 2**40, -(2**70), 10**30]))
factors = st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 4)), max_size=3)
terms = st.lists(st.tuples(coeffs, factors), min_size=1, max_size=4)


def _print_term(coeff, fs, style, first):
  """One term in one of several spellings jax.export accepts (sign included)."""
  parts = []
  for name, e in fs:
    if style == "repeat" and 0 < e <= 3:
      parts += [name] * e
    elif e == 1 and style != "caret1":
      parts.append(name)
    else:
      parts.append(f"{name} ^ {e}" if style == "spaced" else f"{name}^{e}")
  mag = abs(coeff)
  if style == "neg_literal" and coeff < 0:
    body = "*".join(parts + [f"-{mag}"])    # b*-3: a negative literal as the last factor
    return body if first else f"+ {body}"
  if style == "coeff_last":
    body = "*".join(parts + [str(mag)])
  elif style == "power_coeff" and mag in (4096, 2**40):
    body = "*".join([f"2^{mag.bit_length() - 1}"] + parts)
  else:
    body = "*".join([str(mag)] + parts) if (mag != 1 or not parts) else "*".join(parts)
  if coeff < 0:
    return f"-{body}" if first else f"- {body}"
  return body if first else f"+ {body}"


@st.composite
def printed_polys(draw):
  ts = draw(terms)
  style = draw(st.sampled_from(["plain", "repeat", "caret1", "spaced", "neg_literal",
                                "coeff_last", "power_coeff"]))
  text = " ".join(_print_term(c, fs, style, i == 0) for i, (c, fs) in enumerate(ts))
  if draw(st.booleans()):
    text = text.replace(" ", "")
  if draw(st.booleans()):
    text = "  " + text + " "
  expected = Poly.const(0)
  for c, fs in ts:
    t = Poly.const(c)
    for name, e in fs:
      t = t * Poly.var(name) ** e
    expected = expected + t
  return text, expected


@_SETTINGS
@hypothesis.given(printed_polys())
def test_printed_polynomials_parse_fast_and_match_jax(case):
  text, expected = case
  fast = parse_polynomial(text)
  assert fast == expected, text
  assert jax_dims.parse_with_jax(text) == expected, text


@_SETTINGS
@hypothesis.given(printed_polys())
def test_str_of_a_poly_round_trips(case):
  _, p = case
  assert parse_polynomial(str(p)) == p == jax_dims.parse_with_jax(str(p))


# --------------------------------------------------------------------------
# Polynomials over operation calls: each call through jax.export on its own
# --------------------------------------------------------------------------
@st.composite
def operation_calls(draw, depth=2):
  op = draw(st.sampled_from(["floordiv", "mod", "max", "min"]))
  first = draw(printed_polys())[0].strip()
  if depth and draw(st.booleans()):
    first = draw(operation_calls(depth=depth - 1))
  if op in ("floordiv", "mod"):
    second = str(draw(st.sampled_from([1, 2, 3, 8, 128, 0, -4])))
  else:
    second = draw(st.one_of(st.sampled_from(["1", "0", "b", "s"]), printed_polys().map(lambda c: c[0])))
  call = f"{op}({first},{draw(st.sampled_from(['', ' ']))}{second})"
  return call + draw(st.sampled_from(["", "", "^2", " ^ 0"]))


@st.composite
def polynomials_with_calls(draw):
  terms = []
  for _ in range(draw(st.integers(1, 3))):
    factors = draw(st.lists(st.one_of(st.sampled_from(["b", "s^2", "4", "11008"]), operation_calls()),
                            min_size=1, max_size=3))
    terms.append("*".join(factors))
  signs = draw(st.lists(st.sampled_from([" + ", " - ", "-", "+"]), min_size=len(terms),
                        max_size=len(terms)))
  lead = draw(st.sampled_from(["", "-", " "]))
  return lead + terms[0] + "".join(s + t for s, t in zip(signs[1:], terms[1:]))


def _calls_property(max_examples):
  @hypothesis.settings(_SETTINGS, max_examples=max_examples)
  @hypothesis.given(polynomials_with_calls())
  def test(text):
    assert_same_as_jax(text)
  own_database_key(test, max_examples)
  return test


# Each string is also parsed by jax.export (~25 ms): 40 in the fast tier, 150 in the slow.
test_polynomials_over_operation_calls_match_jax = _calls_property(40)
test_polynomials_over_operation_calls_match_jax_many = pytest.mark.slow(_calls_property(150))


@pytest.mark.parametrize("text", [
    "4*b*floordiv(s, 2)", "-floordiv(s,2)^2 + mod(b*s, 8)*max(b, floordiv(s, 4))", "max(b, 1)",
    "min(b,b)*3", "floordiv(s, 0)", "floordiv(s, 2", "floordiv(s,2)b", "b*-floordiv(s,2)",
    "floordiv(s,2) 2", "2floordiv(s, 2)", "b_max(s, 2)", "floordiv (s, 2)*b", "(floordiv(s, 2))",
    "floordiv(s, 2), b", "mod(b, 3)^0*s", "__jax_symmem_op0 + floordiv(s, 2)", "max(b, s) - max(s, b)",
])
def test_operation_calls_get_jax_answer(text):
  assert_same_as_jax(text)


def test_operation_call_is_parsed_alone(monkeypatch):
  # The speed of strings with operations: jax.export sees one call, not the whole
  # string, and only a call the fast route cannot read (max of a non-variable).
  seen = []
  real = jax_dims.export.symbolic_shape
  monkeypatch.setattr(jax_dims.export, "symbolic_shape", lambda e, **kw: seen.append(e) or real(e, **kw))
  text = "8*b*s^2 + 4*b*floordiv(s, 2) - 3*max(s, 2*b)"
  p = jax_dims.parse(text)
  assert seen == ["max(s, 2*b)"]
  assert p == jax_dims.parse_with_jax(text)


# Calls over plain operands: `parse.parse_operation` reads them without jax.export
# (floordiv/mod always; max/min for two integers, a variable against an integer
# >= 2 or against a variable) and must give jax.export's Poly, or defer.
PLAIN_OPERANDS = ["b", "s", " s ", "1*s", "s^1", "0", "1", "2", "-3", "128", "2*b", "b*s",
                  "s + 1", "-s", "4*b - 4", "b^0"]


@st.composite
def plain_calls(draw):
  op = draw(st.sampled_from(["floordiv", "mod", "max", "min"]))
  a, b_ = draw(st.sampled_from(PLAIN_OPERANDS)), draw(st.sampled_from(PLAIN_OPERANDS))
  return f"{op}{draw(st.sampled_from(['', ' ']))}({a},{draw(st.sampled_from(['', ' ']))}{b_})"


@_SETTINGS
@hypothesis.given(plain_calls(), st.sampled_from(["{}", "4*b*{}", "{}^2 - s", "b*s + {}*{}"]))
def test_plain_operation_calls_match_jax(call, template):
  assert _outcome(jax_dims._parse_call, call) == _outcome(jax_dims.parse_with_jax, call), call
  assert_same_as_jax(template.format(call, call))


@pytest.mark.parametrize("call,fast", [
    ("floordiv(s, 2)", True), ("mod(b*s, 8)", True), ("floordiv(4*b + 2, b)", True),
    ("max(s, 128)", True), ("min(4096, s)", True), ("max(b, s)", True), ("max(2, 3)", True),
    ("floordiv(s, 0)", False), ("max(s, 1)", False), ("min(s, -3)", False), ("max(s, 2*b)", False),
    ("max(b*s, 8)", False), ("floordiv(floordiv(s, 2), 2)", False), ("floordiv(s)", False),
])
def test_which_calls_take_the_fast_route(call, fast):
  assert (parse_operation(call) is not None) == fast
  assert _outcome(jax_dims._parse_call, call) == _outcome(jax_dims.parse_with_jax, call)


# --------------------------------------------------------------------------
# Random strings over the grammar's alphabet: mostly malformed
# --------------------------------------------------------------------------
TOKENS = ["b", "s", "k2", "_", "mod", "max", "floordiv", "min", "0", "1", "2", "07", "12", "1_0",
          "0x1", "1.5", "3j", "*", "**", "^", "+", "-", "(", ")", ",", " ", "  ", "\t", "\n", "...",
          "#", "é", "="]


@_SETTINGS
@hypothesis.given(st.lists(st.sampled_from(TOKENS), max_size=9).map("".join))
def test_random_strings_agree_with_jax(text):
  assert_same_as_jax(text)


@_SETTINGS
@hypothesis.given(st.text(alphabet="bs2^*+- ()_,", max_size=12))
def test_random_characters_agree_with_jax(text):
  assert_same_as_jax(text)


# --------------------------------------------------------------------------
# Fixed cases
# --------------------------------------------------------------------------
# (string, Poly): the corners of jax.export's grammar the fast parser reproduces.
b, s = Poly.var("b"), Poly.var("s")
ACCEPTED = [
    ("4*b*s^2 + 8*b*s", 4 * b * s * s + 8 * b * s),
    ("-2^2", Poly.const(-4)),           # a leading minus negates the term
    ("b*-2^2", 4 * b),                  # a negative literal is one factor: (-2)^2
    ("b - -2^3", b + 8),
    ("--2", Poly.const(2)),
    ("+ -3*b", -3 * b),
    ("b^0", Poly.const(1)),
    ("0*b + s - s", Poly.const(0)),
    ("2^3*b*3", 24 * b),
    (" b  +  s ", b + s),
    ("b*b*s^2*b^0*s", b * b * s * s * s),
]
# Strings the fast parser hands to jax.export (which accepts some of them, rejects others).
DEFERRED = [
    "floordiv(s, 2)", "mod(b, 3)", "max(b, s)", "min(b, 2*s)", "4*floordiv(b*s, 128) + 1",
    "(b + s)", "(b)", "2*(b + s)", "b**2", "b ** 2", "b, s", "", " ", "_", "...", "1_000*b", "0x10",
    "007", "1.5*b", "2b", "b^-1", "b^2^3", "b^ s", "s\n+ 1", "\tb", "é*b", "b +", "* b", "-b*-c",
    "b * - s", "++b", "-+2", "b 2", "b # comment", "max", "mod*b", "b^02", "b^1_0",
]


@pytest.mark.parametrize("text,expected", ACCEPTED)
def test_grammar_corners(text, expected):
  assert parse_polynomial(text) == expected
  assert jax_dims.parse_with_jax(text) == expected
  assert jax_dims.parse(text) == expected


@pytest.mark.parametrize("text", DEFERRED)
def test_deferred_strings_get_jax_answer(text):
  assert parse_polynomial(text) is None
  assert_same_as_jax(text)


def test_deferred_error_is_jax_error():
  with pytest.raises(ValueError, match="cannot parse dimension expression 'b \\*\\* 2'"):
    jax_dims.parse("b ** 2")
  with pytest.raises(ValueError, match="expected one dimension expression, got 2"):
    jax_dims.parse("b, s")
  with pytest.raises(TypeError):
    jax_dims.parse(3)


def test_string_compare_skips_jax_for_plain_polynomials(monkeypatch):
  # The fast path is what makes string comparisons cheap: prove jax.export is not called.
  def boom(*args, **kwargs):
    raise AssertionError("jax.export called")
  compare_lib.clear_caches()
  monkeypatch.setattr(jax_dims.export, "symbolic_shape", boom)
  o = symbolic.compare("11008*b*s", "32*b*s^2", constraints=("s <= 4096", "b <= 64"))
  assert o.kind == "DEPENDS" and o.breakpoints == (344, 345)
  o = symbolic.compare("b*s", "128*k", constraints=("s == 128*k", "b >= 1"))
  assert o.kind == "GE"
  o = symbolic.compare("4*b*floordiv(s, 2)", "b*max(s, 128)")   # calls over plain operands, too
  assert o.kind == "DEPENDS"
  with pytest.raises(ValueError, match="jax.export called"):   # other operations still go to jax.export
    symbolic.compare("max(s, 2*b)", "s")
  compare_lib.clear_caches()


def _possessive_property(max_examples):
  @hypothesis.settings(_SETTINGS, max_examples=max_examples)
  @hypothesis.given(st.one_of(st.text(alphabet="bs0127_ +-*^", max_size=16),
                              st.lists(st.sampled_from(["b", "s", "k2", "0", "07", "12", " ", "+",
                                                        "-", "*", "^", "^2", " ^ 3", "x_"]),
                                       max_size=10).map("".join)))
  def test(text):
    # The fast path's check uses possessive quantifiers (Python 3.11): the same language.
    backtracking = re.compile(parse_lib._PLAIN.pattern.replace("*+", "*").replace("?+", "?"))
    assert bool(parse_lib._PLAIN.fullmatch(text)) == bool(backtracking.fullmatch(text))
  own_database_key(test, max_examples)
  return test


# 400 derandomized strings in the fast tier, 2000 in the slow one (~2 ms each).
test_possessive_plain_regex_accepts_what_backtracking_does = _possessive_property(400)
test_possessive_plain_regex_accepts_what_backtracking_does_many = pytest.mark.slow(
    _possessive_property(2000))
