"""A fast parser for the plain-polynomial subset of jax.export's dimension syntax.

`jax.export.symbolic_shape` parses through Python's `tokenize` and builds a
`_DimExpr` that `jax_dims.to_poly` then converts: about 100 µs for a size such
as "4*b*s^2 + 8*b*s", most of what a cold `symbolic.compare` on strings cost.
This module reads the same grammar, restricted to plain polynomials, straight
into a `Poly`:

    expr   := ["+" | "-"] term (("+" | "-") term)*
    term   := power ("*" power)*
    power  := factor ["^" INT]
    factor := NAME | INT | "-" INT

with INT a run of ASCII digits without leading zeros, NAME an ASCII identifier
other than "_" and the operation names (floordiv, mod, max, min), and spaces
anywhere between tokens. These are jax.export's own rules (its factor allows a
negative integer literal, `-2^2` at the start of an expression is `-(2^2)`,
`b*-2^2` is `b*((-2)^2)`, exponents apply to one factor); jax.export has no
grouping parentheses and no `**`.

`parse_polynomial` returns None for anything outside that subset: operations,
parentheses, commas, other whitespace, other numerals ("1_000", "0x10"),
non-ASCII names, and every string jax.export would reject. The caller then
parses with jax.export, so results and error messages stay exactly jax.export's
(tests/test_parse.py checks both routes agree on a fuzzed corpus). A polynomial
over operation calls is split into its calls (`split_operations`), and a call
over plain operands whose result is known is read by `parse_operation`.
"""

from __future__ import annotations

import re

from jax_symmem._src import poly as poly_lib
from jax_symmem._src.poly import Poly, Var

_ALLOWED = re.compile(r"[A-Za-z0-9_ +\-*^]+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[-+*^]")
# Names jax.export reads as operations (or as the "_" placeholder) rather than variables.
RESERVED = frozenset(("_", "floordiv", "mod", "max", "min"))

_vars: dict[str, Var] = {}


def _var(name: str) -> Var:
  v = _vars.get(name)
  if v is None:
    if len(_vars) > 4096:
      _vars.clear()
    v = _vars[name] = Var(name)
  return v


class _Defer(Exception):
  """The string is outside the fast subset: let jax.export parse it."""


def _int(tok: str) -> int:
  if not tok.isdigit() or (tok[0] == "0" and len(tok) > 1):
    raise _Defer
  return int(tok)


def parse_polynomial(expr: str) -> Poly | None:
  """The Poly jax.export would give for `expr`, or None to defer to jax.export."""
  if expr.isdigit() and expr.isascii() and (expr[0] != "0" or len(expr) == 1):
    return Poly.const(int(expr))   # the common constraint sides: "4096", "s"
  if _NAME.fullmatch(expr) and expr not in RESERVED:
    return Poly(((((_var(expr), 1),), 1),))
  if _PLAIN.fullmatch(expr):
    terms = _plain_terms(expr)
  else:
    if not _ALLOWED.fullmatch(expr):
      return None
    toks = _TOKEN.findall(expr)
    if not toks or sum(map(len, toks)) != len(expr) - expr.count(" "):
      return None
    try:
      terms = _expression(toks)
    except (_Defer, IndexError):
      return None
  if terms is None:
    return None
  return _canonical(terms)


def _canonical(terms: dict[tuple[tuple[str, int], ...], int]) -> Poly:
  """The Poly of {((name, exponent), ... sorted by name): coeff}, in canonical order.

  The order of `Poly.from_dict` (poly._mono_key): every atom is a variable,
  whose sort key is (0, name), so names order the same way. Keys are distinct
  per monomial, so sorting the rows never compares past them.
  """
  rows = []
  for mono, c in terms.items():
    if c:
      degree = 0
      key = []
      for name, e in mono:
        degree += e
        key.append((name, -e))
      rows.append(((-degree, tuple(key)), mono, c))
  rows.sort()
  return Poly(tuple([(tuple([(_var(n), e) for n, e in mono]), c) for _, mono, c in rows]))


