"""What to do about a step that does not trace with symbolic dimensions.

`advice(e, ...)` reads the error JAX raised while tracing (its message, the argument
specs and the user's constraints) and says what change makes the step traceable: the
constraint that decides a comparison, the multiple a strided convolution, a split or a
blocked attention needs, the bound that makes a clamped slice exact, a static size for a
data-dependent shape, the jax.numpy way where Python or NumPy was handed a symbolic dim,
an axis to keep static where the step's own code checks a shape. `user_frame` finds the
user's line in the traceback. Messages only: nothing here changes how a step traces.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import traceback
from typing import Mapping, Sequence

import jax

from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import jax_dims
from jax_symmem._src import poly as poly_lib
from jax_symmem._src.poly import Poly, Var


_NOT_THE_STEP = (os.sep + "jax" + os.sep, os.sep + "jax_symmem" + os.sep + "_src" + os.sep,
                 os.sep + "jaxlib" + os.sep, "<frozen ")


def user_frame(tb) -> str | None:
  """The innermost frame of the user's code in a traceback (not JAX, not us)."""
  found = None
  for frame in traceback.extract_tb(tb):
    if not any(s in frame.filename for s in _NOT_THE_STEP):
      found = f"{frame.filename}:{frame.lineno} ({frame.name}): {frame.line}"
  return found