# The common case, checked by one regex: signs only between terms (and one in
# front), no negative literals. Spaces only around operators, so dropping them
# joins no tokens. Quantifiers are possessive (Python >= 3.11): no token can give
# characters back to the next one, so backtracking only wastes time.
_P = "+"
_FACTOR = rf"(?:[A-Za-z_][A-Za-z0-9_]*{_P}|[1-9][0-9]*{_P}|0)(?: *{_P}\^ *{_P}(?:[1-9][0-9]*{_P}|0))?{_P}"
_TERM = rf"{_FACTOR}(?: *{_P}\* *{_P}{_FACTOR})*{_P}"
_PLAIN = re.compile(rf" *{_P}[-+]?{_P} *{_P}{_TERM}(?: *{_P}[-+] *{_P}{_TERM})*{_P} *{_P}")


def _plain_terms(expr: str) -> dict[tuple[tuple[str, int], ...], int] | None:
  """`_expression` for a string `_PLAIN` matched (None if it names an operation).

  There every sign separates terms (or leads the first), so string splits find them.
  """
  out: dict[tuple[tuple[str, int], ...], int] = {}
  for body in expr.replace(" ", "").replace("-", "+-").split("+"):
    if not body:
      continue
    sign = body[0]
    if sign == "-":
      body = body[1:]
    coeff = 1
    exps: dict[str, int] = {}
    for factor in body.split("*"):
      base, _, power = factor.partition("^")
      k = int(power) if power else 1
      if base[0] <= "9":   # digits sort before letters and "_"
        coeff *= int(base) ** k
      elif base in RESERVED:
        return None
      elif k:
        exps[base] = exps.get(base, 0) + k
    mono = tuple(sorted(exps.items())) if len(exps) > 1 else tuple(exps.items())
    out[mono] = out.get(mono, 0) + (-coeff if sign == "-" else coeff)
  return out


def _expression(toks: list[str]) -> dict[tuple[tuple[str, int], ...], int]:
  """Sum of terms as {((name, exponent), ... sorted by name): coefficient}."""
  n = len(toks)
  i = 0
  negate = toks[0] == "-"
  if toks[0] in "+-":
    i = 1
  out: dict[tuple[tuple[str, int], ...], int] = {}
  while True:
    coeff = 1
    exps: dict[str, int] = {}
    while True:   # one term: factors joined by "*"
      tok = toks[i]
      if tok == "-":   # a negative integer literal
        i += 1
        value = -_int(toks[i])
        name = None
      elif tok[0].isdigit():
        value, name = _int(tok), None
      elif tok[0].isalpha() or tok[0] == "_":
        if tok in RESERVED:
          raise _Defer
        value, name = None, tok
      else:
        raise _Defer
      i += 1
      power = 1
      if i < n and toks[i] == "^":
        power = _int(toks[i + 1])
        i += 2
      if name is None:
        coeff *= value ** power
      elif power:
        exps[name] = exps.get(name, 0) + power
      if i == n or toks[i] in "+-":
        break
      if toks[i] != "*":
        raise _Defer
      i += 1
    mono = tuple(sorted(exps.items()))
    out[mono] = out.get(mono, 0) + (-coeff if negate else coeff)
    if i == n:
      return out
    negate = toks[i] == "-"
    i += 1
    if i == n:
      raise _Defer


# --------------------------------------------------------------------------
# Strings with operations: each operation call is parsed on its own
# --------------------------------------------------------------------------
# jax.export parses the whole of "8*b*s + 4*b*floordiv(s, 2)" in ~300 µs, most of
# it tokenizing; the call "floordiv(s, 2)" alone takes a sixth of that (and
# `parse_operation` below reads such a call without jax.export). Without
# constraints, jax.export's `+` and `*` on symbolic dims are plain polynomial
# arithmetic (its only rewrites are a scope's equality constraints, and
# `symbolic_shape(expr)` has none), so the Poly of the whole string is the
# template's Poly with each call's Poly put in for its placeholder.
_OP_CALL = re.compile(r"(?<![A-Za-z0-9_])(?:floordiv|mod|max|min) *\(")
PLACEHOLDER = "__jax_symmem_op"


def split_operations(expr: str) -> tuple[str, dict[str, str]] | None:
  """("template", {placeholder: "op(...)"}) for the top-level operation calls, or None.

  Each call is replaced by a placeholder name with a space on either side, so
  that the template parses only where the call stood as a factor of its own.
  """
  if PLACEHOLDER in expr:
    return None
  parts, calls, pos = [], {}, 0
  while m := _OP_CALL.search(expr, pos):
    depth, i = 1, m.end()
    while depth:
      if i == len(expr):
        return None
      depth += (expr[i] == "(") - (expr[i] == ")")
      i += 1
    name = f"{PLACEHOLDER}{len(calls)}"
    parts += [expr[pos:m.start()], f" {name} "]
    calls[name] = expr[m.start():i]
    pos = i
  if not calls:
    return None
  parts.append(expr[pos:])
  return "".join(parts), calls


# --------------------------------------------------------------------------
# One operation call over plain operands, without jax.export
# --------------------------------------------------------------------------
# Even one call costs jax.export ~50-100 µs (tokenizing, building _DimExprs).
# What its parser builds for "op(A, B)" is known exactly when A and B are plain:
#
# * floordiv / mod: the factor op(A, B) as written (`_DimExpr._from_operation`,
#   no simplification), which `jax_dims.to_poly` turns into
#   `poly._operation(op, A, B)`;
# * max / min: `core.max_dim` / `core.min_dim`, which return one operand when
#   JAX's bounds decide the sign of A - B. Only operands whose decision is
#   plain are read here: two integers (Python's max/min), or a single variable
#   v (JAX's bounds: [1, inf)) against an integer k or another variable w.
#   v - k >= 0 for every v exactly when k <= 1; v - w is bounded on neither
#   side unless w is v. Any other pair (2*b, b*s, ...) goes to jax.export.
#
# tests/test_parse.py checks this route against jax.export on a fuzzed corpus.
_CALL = re.compile(r"(floordiv|mod|max|min) *\(([^(),]*),([^(),]*)\)")


def parse_operation(call: str) -> Poly | None:
  """The Poly jax.export's route gives for one call "op(A, B)", or None to defer to it."""
  m = _CALL.fullmatch(call)
  if m is None:
    return None
  op = m.group(1)
  # Spaces around an operand change nothing; without them "2" and "s" take the shortest route.
  a, b = parse_polynomial(m.group(2).strip(" ")), parse_polynomial(m.group(3).strip(" "))
  if a is None or b is None:
    return None
  if op in (poly_lib.MAX, poly_lib.MIN) and not _max_min_is_plain(a, b):
    return None
  try:
    return poly_lib._operation(op, a, b)
  except ZeroDivisionError:   # jax.export's route raises it: let that route say so
    return None


def _max_min_is_plain(a: Poly, b: Poly) -> bool:
  """Whether JAX decides max/min(a, b) as `poly._operation` does (see above)."""
  if a.is_constant() and b.is_constant():
    return True
  va, vb = _single_var(a), _single_var(b)
  if va is not None and vb is not None:
    return True   # the same var: JAX and _operation return it; two vars: the atom
  k = b.constant if va is not None else a.constant
  constant = b.is_constant() if va is not None else (vb is not None and a.is_constant())
  # k <= 1: JAX returns one operand (the var for max, k for min), which
  # `_operation` does not know; k >= 2: both keep the atom, operands in order.
  return constant and k >= 2


def _single_var(p: Poly) -> Var | None:
  if len(p.terms) == 1 and p.terms[0][1] == 1 and len(p.terms[0][0]) == 1:
    (atom, e), = p.terms[0][0]
    if e == 1 and isinstance(atom, Var):
      return atom
  return None