def advice(e: BaseException, args=(), specs=(), constraints: Sequence[str] = ()) -> str:
  """What to do about `e`, raised tracing a step of `args` as `specs` under `constraints`."""
  msg = str(e)
  bounds = _clamped_slices(msg)
  if bounds:
    return ("a slice of a fixed-size array (a position or causal-mask table) by a symbolic "
            "length is clamped to the array's size, min(N, s), which is not s: if your "
            "lengths never exceed the table, say so with constraints=("
            + "".join(f"'{b}', " for b in bounds).rstrip(" ") + ")")
  split = re.search(r"maps array axis \d+ \(of size ([^)]+)\) to mesh axis .*?\(of size (\d+)\), "
                    r"but \d+ does not evenly divide", msg)
  if split and not split.group(1).strip().isdigit():   # jax.shard_map over a symbolic axis
    dim, n = split.group(1).strip(), split.group(2)
    return (f"jax.shard_map splits the axis of size {dim} over {n} devices, which needs it "
            f"divisible by {n}: declare it a multiple, '{n}*k' in polymorphic_shapes (e.g. "
            f"'{n}*k, s' for a batch) or constraints=('{dim} == {n}*k',), with batches a "
            f"multiple of {n}")
  mismatch = re.search(r"incompatible shapes|same shape|different leading axis sizes", msg)
  indivisible = "Cannot divide evenly" in msg
  padded = _padded_multiples(msg) if mismatch or indivisible else []
  if padded:   # before the hints below: this is what the shapes in the message come from
    dim, n = padded[0]
    return (f"the step pads {dim} up to a multiple of {n} (mod(- {dim}, {n}) in the shapes, "
            "as blocked or chunked attention does) and JAX cannot prove what it makes of the "
            f"padded length (blocks of {n}, or a slice back to {dim}): declare the length a "
            f"multiple, constraints=('{dim} == {n}*k',), with batches padded to a multiple of "
            f"{n} (e.g. a tokenizer's pad_to_multiple_of={n})")
  remainder = re.search(r"rest is mod\(([A-Za-z_]\w*), (\d+)\)", msg)
  if remainder:   # jnp.split / array_split into n equal parts of a symbolic length
    dim, n = remainder.groups()
    return (f"splitting {dim} into {n} equal parts needs {dim} divisible by {n}, which JAX "
            f"cannot prove: declare it a multiple, constraints=('{dim} == {n}*k',) (or "
            f"polymorphic_shapes with {n}*k for {dim})")
  if mismatch:
    hint = _spec_mismatches(args, specs, msg)
    if hint:
      return hint
  if indivisible:
    return ("a reshape needs a dimension divisible by a constant: declare it as a multiple, "
            "e.g. polymorphic_shapes='b, 128*k' (or constraints=('s == 128*k',)) instead of a mod "
            "constraint, and write the reshape with the symbolic dims")
  if "associative scan over axis of non-constant size" in msg:
    return ("jax.export cannot trace lax.associative_scan over a symbolic length (plain "
            "jax.export raises the same): run the recurrence with lax.scan over that axis "
            "(it traces with a symbolic length), or keep that axis static ('_')")
  if isinstance(e, NotImplementedError):
    return ("JAX has no rule for this operation with symbolic dimensions (plain jax.export "
            "raises the same): express it with operations that have one, or keep that axis "
            "static ('_' in polymorphic_shapes)")
  if isinstance(e, RecursionError):
    return ("jax.export's decision procedure for dimension expressions recursed without end "
            "(seen with strided convolutions on a dim declared a multiple of too small a "
            "number): declare the dim a multiple of the total stride, e.g. 'h == 8*k' for three "
            "stride-2 stages, or keep that axis static ('_')")
  if isinstance(e, jax_dims.UnexpectedDimVar):
    return ("an operation of a symbolic size ran eagerly, outside the traced program: under "
            "jax.ensure_compile_time_eval() (equinox's RotaryPositionalEmbedding slices its "
            "cached sin/cos table so, table[:s]), where JAX evaluates at once and needs "
            "concrete sizes: compute it in the traced step (without compile-time "
            "evaluation), or keep that axis static ('_' in polymorphic_shapes)")
  remainder_of = _remainder_dims(msg) if "is inconclusive" in msg else []
  if remainder_of:   # a batch of b in chunks of n (lax.map's batch_size): b's remainder
    dim, n = remainder_of[0]
    fresh = next(_fresh_dims(set(jax_dims.dims_of(specs))))
    return (f"the step's shapes depend on the remainder of {dim} by {n} (a leftover chunk: "
            f"lax.map(..., batch_size={n}), or {dim} split into chunks of {n}), which JAX "
            f"cannot decide: declare {dim} a multiple of {n}, constraints=('{dim} == "
            f"{n}*{fresh}',) (or '{n}*{fresh}' for it in polymorphic_shapes), with batches a "
            f"multiple of {n}")
  if "is inconclusive" in msg:
    return ("Python control flow on a symbolic dimension cannot be traced once for all shapes; "
            f"add a constraint that decides it ({_deciding_constraints(msg)}), or use "
            "jnp.where / lax.cond on values")
  # After the control-flow case: a Python `if` on floordiv(s, 2) is that case.
  if "floordiv" in msg:
    general = ("sizes computed by floor division (strided convolutions or pooling, 'SAME' "
               "padding) that JAX cannot decide or prove equal (a stride-2 3x3 convolution gives "
               "floordiv(h - 1, 2) + 1, a 1x1 one -floordiv(-h, 2)): declare the dim a multiple "
               "of the total stride")
    multiples, replaced = _stride_multiples(msg, jax_dims.dims_of(specs), constraints)
    if multiples:
      return (f"{general}: here constraints=({', '.join(map(repr, multiples))},) (the least "
              "multiples that make the floor divisions in the message exact)"
              + (f" in place of {', '.join(map(repr, replaced))}" if replaced else "")
              + ", with batches padded to them")
    return (f"{general}, e.g. constraints=('h == 8*k',) or polymorphic_shapes "
            "'b, 8*k, 8*m, 3'")
  if isinstance(e, jax.errors.ConcretizationTypeError) and re.search(
      r"traced array with shape \w+\[\]", msg) and "size argument" not in msg:
    return ("a size computed from a symbolic dimension became an array (float arithmetic such "
            "as int(1.25 * s), math.ceil, a jnp function of a dim, or a NumPy one such as "
            "np.arange(s)): keep size arithmetic in integers on the dims, e.g. (5 * s) // 4, "
            "build arrays of a dim's size with jax.numpy (jnp.arange(s)), or pass the size as "
            "a static argument")
  if isinstance(e, jax.errors.ConcretizationTypeError):
    return ("the output shape depends on array values (e.g. nonzero, unique, boolean masks); "
            "give a static size (jnp.nonzero(x, size=...)) or use a mask of the full shape")
  if "used in a context that requires a constant" in msg:
    return ("this operation needs a size known when tracing (a permutation's length, a "
            "static argument such as a number of segments, a Python-level size): keep that "
            "axis static ('_' in polymorphic_shapes), or pass the size as a static argument")
  if re.search(r"_DimExpr|DimExpr'", msg) and _raised_by_the_step(e.__traceback__):
    return ("Python or NumPy needed a concrete number where the code passed a symbolic "
            "dimension (range(s), np.zeros(x.shape), math.sqrt(s), float(s)): write it with "
            "jax.numpy and lax on the dims (jnp.zeros(x.shape), jnp.arange(s), jnp.sqrt(s), "
            "lax.fori_loop or lax.scan for a loop over the axis), or keep that axis static "
            "('_' in polymorphic_shapes)")
  if re.search(r"_DimExpr|DimExpr'", msg) and (inside := _jax_frame(e.__traceback__)):
    return (f"JAX's own code ({inside}) needed a concrete number where the step passed a "
            "symbolic dimension: the option used needs sizes known when tracing "
            "(jax.nn.dot_product_attention's local_window_size builds its mask with "
            "range(s)); compute that part in the step with jax.numpy on the dims (a mask "
            "from jnp.arange, passed as mask=), or keep that axis static ('_' in "
            "polymorphic_shapes)")
  if _raised_by_the_step(e.__traceback__):
    return ("the step's own code (or a library it calls) raised this, not JAX: it checks a "
            "shape against a fixed size (Whisper's encoder accepts one length of features) or "
            "cannot take a symbolic one; keep that axis static ('_' in polymorphic_shapes), or "
            "add a constraint that makes the check pass for every allowed shape")
  return "see the JAX shape polymorphism guide: https://docs.jax.dev/en/latest/export/shape_poly.html"


def _remainder_dims(msg: str) -> list[tuple[str, int]]:
  """(dim, n) for each remainder of a dim by a constant in an inconclusive comparison:
  mod(b, n), or b - n*floordiv(b, n) as jax writes it (not floordiv(b, n) alone)."""
  m = re.search(r"comparison '(.+?)' (?:>=|<=|>|<) '(.+?)' is inconclusive", msg)
  try:
    terms = (jax_dims.parse(m.group(1)) - jax_dims.parse(m.group(2))).as_dict() if m else {}
  except Exception:   # noqa: BLE001 - not an expression this module reads
    return []
  found = set()
  for mono, c in terms.items():
    if len(mono) != 1 or mono[0][1] != 1 or not isinstance(mono[0][0], poly_lib.OpAtom):
      continue
    atom = mono[0][0]
    if atom.op not in (poly_lib.FLOORDIV, poly_lib.MOD):
      continue
    v, n = atom.operands
    if len(v.variables()) != 1 or not n.is_constant() or n.constant < 2:
      continue
    (name,) = v.variables()
    if v == Poly.var(name) and (atom.op == poly_lib.MOD
                                or terms.get(((Var(name), 1),), 0) * -n.constant == c):
      found.add((name, n.constant))
  return sorted(found)


def _fresh_dims(taken: set[str]):
  """New dim names for advice (k, m, j, k1, m1, ...), none of `taken`; adds each to it."""
  for i in itertools.count():
    for stem in ("k", "m", "j"):
      if (name := f"{stem}{i or ''}") not in taken:
        taken.add(name)
        yield name


def _jax_frame(tb) -> str | None:
  """`path:line (function)` of the innermost frame where that frame is JAX's own code
  (not the step's, nor another library's); None otherwise."""
  frames = traceback.extract_tb(tb)
  jax_dir = os.sep + "jax" + os.sep
  if not frames or jax_dir not in frames[-1].filename:
    return None
  f = frames[-1]
  return f"jax{os.sep}{f.filename.rsplit(jax_dir, 1)[-1]}:{f.lineno} ({f.name})"


def _raised_by_the_step(tb) -> bool:
  """Whether the innermost frame of a traceback is outside JAX, jaxlib and jax_symmem."""
  frames = traceback.extract_tb(tb)
  return bool(frames) and not any(s in frames[-1].filename for s in _NOT_THE_STEP)


def _floordiv_calls(msg: str) -> list[Poly]:
  """Each outermost floordiv(...) call of an error message, parsed ([] where one does not
  parse: the message is then not of the form this module reads)."""
  calls, opened, start = [], [], None   # opened: for each open parenthesis, floordiv's?
  for m in re.finditer(r"floordiv\(|\(|\)", msg):
    if m.group() != ")":
      if m.group() == "floordiv(" and True not in opened:
        start = m.start()
      opened.append(m.group() == "floordiv(")
    elif opened and opened.pop() and True not in opened:
      calls.append(msg[start:m.end()])
  try:
    return [jax_dims.parse(c) for c in dict.fromkeys(calls)]
  except Exception:  # noqa: BLE001 - an expression of another form
    return []


def _divisor_products(polys: Sequence[Poly]) -> dict[str, int]:
  """For each dim inside floordiv(..., c) atoms of `polys`: the least common multiple, over
  its occurrences, of the product of the constant divisors c > 1 around it."""
  found: dict[str, int] = {}

  def walk(p: Poly, product: int) -> None:
    for mono, _ in p.terms:
      for a, _ in mono:
        if isinstance(a, Var):
          found[a.name] = math.lcm(found.get(a.name, 1), product)
        elif a.op != poly_lib.FLOORDIV:
          for operand in a.operands:
            walk(operand, product)
        elif a.operands[1].is_constant() and a.operands[1].constant > 1:
          walk(a.operands[0], product * a.operands[1].constant)

  for p in polys:
    walk(p, 1)
  return {n: m for n, m in found.items() if m > 1}


_LARGEST_CHECKED = 4096


def _least_multiples(polys: Sequence[Poly], products: dict[str, int]) -> dict[str, int]:
  """For each dim, the least divisor m of its product of divisors (`_divisor_products`)
  with which every one of `polys` is affine in k where dim = m*k (so JAX's simplification
  makes it exact): a 'SAME' convolution's backward adds a floor division its forward did
  not need. The products where they are too large to check in a moment (evaluations grow
  with the product: 78 ms for Wav2Vec2's 320)."""
  if not products or max(products.values()) > _LARGEST_CHECKED:
    return products
  least = dict(products)
  for name in sorted(products):
    for m in (d for d in range(1, products[name] + 1) if products[name] % d == 0):
      trial = dict(least, **{name: m})
      if all(_affine(p, name, trial, 2 * max(products.values()) + 3) for p in polys):
        least[name] = m
        break
  return least


def _affine(p: Poly, name: str, multiples: Mapping[str, int], points: int) -> bool:
  """Whether p, with each dim of `multiples` set to its multiple times a k, is affine in
  `name`'s k over k = 1..points (others' k at 1 and 2; variables outside `multiples` at
  1). Floor divisions are periodic in k: `points` spans two of the longest periods."""
  for other in (1, 2):
    env = {v: multiples.get(v, 1) * (other if v in multiples else 1) for v in p.variables()}
    values = []
    for k in range(1, points + 1):
      env[name] = multiples[name] * k
      values.append(p.evaluate(env))
    if len({b - a for a, b in zip(values, values[1:])}) > 1:
      return False
  return True


def _stride_multiples(msg: str, dims: set[str], constraints: Sequence[str]
                      ) -> tuple[list[str], list[str]]:
  """(the constraints that make the floor divisions of an error message exact, the user's
  constraints they replace): each dim of the arguments a multiple ('n == 20*k'); for a dim
  the user declared a multiple too small ('n == 5*k', which the message writes in k), that
  declaration with a larger one. ([], []) when a name in the divisions is not such a dim."""
  declared = {}
  for c in constraints:
    m = constraints_lib._VAR_EQ_MULTIPLE.fullmatch(c)
    if m:
      declared[m.group(3)] = (m.group(1), int(m.group(2)), c)
  taken = set(dims) | {v for v, _, _ in declared.values()} | set(declared)
  out, replaced = [], []
  fresh_dims = _fresh_dims(taken)
  polys = _floordiv_calls(msg)
  for name, n in sorted(_least_multiples(polys, _divisor_products(polys)).items()):
    if name not in dims:
      return [], []
    if name in declared:
      outer, c, source = declared[name]
      out.append(f"{outer} == {c * n}*{name}")
      replaced.append(source)
      continue
    out.append(f"{name} == {n}*{next(fresh_dims)}")
  return out, replaced


def _clamped_slices(msg: str) -> list[str]:
  """For sizes like min(512, s) in an error: the bounds that make them s ('s <= 512')."""
  found = re.findall(r"min\((\d+), ([A-Za-z_]\w*)\)|min\(([A-Za-z_]\w*), (\d+)\)", msg)
  bounds = {(a or d, int(n or m)) for n, a, d, m in found}
  return [f"{dim} <= {n}" for dim, n in sorted(bounds)]


def _padded_multiples(msg: str) -> list[tuple[str, int]]:
  """(dim, n) for each length padded up to a multiple of n in an error's shapes: jax
  writes the padding -s % n as mod(- s, n)."""
  found = re.findall(r"mod\(- ?([A-Za-z_]\w*), (\d+)\)", msg)
  return sorted({(dim, int(n)) for dim, n in found if int(n) > 1})


def _deciding_constraints(msg: str) -> str:
  """For jax's "comparison 'A' > 'B' is inconclusive": the two constraints that decide it,
  one making it true for every allowed shape, one false."""
  m = re.search(r"comparison '(.+?)' (>=|<=|>|<) '(.+?)' is inconclusive", msg)
  if not m:
    return "e.g. 's >= 129'"
  lhs, op, rhs = m.groups()
  bound = _as_bound(lhs, op, rhs)
  if bound is not None:   # 'k - 1' >= '1' reads better as 'k >= 2'
    v, rel, t = bound
    false = f"{v} <= {t - 1}" if rel == ">=" else f"{v} >= {t + 1}"
    return (f"'{v} {rel} {t}' if {lhs} {op} {rhs} holds for all your batches, "
            f"'{false}' if it never does")
  def shifted(k):   # rhs + k
    return str(int(rhs) + k) if re.fullmatch(r"-?\d+", rhs) else f"{rhs} {'+-'[k < 0]} {abs(k)}"
  true, false = {">": ((">=", 1), ("<=", 0)), ">=": ((">=", 0), ("<=", -1)),
                 "<": (("<=", -1), (">=", 0)), "<=": (("<=", 0), (">=", 1))}[op]
  as_string = lambda rel, k: f"'{lhs} {rel} {shifted(k) if k else rhs}'"
  return (f"{as_string(*true)} if {lhs} {op} {rhs} holds for all your batches, "
          f"{as_string(*false)} if it never does")


def _as_bound(lhs: str, op: str, rhs: str) -> tuple[str, str, int] | None:
  """`lhs op rhs` as (v, ">=" or "<=", t) where lhs - rhs is v or -v plus a constant."""
  try:
    d = jax_dims.parse(lhs) - jax_dims.parse(rhs)
  except Exception:  # noqa: BLE001 - not an expression the parser reads: no bound
    return None
  atoms = d.atoms()
  if d.degree() != 1 or len(atoms) != 1 or not isinstance(next(iter(atoms)), Var):
    return None
  (atom,) = atoms
  v, a, c = atom.name, d.as_dict()[((atom, 1),)], d.constant
  if a not in (1, -1):
    return None
  # a*v + c op 0, with a = +-1: v op' -a*c, op' flipped where a = -1; strict ones shifted
  t = -a * c
  rel = op if a == 1 else {">": "<", ">=": "<=", "<": ">", "<=": ">="}[op]
  if rel == ">":
    return v, ">=", t + 1
  if rel == "<":
    return v, "<=", t - 1
  return v, rel, t


def _spec_mismatches(args, specs, msg: str = "") -> str:
  """Why shapes that must agree may differ at trace time: an argument with a static spec
  whose every axis has the size of a dim at this call (and one of those sizes in the error
  `msg`, where a static shape shows as numbers: a parameter whose sizes match the batch's by
  chance is not named), or dims that are equal here (one dim spelled two ways). '' when
  neither is seen."""
  in_msg = {int(n) for n in re.findall(r"(?<![\w.])\d+(?!\w|\.\d)", msg)} if msg else None
  leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
  spec_leaves = jax.tree_util.tree_leaves(specs)
  dims_of_size: dict[int, list[str]] = {}   # size at this call -> the plain dims of that size
  for (_, x), spec in zip(leaves, spec_leaves):
    for d, n in zip(spec.shape, getattr(x, "shape", ())):
      if jax_dims.is_symbolic(d) and str(d).isidentifier() and n > 1:
        names = dims_of_size.setdefault(n, [])
        if str(d) not in names:
          names.append(str(d))
  hints = []
  for (path, x), spec in zip(leaves, spec_leaves):
    shape = tuple(getattr(x, "shape", ()))
    # Every axis a dim's size (a weight of shape (s, d) is not meant).
    if shape and all(n in dims_of_size for n in shape) and not any(
        map(jax_dims.is_symbolic, spec.shape)) and (in_msg is None or in_msg & set(shape)):
      suggested = ", ".join(dims_of_size[n][0] for n in shape)
      hints.append(f"args{jax.tree_util.keystr(path)} has a static spec and shape {shape}, "
                   f"sizes that dims have at this call: if its shape changes with them, give "
                   f"it the spec '{suggested}'")
  for n, names in sorted(dims_of_size.items()):
    if len(names) > 1:
      hints.append(f"dims {', '.join(sorted(names))} are all {n} at this call: if they are "
                   "one dim, spell it the same way in every spec")
  return "; ".join(hints)
