"""Tracing with symbolic dimensions into a flat, frozen program (the IR of ir.py).

`trace` runs `jax.make_jaxpr` on `jax.export.symbolic_args_specs` and flattens
the result into a `Program`: call-like primitives (jit/pjit, closed_call,
custom_jvp/custom_vjp calls, remat) are inlined, because for memory they are
just their bodies; control flow (scan, while, cond) and a shard_map (whose body runs
per device) stay one node whose bodies are flattened too (`Node.subprograms`). Downstream stages see only `Program`,
`Node` and `Const`, never `jax.core` objects beyond primitives and avals.

Together with `jax_dims.py` this is the only module that touches private JAX
internals (`jax._src.source_info_util`, the jaxpr data structures, the dense
implementation of ragged dots that XLA:CPU runs: `_dense_ragged_dot`).
"""

from __future__ import annotations

import dataclasses
import contextlib
import functools
import itertools
import operator
import re
import threading
import weakref
from typing import Any, Callable, Mapping, NoReturn, Sequence

import jax
from jax import api_util
from jax import export
import jax.extend.core as jcore
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import config as _jax_config   # _check_vma: `inside_shard_map`
# DropVar, DebugInfo and new_jaxpr_eqn are in jax.extend.core from jax 0.10 on, in
# jax._src.core in every version pyproject.toml allows.
from jax._src import core as _jax_core
from jax._src import source_info_util
from jax._src import util as _jax_util   # register_cache: `cleared_by_jax`
from jax._src import api_util as _jax_api_util   # `raise_floating_point_error`
from jax._src.lax import lax as _jax_lax   # _ragged_dot_general_impl: `_dense_ragged_dot`

from jax_symmem._src import compare as compare_lib
from jax_symmem._src import collector
from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import jax_dims
from jax_symmem._src import ir
from jax_symmem._src import sharding
from jax_symmem._src import trace_advice
from jax_symmem._src.errors import ConstraintError, ShapeError, ShapeSpecError, TracingError
from jax_symmem._src.ir import Const, Node, Operand, Program  # noqa: F401  (re-exported)
from jax_symmem._src.poly import Poly, Var

@dataclasses.dataclass(frozen=True, eq=False)
class TracedProgram:
  """The result of `trace`: a program with symbolic shapes and how to call it."""
  fun: Callable
  fun_name: str
  program: Program
  closed_jaxpr: jcore.ClosedJaxpr
  in_specs: Any             # pytree of jax.ShapeDtypeStruct with symbolic dims
  in_tree: Any
  out_tree: Any
  dims: tuple[str, ...]
  constraints: constraints_lib.Constraints
  # argument shapes -> dims: bind_dims is on the hot path of every call.
  _bind_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def __repr__(self) -> str:
    return (f"TracedProgram({self.fun_name}: dims {', '.join(self.dims) or 'none'}, "
            f"{len(self.program.nodes)} nodes; constraints {self.constraints})")

  def bind_dims(self, *args) -> dict[str, int]:
    """Solves the dims from concrete arguments and checks them against the constraints."""
    shapes = tuple(tuple(getattr(x, "shape", ())) for x in jax.tree_util.tree_leaves(tuple(args)))
    env = self._bind_cache.get(shapes)
    if env is None:
      env = self._solve_dims(args)
      if len(self._bind_cache) < 4096:
        self._bind_cache[shapes] = env
    return dict(env)

  def _solve_dims(self, args) -> dict[str, int]:
    spec_leaves = jax.tree_util.tree_leaves(self.in_specs)
    paths_args = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    if len(paths_args) != len(spec_leaves):
      got = jax.tree_util.tree_structure(tuple(args))
      raise ShapeError(f"expected {len(spec_leaves)} array leaves in the traced structure "
                       f"{str(self.in_tree):.300}, got {len(paths_args)} in {str(got):.300}")
    equations = []   # (Poly, concrete size, argument path)
    for (path, arg), spec in zip(paths_args, spec_leaves):
      shape = tuple(getattr(arg, "shape", ()))
      if len(shape) != len(spec.shape):
        raise ShapeError(f"argument args{jax.tree_util.keystr(path)} has shape {shape}, "
                         f"expected rank {len(spec.shape)} ({spec.shape})")
      equations += [(jax_dims.to_poly(d), int(n), jax.tree_util.keystr(path))
                    for d, n in zip(spec.shape, shape)]
    env: dict[str, int] = {}
    for _ in range(len(equations) + 1):   # solve one linear unknown at a time
      progress = False
      for p, n, _ in equations:
        unknown = p.variables() - env.keys()
        if len(unknown) != 1 or p.degree() != 1:
          continue
        (v,) = unknown
        coeff = p.as_dict().get(((Var(v), 1),))
        if coeff is None:
          continue
        rest = (p - coeff * Poly.var(v)).evaluate(env)
        if (n - rest) % coeff == 0:
          env[v] = (n - rest) // coeff
          progress = True
      if not progress:
        break
    for p, n, where in equations:
      if not p.variables() <= env.keys():
        raise ShapeError(f"cannot solve dimension {p} from argument args{where}")
      if p.evaluate(env) != n:
        raise ShapeError(f"argument args{where} has size {n} where the spec says {p} "
                         f"(= {p.evaluate(env)} with {env})")
    problem = self.constraints.violation(self.constraints.complete(env))
    if problem is not None:
      raise ShapeError(f"shape outside the declared constraints: {problem}")
    return env

  def specialize(self, **dims: int) -> Program:
    """The program at concrete dims: same nodes and value ids, concrete params and avals.

    Symbolic plans refer to node indices and value ids of `program`, so they
    apply unchanged to the specialized program, which runs op by op.
    """
    self.check_dims(dims)
    return specialize_program(self.program, self.constraints.complete(dims))

  def check_dims(self, dims: Mapping[str, int]) -> None:
    """Raises unless `dims` are integers naming every dim of the step, no other, and
    meeting the constraints (TypeError, ValueError, ShapeError)."""
    integer_dims(dims)
    cons = self.constraints
    known = (set(self.dims) | {v for v, _, _ in cons.bounds} | {v for v, _ in cons.substitutions})
    unknown = sorted(set(dims) - known)
    if unknown:
      raise ValueError(f"unknown dims {', '.join(unknown)}: {self.fun_name}'s dims are "
                       f"{', '.join(self.dims)}")
    try:
      env = cons.complete(dims)
    except KeyError:
      env = dims
    missing = sorted(set(self.dims) - set(env))
    if missing:
      raise ValueError(f"give every dim of {self.fun_name}: {', '.join(missing)} missing "
                       f"from {dict(dims)}")
    problem = cons.violation(env)
    if problem:
      raise ShapeError(f"{dict(dims)} is outside the constraints the plan was made for: {problem}")

  def __str__(self) -> str:
    return (f"TracedProgram({self.fun_name}: dims {', '.join(self.dims)}; "
            f"{sum(1 for _ in self.program.walk())} nodes; constraints {self.constraints})")


def integer_dims(dims: Mapping[str, int]) -> dict[str, int]:
  """`dims` with Python ints as values (NumPy and JAX integer scalars converted); a
  TypeError for anything else (a float, a bool): a size is an integer."""
  out = {}
  for name, value in dims.items():
    try:
      if isinstance(value, bool):
        raise TypeError
      out[name] = operator.index(value)
    except TypeError:
      raise TypeError(f"dim {name}={value!r} is not an integer") from None
  return out


# --- Inlining rules ------------------------------------------------------------
# primitive name -> params -> (body jaxpr, body consts). Call-like primitives whose
# body is evaluated exactly once on the node's operands.

def _closed(j):
  return (j.jaxpr, j.consts) if isinstance(j, jcore.ClosedJaxpr) else (j, ())

_INLINE_RULES: dict[str, Callable[[Mapping[str, Any]], tuple[Any, Sequence[Any]]]] = {
    "pjit": lambda p: _closed(p["jaxpr"]),
    "jit": lambda p: _closed(p["jaxpr"]),
    "closed_call": lambda p: _closed(p["call_jaxpr"]),
    "eval_jaxpr": lambda p: _closed(p["call_jaxpr"]),   # closed_call's name from jax 0.11
    "core_call": lambda p: _closed(p["call_jaxpr"]),
    "remat2": lambda p: _closed(p["jaxpr"]),
    "checkpoint": lambda p: _closed(p["jaxpr"]),
    "custom_jvp_call": lambda p: _closed(p["call_jaxpr"]),
    "custom_vjp_call": lambda p: _closed(p["call_jaxpr"]),
    "custom_vjp_call_jaxpr": lambda p: _closed(p["fun_jaxpr"]),
}

# XLA:CPU has no ragged-dot kernel: JAX lowers `ragged_dot_general` (`jax.lax.ragged_dot`,
# a mixture-of-experts layer's grouped matmuls) there through its dense implementation,
# each operand whose ragged dim it expands copied and masked with the g groups in front,
# then one dot. As one node that work is invisible to the memory model (a step of two
# such layers at b=8, s=256: modeled 9.3 MiB where XLA reports 16.0); inlined as the
# implementation's ops, the model and the predicted layout see the copies and masks,
# and the rounds compile what JAX would lower anyway. GPU and TPU keep the node (XLA's
# ragged-dot instruction). None: decided by the default backend.
DENSE_RAGGED_DOTS: bool | None = None


def dense_ragged_dots() -> bool:
  return jax.default_backend() == "cpu" if DENSE_RAGGED_DOTS is None else DENSE_RAGGED_DOTS


def _dense_ragged_dot(eqn) -> tuple[Any, Sequence[Any]] | None:
  """The jaxpr JAX lowers a `ragged_dot_general` eqn through on this backend, or None
  where it lowers to XLA's instruction."""
  if not dense_ragged_dots():
    return None
  impl = functools.partial(_jax_lax._ragged_dot_general_impl, **eqn.params)
  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
           for v in eqn.invars]
  return _closed(jax.make_jaxpr(impl)(*specs))


def _inline_body(eqn) -> tuple[Any, Sequence[Any]] | None:
  """(body jaxpr, consts) of an eqn traced as its body, else None."""
  rule = _INLINE_RULES.get(eqn.primitive.name)
  if rule is not None:
    return rule(eqn.params)
  if eqn.primitive.name == "ragged_dot_general":
    return _dense_ragged_dot(eqn)
  return None


# Control flow keeps its node; these name the params holding bodies to analyse.
_BODY_PARAMS: dict[str, tuple[str, ...]] = {
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
    "shard_map": ("jaxpr",),   # its body runs per device, on each device's shard
}


_OPTIMIZATION_BARRIER = jax.lax.optimization_barrier_p


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
  """(consts, carries): how a scan's operands begin (the scanned inputs follow). JAX
  before 0.11 names the counts in the scan's params; 0.11 packs the operands' structure
  into `ft_in` (a flat tree of consts, carries, scanned inputs)."""
  if "num_carry" in params:
    return params["num_consts"], params["num_carry"]
  consts, carries, _ = params["ft_in"].unpack()
  return len(consts), len(carries)


def _source(eqn, outside: str = "", outside_scope: str = "") -> str:
  """Where the user wrote the op: the innermost frame outside JAX and installed libraries
  (a flax LayerNorm's ops point at the line that called it, not into flax), and the
  name scope with transformations dropped ("Block_3/LayerNorm_0" for flax modules).
  `outside`, `outside_scope`: the line and the name stack of the call that an inlined
  body came from, for its ops whose own hold none: a jit traces its body under an empty
  name stack, so jax.nn.silu's ops inside a layer would name no layer."""
  where = _where(eqn.source_info.traceback) or outside
  scope = _scope(str(eqn.source_info.name_stack) or outside_scope)
  return where + (f" @ {scope}" if scope else "")


@functools.lru_cache(maxsize=1 << 12)
def _scope(name_stack: str) -> str:
  """A name stack without transformations (`_name_layers` then drops the outermost scope
  where it names the whole model)."""
  scope = name_stack
  while (unwrapped := _TRANSFORM.sub(r"\1", scope)) != scope:   # jvp(M)/Block_0 -> M/Block_0
    scope = unwrapped
  return scope


_INDEXED = re.compile(r"(.*?[^_\d])(_?)(\d+)")


def _name_layers(program: Program) -> Program:
  """`program` with its nodes' scopes as `ir.layer_scope` reads layers from them.

  The outermost scope is dropped ("Llama/layer_0/attn" -> "layer_0/attn": the whole
  model, whose name may end in a digit, "GPT2"), unless it is one of a family of
  indexed scopes (`jax.named_scope(f"layer_{i}")` around each layer of a plain function,
  or Haiku, which names each module call by the module alone: "block", "block_1",
  "block_2" for three blocks). In a family the first member, unindexed in Haiku's
  naming, is numbered: "block" -> "block_0", so that every layer reads as one.
  """
  scopes = {_split_scope(n.source)[1] for _, n in program.walk()}
  scopes.discard("")
  outer = {sc.split("/")[0] for sc in scopes}
  kept = _family_members(outer)
  renamed = {}
  for sc in scopes:
    parts = sc.split("/")
    parts = parts if parts[0] in kept else parts[1:]
    renamed[sc] = parts
  # Number the unindexed first member of each family of siblings, at every depth.
  siblings: dict[tuple, set] = {}
  for parts in renamed.values():
    for k, c in enumerate(parts):
      siblings.setdefault(tuple(parts[:k]), set()).add(c)
  first = {(parent, c): c + sep + "0" for parent, names in siblings.items()
           for c, sep in _unindexed_firsts(names).items()}
  new = {}
  for sc, parts in renamed.items():
    parts = [first.get((tuple(parts[:k]), c), c) for k, c in enumerate(parts)]
    new[sc] = "/".join(parts)
  if all(new[sc] == sc for sc in scopes):
    return program
  return _with_scopes(program, new)


def _split_scope(source: str) -> tuple[str, str, str]:
  """(where, scope, suffix) of a node's source "where @ scope[ [note]]"."""
  where, _, rest = source.partition(" @ ")
  scope, bracket, note = rest.partition(" [")
  return where, scope, bracket + note


def _family_members(names) -> set[str]:
  """The names among `names` that belong to a family of two or more that share a stem,
  at least one of them indexed ("block", "block_1"; "layer_0", "layer_1")."""
  stems: dict[str, set[str]] = {}
  for c in names:
    m = _INDEXED.fullmatch(c)
    stems.setdefault(m.group(1) if m else c, set()).add(c)
  return {c for stem, members in stems.items() if len(members) > 1
          and any(c != stem for c in members) for c in members}


def _unindexed_firsts(names) -> dict[str, str]:
  """Each unindexed name among siblings `names` whose indexed siblings exist ("block"
  beside "block_1"), with the separator they use."""
  out = {}
  for c in names:
    m = _INDEXED.fullmatch(c)
    if m and m.group(1) in names and m.group(1) not in out:
      out[m.group(1)] = m.group(2)
  return out


def _with_scopes(program: Program, new: Mapping[str, str]) -> Program:
  nodes = []
  for n in program.nodes:
    where, scope, suffix = _split_scope(n.source)
    source = where + (f" @ {new[scope]}" if scope and new[scope] else "") + suffix
    subprograms = tuple(_with_scopes(p, new) for p in n.subprograms)
    nodes.append(n if source == n.source and subprograms == n.subprograms else
                 dataclasses.replace(n, source=source, subprograms=subprograms))
  return dataclasses.replace(program, nodes=tuple(nodes))


@functools.lru_cache(maxsize=1 << 12)
def _where(traceback) -> str:
  """The frame `_source` names, for a traceback (equal for the same op in every layer
  of a loop, so a model's layers share the work)."""
  frames = list(source_info_util.user_frames(traceback))
  # Innermost first. Our own frame means a rewrite bound the op (a re-traced scan body):
  # the frames beyond it are the planner's caller, not where the op was written.
  mine = next((i for i, f in enumerate(frames) if _OURS.search(f.file_name)), len(frames))
  frames = frames[:mine]
  frame = next((f for f in frames if not _LIBRARY.search(f.file_name)),
               frames[0] if frames else None)
  return source_info_util._summarize_frame(frame) if frame else ""


_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]")
_OURS = re.compile(r"[/\\]jax_symmem[/\\]_src[/\\]")
_TRANSFORM = re.compile(r"\b\w+\(([^()]*)\)")


class _Flattener:
  """Builds a Program tree from a jaxpr, with globally unique value ids."""

  def __init__(self, start: int = 0):
    self._ids = itertools.count(start)

  def new_id(self) -> int:
    return next(self._ids)

  def program(self, jaxpr, consts: Sequence[Any]) -> Program:
    avals: dict[int, Any] = {}
    env: dict[Any, Operand] = {}
    for v, c in zip(jaxpr.constvars, consts):
      env[v] = Const(c, v.aval)
    inputs = []
    for v in jaxpr.invars:
      i = self.new_id()
      env[v] = i
      avals[i] = v.aval
      inputs.append(i)
    nodes: list[Node] = []
    self._emit(jaxpr.eqns, env, avals, nodes)
    outputs = tuple(self._read(env, v) for v in jaxpr.outvars)
    return Program(tuple(inputs), tuple(nodes), outputs, avals)

  @staticmethod
  def _read(env, v) -> Operand:
    if isinstance(v, jcore.Literal):
      return Const(v.val, v.aval)
    return env[v]

  def _emit(self, eqns, env, avals, nodes, outside: str = "", outside_scope: str = "") -> None:
    """Appends `eqns` to `nodes`, inlining call primitives; `outside`, `outside_scope`:
    `_source`'s."""
    for eqn in eqns:
      ins = [self._read(env, v) for v in eqn.invars]
      inlined = _inline_body(eqn)
      if inlined is not None:
        body, consts = inlined
        ins = self._checkpoint_fence(eqn, ins, avals, nodes, outside, outside_scope)
        inner_env: dict[Any, Operand] = {}
        for v, c in zip(body.constvars, consts):
          inner_env[v] = Const(c, v.aval)
        for v, x in zip(body.invars, ins):
          inner_env[v] = x
        self._emit(body.eqns, inner_env, avals, nodes,
                   _where(eqn.source_info.traceback) or outside,
                   str(eqn.source_info.name_stack) or outside_scope)
        for outer, inner in zip(eqn.outvars, body.outvars):
          if not isinstance(outer, _jax_core.DropVar):
            env[outer] = self._read(inner_env, inner)
        continue
      subprograms = []
      for key in _BODY_PARAMS.get(eqn.primitive.name, ()):
        bodies = eqn.params[key]
        for b in (bodies if isinstance(bodies, (tuple, list)) else (bodies,)):
          subprograms.append(self.program(*_closed(b)))
      outs = []
      for v in eqn.outvars:
        i = self.new_id()
        avals[i] = v.aval
        outs.append(i)
        if not isinstance(v, _jax_core.DropVar):
          env[v] = i
      nodes.append(Node(index=len(nodes), primitive=eqn.primitive, params=dict(eqn.params),
                        inputs=tuple(ins), outputs=tuple(outs),
                        source=_source(eqn, outside, outside_scope),
                        effects=frozenset(eqn.effects), subprograms=tuple(subprograms)))

  def _checkpoint_fence(self, eqn, ins, avals, nodes, outside: str, outside_scope: str
                        ) -> list[Operand]:
    """The operands of an inlined `jax.checkpoint` region, fenced as JAX lowers it.

    A region that recomputes in the backward pass (`differentiated`, `prevent_cse`)
    passes its operands through an optimization barrier when JAX lowers it, so that
    XLA cannot merge the recomputation with the forward pass. Inlining the region
    keeps that barrier as a node: without it the step as written would lose its
    recomputation in XLA.
    """
    params = eqn.params
    if eqn.primitive.name not in CHECKPOINT_PRIMITIVES or not params.get("differentiated"):
      return ins
    flags = params.get("prevent_cse", True)
    flags = (flags,) * len(ins) if isinstance(flags, bool) else tuple(flags)
    fenced = [k for k, (f, x) in enumerate(zip(flags, ins)) if f and not isinstance(x, Const)]
    if not fenced:
      return ins
    outs = []
    for k in fenced:
      i = self.new_id()
      avals[i] = avals[ins[k]]
      outs.append(i)
    nodes.append(Node(index=len(nodes), primitive=_OPTIMIZATION_BARRIER,
                      params={}, inputs=tuple(ins[k] for k in fenced), outputs=tuple(outs),
                      source=_source(eqn, outside, outside_scope) + " [jax.checkpoint fence]"))
    ins = list(ins)
    for k, o in zip(fenced, outs):
      ins[k] = o
    return ins


class _ClearedByJax:
  """What JAX's cache registry takes (`cache_clear`, `cache_info`, `cache_keys`): it
  calls `clear` of an object it holds weakly, for `jax.clear_caches()`."""

  def __init__(self, clear: Callable[[], None]):
    self._clear = weakref.WeakMethod(clear)

  def cache_clear(self) -> None:
    if (clear := self._clear()) is not None:
      clear()

  def cache_info(self) -> None:
    return None

  def cache_keys(self) -> list:
    return []


def cleared_by_jax(clear: Callable[[], None], for_what: str) -> Any:
  """Makes `jax.clear_caches()` call the bound method `clear` while the returned object
  lives (JAX's registry holds it weakly: keep it on the method's instance)."""
  hook = _ClearedByJax(clear)
  _jax_util.register_cache(hook, for_what)
  return hook


def trace_context() -> Any:
  """What jax.jit keys its traces on besides the arguments: the configuration a trace
  reads (rank and dtype promotion, matmul precision, x64, ...), as a hashable value."""
  return _jax_config.trace_context()


# What a jitted computation raises where jax_debug_nans / jax_debug_infs finds a nan or inf.
InternalFloatingPointError = _jax_api_util.InternalFloatingPointError


def raise_floating_point_error(e: Exception, step: Callable, args, kwargs) -> NoReturn:
  """The FloatingPointError jax.jit raises for `e`: the step is run again op by op (as
  written, without jit) to name the operation, unless arguments it donated are gone."""
  if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(args)):
    raise FloatingPointError(
        f"invalid value ({e.ty}) encountered in {function_name(step)}; it donates its "
        "arguments, so it could not be run again op by op to name the operation (jax.jit "
        "does not donate under jax_debug_nans): call it without donate_argnums to find "
        "it") from None
  _jax_api_util.maybe_recursive_nan_check(e, step, args, kwargs)   # raises
  raise e


def shard_arrays(a: jax.Array) -> Sequence[jax.Array]:
  """The single-device arrays an array keeps for its addressable shards (itself, for
  one on one device). Views JAX makes of a sharded array's shards (`jax.device_get`,
  `np.asarray`, printing) are live arrays of their own over the same buffers: a count
  of live bytes tells them apart by these arrays' buffers (`device.live_bytes`)."""
  return a._arrays


def function_name(fun) -> str:
  """`fun`'s name for messages and logs: a `functools.partial`'s function's, a callable
  object's class's."""
  while isinstance(fun, functools.partial):
    fun = fun.func
  return getattr(fun, "__name__", type(fun).__name__)


def flatten(closed_jaxpr: jcore.ClosedJaxpr, start: int = 0) -> Program:
  """Flattens a closed jaxpr into a Program (call primitives inlined); value ids
  count from `start` (a rewrite's new values must not collide with a program's)."""
  return _name_layers(_Flattener(start).program(closed_jaxpr.jaxpr, closed_jaxpr.consts))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def program_text(closed_jaxpr: jcore.ClosedJaxpr) -> str:
  """A canonical text of a jaxpr for cache keys: every equation's primitive, params,
  operands (literals with their values) and result types (symbolic shapes included),
  but no source locations, values of closed-over constants or object addresses.
  Equal programs traced in any process give equal text. Unlike `str(jaxpr)`, no layout
  is computed and each type and each shared sub-jaxpr (jit bodies JAX reuses) is
  written once: several times faster on large steps."""
  out: list[str] = []
  seen_jaxprs: dict[int, int] = {}
  types: dict[int, str] = {}
  alive: list[Any] = []   # keeps the objects behind the ids above alive during the walk

  def type_of(aval) -> str:
    s = types.get(id(aval))
    if s is None:
      s = types[id(aval)] = aval.str_short()
      alive.append(aval)
    return s

  def jaxpr(j) -> None:
    if (k := seen_jaxprs.get(id(j))) is not None:
      out.append(f"@{k}")
      return
    seen_jaxprs[id(j)] = len(seen_jaxprs)
    alive.append(j)
    names: dict[Any, int] = {}

    def var(v) -> str:
      if isinstance(v, jcore.Literal):
        val = v.val.item() if getattr(v.val, "shape", None) == () else v.val
        return f"{val!r}:{type_of(v.aval)}"
      if (n := names.get(v)) is not None:
        return f"%{n}"
      n = names[v] = len(names)
      return f"%{n}:{type_of(v.aval)}"

    out.append(f"({' '.join(map(var, j.constvars))};{' '.join(map(var, j.invars))})")
    for e in j.eqns:
      out.append(f"\n{' '.join(map(var, e.outvars))}={e.primitive.name}[")
      for k in sorted(e.params):
        out.append(f"{k}=")
        param(e.params[k])
        out.append(",")
      out.append(f"]{' '.join(map(var, e.invars))}")
    out.append(f"\n->{' '.join(map(var, j.outvars))}")

  def param(v) -> None:
    if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
      jaxpr(_closed(v)[0])
    elif (type(v) is tuple and v
          and all(isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr)) for x in v)):
      out.append("(")
      for x in v:
        param(x)
      out.append(")")
    elif isinstance(v, (set, frozenset)):   # iteration order varies with the hash seed
      out.append(f"{{{', '.join(sorted(map(repr, v)))}}}")
    else:
      out.append(_ADDRESS.sub(" at 0x", str(v)))

  jaxpr(closed_jaxpr.jaxpr)
  return "".join(out)


# --- Building new nodes from Python functions (used by rewrites) --------------------


def eval_jaxpr(jaxpr, consts: Sequence[Any], args: Sequence[Any],
               wanted: Sequence[int] | None = None) -> list[Any]:
  """Evaluates `jaxpr` on `args` (tracers or arrays), binding only the equations
  that the outputs at positions `wanted` (default: all) depend on: a dead-code
  eliminating `jax.core.eval_jaxpr`. Unused arguments may be None."""
  outvars = jaxpr.outvars if wanted is None else [jaxpr.outvars[k] for k in wanted]
  eqns, _ = _live_equations(jaxpr, outvars)
  values = dict(zip(jaxpr.constvars, consts))
  values.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jcore.Literal) else values[v]
  for eqn in reversed(eqns):   # (the user's source line kept: plans and errors cite it)
    values.update(zip(eqn.outvars, _bind_eqn(eqn, [read(v) for v in eqn.invars])))
  return [read(v) for v in outvars]


def _bind_eqn(eqn, args: Sequence[Any]) -> list[Any]:
  """Binds one equation on `args` as `eval_jaxpr` does: the user's source line kept."""
  params = eqn.primitive.get_bind_params(eqn.params)
  with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
    outs = eqn.primitive.bind(*args, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def varying_axes(x) -> frozenset:
  """The mesh axes a value inside a shard_map body varies over (jax 0.9 names them
  `vma`, later versions `mat.varying`); none outside."""
  return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> frozenset:
  """`varying_axes` of a value of `aval`. An optimization barrier inside a shard_map
  takes only operands that vary over the same axes."""
  axes = getattr(aval, "vma", None)
  if axes is None:
    axes = getattr(getattr(aval, "mat", None), "varying", None)
  return frozenset(axes or ())


class LazyReplay:
  """The outputs of `jaxpr` on `args` (None where unused), each computed when first asked
  for, behind a barrier on values to wait for: `output(j, wait)` binds the equations
  output j needs that no earlier output bound (work two outputs share is done once),
  reading what they take from before through `lax.optimization_barrier` with `wait`, so
  XLA cannot start them before `wait` is made, nor merge them with the same equations
  elsewhere (DESIGN.md F1: with barriers kept)."""

  def __init__(self, jaxpr, consts: Sequence[Any], args: Sequence[Any]):
    self._jaxpr = jaxpr
    self._values = dict(zip(jaxpr.constvars, consts))
    self._values.update((v, a) for v, a in zip(jaxpr.invars, args) if a is not None)

  def output(self, j: int, wait: Sequence[Any] = ()) -> Any:
    v = self._jaxpr.outvars[j]
    if isinstance(v, jcore.Literal):
      return v.val
    eqns, _ = _live_equations(self._jaxpr, [v])
    todo = [e for e in reversed(eqns) if not all(
        isinstance(o, _jax_core.DropVar) or o in self._values for o in e.outvars)]
    made = {o for e in todo for o in e.outvars}
    sources = list(dict.fromkeys(x for e in todo for x in e.invars
                                 if not isinstance(x, jcore.Literal) and x not in made))
    # Inside a shard_map a barrier's results vary over the mesh axes any of its operands
    # varies over: only sources that vary as `wait` does go through it (a replicated
    # weight stays replicated; what reads only such values is cheap to merge anyway).
    axes = frozenset().union(*map(varying_axes, wait))
    sources = [x for x in sources if varying_axes(self._values[x]) == axes]
    fenced = {}   # what these equations read through the barrier (later outputs fence anew)
    if todo and sources and wait:
      through, _ = jax.lax.optimization_barrier(([self._values[x] for x in sources], list(wait)))
      fenced = dict(zip(sources, through))
    read = lambda x: x.val if isinstance(x, jcore.Literal) else fenced.get(x, self._values[x])
    for eqn in todo:
      self._values.update(zip(eqn.outvars, _bind_eqn(eqn, [read(x) for x in eqn.invars])))
    return read(v)


def eval_jaxpr_lazily(jaxpr, consts: Sequence[Any], args: Sequence[Any],
                      late: Mapping[int, Callable[[Sequence[Any]], Any]]) -> list[Any]:
  """`eval_jaxpr` where the input at each position k of `late` is made where an equation
  first reads it, as `late[k](wait)`: `wait` are the results of the equation before it
  and that equation's other operands (what the input waits for: made just before it is
  needed, not where XLA finds its operands ready)."""
  values = dict(zip(jaxpr.constvars, consts))
  values.update((v, a) for k, (v, a) in enumerate(zip(jaxpr.invars, args)) if k not in late)
  pending = {v: late[k] for k, v in enumerate(jaxpr.invars) if k in late}
  def read(x):
    return x.val if isinstance(x, jcore.Literal) else values[x]
  def make(x, wait):
    if not isinstance(x, jcore.Literal) and x in pending:
      values[x] = pending.pop(x)(wait)
  previous: list = []   # the results of the equation bound last
  for eqn in jaxpr.eqns:
    wait = previous + [values[x] for x in eqn.invars
                       if not isinstance(x, jcore.Literal) and x not in pending]
    for x in eqn.invars:
      make(x, wait)
    previous = _bind_eqn(eqn, [read(x) for x in eqn.invars])
    values.update(zip(eqn.outvars, previous))
  for x in jaxpr.outvars:
    make(x, previous)
  return [read(x) for x in jaxpr.outvars]


def _live_equations(jaxpr, outvars):
  """(the equations `outvars` depend on, last first; every variable they read)."""
  needed = {v for v in outvars if not isinstance(v, jcore.Literal)}
  eqns = []
  for eqn in reversed(jaxpr.eqns):
    if any(o in needed for o in eqn.outvars) or eqn.effects:
      eqns.append(eqn)
      needed.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
  return eqns, needed


def read_inputs(jaxpr, wanted: Sequence[int]) -> frozenset[int]:
  """Positions of `jaxpr`'s inputs that `eval_jaxpr(..., wanted=wanted)` reads (a call
  equation reads all its operands, even those its body does not use)."""
  _, needed = _live_equations(jaxpr, [jaxpr.outvars[k] for k in wanted])
  return frozenset(k for k, v in enumerate(jaxpr.invars) if v in needed)


class _Splice:
  """`eval_jaxpr` over jaxpr variables instead of tracers: copies the equations the
  wanted outputs depend on (with fresh output variables) into one new jaxpr."""

  def __init__(self):
    self.eqns: list = []
    self.constvars: list = []
    self.consts: list = []

  def __call__(self, jaxpr, consts: Sequence[Any], args: Sequence[Any],
               wanted: Sequence[int] | None = None) -> list[Any]:
    outvars = jaxpr.outvars if wanted is None else [jaxpr.outvars[k] for k in wanted]
    eqns, needed = _live_equations(jaxpr, outvars)
    env = dict(zip(jaxpr.invars, args))
    for v, c in zip(jaxpr.constvars, consts):
      if v in needed:   # as tracing would: only the constants an equation binds
        env[v] = jcore.Var(v.aval)
        self.constvars.append(env[v])
        self.consts.append(c)
    def read(v):
      x = v if isinstance(v, jcore.Literal) else env[v]
      if x is None:   # eval_jaxpr would fail binding it; a jaxpr would not
        raise ValueError("an input the wanted outputs read was not given")
      return x
    for eqn in reversed(eqns):
      outs = [v if isinstance(v, _jax_core.DropVar) else jcore.Var(v.aval) for v in eqn.outvars]
      self.eqns.append(eqn.replace(invars=[read(v) for v in eqn.invars], outvars=outs))
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in outvars]


def splice_jaxpr(fun: Callable, avals: Sequence[Any]) -> jcore.ClosedJaxpr:
  """The closed jaxpr of `fun(evaluate, *args)` on arguments of `avals`, where `fun`
  computes only through `evaluate` (`eval_jaxpr`'s signature, on existing jaxprs):
  their equations are copied, not bound again. `jax.make_jaxpr` would give the same
  equations, but re-tracing a layer's branches took most of a cond rewrite's time."""
  splice = _Splice()
  invars = [jcore.Var(_operand_aval(a)) for a in avals]
  outvars = list(fun(splice, *invars))
  effects = _jax_core.join_effects(*(eqn.effects for eqn in splice.eqns))
  debug = _jax_core.DebugInfo("splice_jaxpr", getattr(fun, "__name__", "<unknown>"), None, None)
  return jcore.ClosedJaxpr(jcore.Jaxpr(splice.constvars, invars, outvars, splice.eqns, effects,
                                       debug), splice.consts)


def _operand_aval(aval):
  """The aval tracing gives an operand of `aval`'s shape and dtype (not weakly typed),
  and the mesh axes it varies over inside a shard_map body (`inside_shard_map`: the
  body's ops check them, a cond's branches must agree, a scan's carry keeps them; a
  shape-dtype struct would drop them)."""
  if aval_varying_axes(aval):
    return aval.update(weak_type=False)
  return api_util.shaped_abstractify(jax.ShapeDtypeStruct(aval.shape, aval.dtype))


def node_from_function(fun: Callable, operand_avals: Sequence[Any], start: int
                       ) -> tuple[Node, Program]:
  """The single node that tracing `fun(*operands)` produces (e.g. one `lax.scan`) and
  the one-node program around it, flattened with value ids from `start`: the
  program's inputs stand for the operands, in order, for the caller to rename."""
  program = flatten(jax.make_jaxpr(fun)(*map(_operand_aval, operand_avals)), start)
  if len(program.nodes) != 1:
    raise TracingError(f"expected one node from {getattr(fun, '__name__', fun)}, got "
                       f"{[n.name for n in program.nodes]}")
  return program.nodes[0], program


def node_from_primitive(primitive, operand_avals: Sequence[Any], params: Mapping[str, Any],
                        start: int) -> tuple[Node, Program]:
  """`node_from_function` for a function that binds `primitive` once on its operands, with
  `params`: the equation is built from the primitive's abstract evaluation, without
  tracing (jax.make_jaxpr's own work was a third of a cond rewrite's time)."""
  invars = [jcore.Var(_operand_aval(a)) for a in operand_avals]
  out_avals, effects = primitive.abstract_eval(*(v.aval for v in invars), **params)
  outvars = [jcore.Var(a) for a in (out_avals if primitive.multiple_results else [out_avals])]
  eqn = _jax_core.new_jaxpr_eqn(invars, outvars, primitive, dict(params), effects,
                                source_info_util.new_source_info())
  debug = _jax_core.DebugInfo("node_from_primitive", primitive.name, None, None)
  program = flatten(jcore.ClosedJaxpr(jcore.Jaxpr([], invars, outvars, [eqn], effects, debug),
                                      []), start)
  return program.nodes[0], program


# --- Specialization to concrete dims -------------------------------------------------


def _concrete_dim(d, env: Mapping[str, int]) -> int:
  return jax_dims.to_poly(d).evaluate(env) if jax_dims.is_symbolic(d) else d


def _concrete_aval(aval, env):
  shape = getattr(aval, "shape", None)
  if shape is None or not any(jax_dims.is_symbolic(d) for d in shape):
    return aval
  return aval.update(shape=tuple(_concrete_dim(d, env) for d in shape))


# Primitives whose own impl refuses to run outside jax.export; evaluated here instead.
_CONCRETE_IMPLS: dict[str, Callable[..., Any]] = {
    "dim_as_value": lambda dim: jax.numpy.asarray(dim, dtype=_jax_core.dim_value_aval().dtype),
}


def bind(primitive, args: Sequence[Any], params: Mapping[str, Any]) -> list[Any]:
  """`primitive.bind` on concrete params, returning a list of outputs. As
  `jax.core.eval_jaxpr` does, the params go through `get_bind_params` first: call
  primitives (a `closed_call` nested in a loop body: `nn.remat_scan`) take their jaxpr
  as a function there."""
  impl = _CONCRETE_IMPLS.get(primitive.name)
  if impl is not None:
    return [impl(*args, **params)]
  outs = primitive.bind(*args, **primitive.get_bind_params(params))
  return list(outs) if primitive.multiple_results else [outs]


def _eval_jaxpr_concrete(jaxpr, consts, args, env):
  values = dict(zip(jaxpr.constvars, consts))
  values.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jcore.Literal) else values[v]
  for eqn in jaxpr.eqns:
    values.update(zip(eqn.outvars, bind(eqn.primitive, [read(v) for v in eqn.invars],
                                        concrete_params(eqn.params, env, eqn.primitive.name))))
  return [read(v) for v in jaxpr.outvars]


class _IdentityCache:
  """A small LRU cache keyed by an object's identity and a dims environment.

  Specialization must return the *same* objects for the same (program, dims):
  JAX compares jaxpr-valued params by identity, so a fresh copy per call would
  miss its compiled-op cache and recompile (and leak a little memory) each time.
  """

  def __init__(self, maxsize: int = 512):
    self._items: dict = {}
    self._maxsize = maxsize

  def get(self, obj, env: Mapping[str, int], make: Callable[[], Any]):
    key = (id(obj), tuple(sorted(env.items())))
    hit = self._items.pop(key, None)
    if hit is None or hit[0] is not obj:
      hit = (obj, make())
    self._items[key] = hit            # most recently used last
    while len(self._items) > self._maxsize:
      self._items.pop(next(iter(self._items)))
    return hit[1]


_SPECIALIZED = _IdentityCache()


def _concrete_jaxpr(j, env):
  return _SPECIALIZED.get(j, env, lambda: _make_concrete_jaxpr(j, env))


def _make_concrete_jaxpr(j, env):
  jaxpr, consts = _closed(j)
  # The avals themselves, not shape-dtype structs: inside a shard_map body they carry
  # the mesh axes a value varies over, which the body's ops check.
  specs = [_concrete_aval(v.aval, env) for v in jaxpr.invars]
  closed = jax.make_jaxpr(lambda *a: _eval_jaxpr_concrete(jaxpr, consts, a, env))(*specs)
  if isinstance(j, jcore.ClosedJaxpr):
    return closed
  if closed.consts:
    raise TracingError("an open jaxpr body captured constants after specialization")
  return closed.jaxpr


def concrete_params(params: Mapping[str, Any], env: Mapping[str, int],
                    primitive: str = "") -> dict[str, Any]:
  """Params with every symbolic dim evaluated, nested jaxprs re-traced at concrete shapes."""
  if primitive == "shard_map":
    return _SPECIALIZED.get(params, env, lambda: _concrete_shard_map(params, env))
  def conv(x):
    if jax_dims.is_symbolic(x):
      return _concrete_dim(x, env)
    if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
      return _concrete_jaxpr(x, env)
    if isinstance(x, tuple):
      items = [conv(y) for y in x]
      return type(x)(*items) if hasattr(x, "_fields") else tuple(items)  # keep NamedTuples
    if isinstance(x, list):
      return [conv(y) for y in x]
    return x
  return {k: conv(v) for k, v in params.items()}


def _manual_axes(params: Mapping[str, Any]) -> frozenset:
  """The mesh axes a shard_map's body is manual over (the param's name changed in jax 0.10)."""
  return frozenset(params.get("newly_manual_axes", params.get("manual_axes", frozenset())))


def same_shard_map_axes(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
  """Whether two shard_maps' bodies run on the same devices over the same manual axes."""
  return a["mesh"] == b["mesh"] and _manual_axes(a) == _manual_axes(b)


def shard_map_like(params: Mapping[str, Any], fun: Callable, in_specs, out_specs) -> Callable:
  """`jax.shard_map(fun)` on the mesh and manual axes of the shard_map with `params`
  (and its varying-axes check), with `in_specs` / `out_specs` for `fun`'s operands and
  its list of results."""
  return jax.shard_map(fun, mesh=params["mesh"], in_specs=tuple(in_specs),
                       out_specs=list(out_specs), axis_names=_manual_axes(params),
                       check_vma=params["check_vma"])


@contextlib.contextmanager
def inside_shard_map(params: Mapping[str, Any]):
  """Traces as `jax.shard_map` traces the body of the shard_map with `params`: its
  manual mesh axes bound (the body's collectives name them) and the varying axes of
  its values checked (a scan's carry keeps them). For rewriting nodes of that body
  apart from the shard_map (`loop_remat.rewrite` on a scan pair inside it)."""
  mesh, manual = params["mesh"], _manual_axes(params)
  inner = mesh.abstract_mesh.update_axis_types(
      {n: jax.sharding.AxisType.Manual for n in manual})
  bound = manual | set(getattr(mesh, "manual_axes", ()))
  with (_jax_core.extend_axis_env_nd([(k, v) for k, v in mesh.shape.items() if k in bound]),
        jax.sharding.use_abstract_mesh(inner), _jax_config._check_vma(params["check_vma"])):
    yield


def _concrete_shard_map(params: Mapping[str, Any], env: Mapping[str, int]) -> dict[str, Any]:
  """A shard_map's params at concrete shapes. Its body names mesh axes (a psum over
  "data"), which only a shard_map binds: it is re-traced through `jax.shard_map` itself,
  on the global shapes its local ones come from (each dim times its in_spec's split)."""
  body, mesh = params["jaxpr"], params["mesh"]
  specs = []
  for v, spec in zip(body.invars, params["in_specs"]):
    local = _concrete_aval(v.aval, env)
    split = sharding.mesh_divisors(mesh, spec, len(local.shape))
    specs.append(jax.ShapeDtypeStruct(tuple(n * d for n, d in zip(local.shape, split)),
                                      local.dtype))
  fun = shard_map_like(params, lambda *xs: _eval_jaxpr_concrete(body, (), xs, env),
                       params["in_specs"], params["out_specs"])
  closed = jax.make_jaxpr(fun)(*specs)
  eqns = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
  if len(eqns) != 1 or closed.consts:
    raise TracingError("a shard_map did not re-trace as one shard_map at concrete shapes")
  return dict(eqns[0].params)


def specialize_program(program: Program, env: Mapping[str, int]) -> Program:
  """`program` at concrete dims (cached: the same object for the same program and dims)."""
  return _SPECIALIZED.get(program, env, lambda: _make_specialized(program, env))


def _make_specialized(program: Program, env: Mapping[str, int]) -> Program:
  nodes = tuple(dataclasses.replace(
      n, params=concrete_params(n.params, env, n.name),
      subprograms=tuple(_make_specialized(p, env) for p in n.subprograms))
      for n in program.nodes)
  avals = {i: _concrete_aval(a, env) for i, a in program.avals.items()}
  return Program(program.inputs, nodes, program.outputs, avals)


# --- trace -----------------------------------------------------------------------

CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint"})


def has_checkpoints(closed_jaxpr) -> bool:
  """Whether a `jax.checkpoint` / `nn.remat` / `nnx.remat` region remains anywhere in
  the jaxpr (also inside loop bodies and calls)."""
  def walk(j) -> bool:
    for eqn in j.eqns:
      if eqn.primitive.name in CHECKPOINT_PRIMITIVES:
        return True
      for v in eqn.params.values():
        for b in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(b, (jcore.ClosedJaxpr, jcore.Jaxpr)) and walk(_closed(b)[0]):
            return True
    return False
  return walk(closed_jaxpr.jaxpr)


class _ProcessPatch:
  """`owner.name` replaced while any thread traces with it; JAX's own otherwise.

  The first thread in installs `replacement`, the last out restores the original (one
  lock for both). Since the attribute is process-wide, another thread tracing with
  plain JAX meanwhile calls `replacement` too: it must act as the original unless
  `requested()` (a per-thread count of the traces that asked for it) says otherwise.
  """

  def __init__(self, owner, name: str, replacement: Callable):
    self._owner, self._name, self._replacement = owner, name, replacement
    self._lock = threading.Lock()
    self._users = 0
    self._own = name in vars(owner)   # else a class attribute shows through: delete ours
    self.original = getattr(owner, name)   # what the replacement defers to
    self._local = threading.local()

  def requested(self) -> bool:
    return getattr(self._local, "depth", 0) > 0

  @contextlib.contextmanager
  def active(self):
    with self._lock:
      if not self._users:
        setattr(self._owner, self._name, self._replacement)
      self._users += 1
    self._local.depth = getattr(self._local, "depth", 0) + 1
    try:
      yield
    finally:
      self._local.depth -= 1
      with self._lock:
        self._users -= 1
        if not self._users:
          if self._own:
            setattr(self._owner, self._name, self.original)
          else:
            delattr(self._owner, self._name)


def _bind_checkpoint(*args, **params):
  """The checkpoint primitive's `bind`, which `jax.checkpoint` and its JVP call with the
  policy as a parameter: in a trace that asked to save everything, the policy is
  `everything_saveable`, so AD's own partial evaluation stacks and keeps the residuals
  the annotation would have recomputed, as if the region were not there."""
  if _SAVE_EVERYTHING.requested():
    params = dict(params, policy=jax.checkpoint_policies.everything_saveable,
                  prevent_cse=False)
  return _SAVE_EVERYTHING.original(*args, **params)


_SAVE_EVERYTHING = _ProcessPatch(_ad_checkpoint.remat_p, "bind", _bind_checkpoint)


def _canonicalize_dimension(dim):
  """JAX's `core._canonicalize_dimension` with symbolic dims answered first. JAX's tries
  `operator.index` and keeps the TypeError in a local: for a symbolic dim the exception,
  its traceback and the frame form a cycle, which keeps the frames of the whole call
  (and their tracers) until the cyclic collector runs. Tracing llama2_1b left 172,025
  such objects (3,409 TypeErrors), whose collection took 0.19-0.21 s of a restarted
  job's 1.2 s analysis. Same result for every input, so every thread may use it."""
  return dim if isinstance(dim, jax_dims.DimExpr) else _SYMBOLIC_DIMS_WITHOUT_CYCLES.original(dim)


_SYMBOLIC_DIMS_WITHOUT_CYCLES = _ProcessPatch(_jax_core, "_canonicalize_dimension",
                                              _canonicalize_dimension)
_JAX_CANONICALIZE_DIMENSION = _SYMBOLIC_DIMS_WITHOUT_CYCLES.original


def _rank_error(path, rank: int, written, shape) -> ShapeSpecError:
  return ShapeSpecError(
      f"the polymorphic shape for argument args{jax.tree_util.keystr(path)} has rank "
      f"{rank} ({written}) but the argument has shape {tuple(shape)}; "
      "write one entry per axis ('_' keeps an axis static, '...' keeps the rest)")


def _check_ranks(args, specs) -> None:
  paths = jax.tree_util.tree_flatten_with_path(args)[0]
  for (path, arg), spec in zip(paths, jax.tree_util.tree_leaves(specs)):
    shape = getattr(arg, "shape", None)
    if shape is not None and len(spec.shape) != len(shape):
      raise _rank_error(path, len(spec.shape), spec.shape, shape)


def _without_absent_keys(spec, arg):
  """`spec` without the dict keys `arg` lacks, wherever both are dicts: a batch's optional
  entries (a mask passed at some calls) may have specs, as jax.jit needs none."""
  if isinstance(spec, dict) and isinstance(arg, dict):
    return {k: _without_absent_keys(v, arg[k]) for k, v in spec.items() if k in arg}
  if (isinstance(spec, (tuple, list)) and isinstance(arg, (tuple, list))
      and len(spec) == len(arg)):
    items = [_without_absent_keys(v, a) for v, a in zip(spec, arg)]
    return type(spec)(*items) if hasattr(spec, "_fields") else type(spec)(items)   # namedtuple
  return spec


def _spec_entries(spec: str) -> tuple[int, bool]:
  """(axes named, whether '...' keeps the rest) of a shape spec string; commas inside
  an operation's parentheses do not count."""
  depth, parts, start = 0, [], 0
  for i, ch in enumerate(spec):
    depth += (ch == "(") - (ch == ")")
    if ch == "," and depth == 0:
      parts.append(spec[start:i])
      start = i + 1
  parts.append(spec[start:])
  parts = [p.strip() for p in parts]
  if parts and not parts[-1]:   # a trailing comma
    parts.pop()
  return sum(p != "..." for p in parts), "..." in parts


def _check_spec_ranks(args, polymorphic_shapes) -> None:
  """After jax.export refused the specs: a ShapeSpecError naming an argument whose spec
  string has another rank (jax.export's own message for a '_' on an axis the argument
  lacks names neither the argument nor its shape)."""
  def visit(path, spec, sub):
    if not isinstance(spec, str):
      return
    named, rest = _spec_entries(spec)
    for sub_path, leaf in jax.tree_util.tree_flatten_with_path(sub)[0]:
      shape = tuple(getattr(leaf, "shape", ()))
      if named > len(shape) or (named < len(shape) and not rest):
        raise _rank_error(path + sub_path, named, repr(spec), shape)
  prefix = tuple(polymorphic_shapes) if isinstance(polymorphic_shapes, list) else polymorphic_shapes
  try:
    jax.tree_util.tree_map_with_path(visit, prefix, args,
                                     is_leaf=lambda x: x is None or isinstance(x, str))
  except ShapeSpecError:
    raise
  except Exception:  # noqa: BLE001 - not a prefix of the arguments: jax.export's message
    pass


def scalars_as_arrays(tree) -> tuple[Any, list[Any], Any]:
  """(tree, its leaves, its structure) with Python numbers as the weakly typed scalars
  `jax.jit` traces them as (flax's `TrainState.create` keeps `step=0` a Python int);
  `tree` itself where there is none. One flatten: `symmem.jit` runs this on every call."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not any(isinstance(x, (bool, int, float, complex)) for x in leaves):
    return tree, leaves, treedef
  leaves = [jax.numpy.asarray(x) if isinstance(x, (bool, int, float, complex)) else x
            for x in leaves]
  return jax.tree_util.tree_unflatten(treedef, leaves), leaves, treedef


def symbolic_specs(args: Sequence[Any], polymorphic_shapes: Any, constraints=()):
  """`jax.export.symbolic_args_specs` with rank checks and clear errors. Weak types are
  kept, as `jax.jit` keeps them: a weakly typed scalar times a bfloat16 array stays
  bfloat16."""
  args, _, _ = scalars_as_arrays(tuple(args))
  for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise ShapeSpecError(
          f"argument args{jax.tree_util.keystr(path)} is {type(leaf).__name__}, not an array; "
          "pass arrays or jax.ShapeDtypeStruct, and mark non-array arguments static")
  if isinstance(polymorphic_shapes, (tuple, list)) and len(polymorphic_shapes) != len(args):
    raise ShapeSpecError(
        f"polymorphic_shapes {tuple(polymorphic_shapes)!r} has {len(polymorphic_shapes)} "
        f"entr{'y' if len(polymorphic_shapes) == 1 else 'ies'} for {len(args)} array "
        "arguments: give one per argument (None where no axis changes between calls)")
  polymorphic_shapes = _without_absent_keys(polymorphic_shapes, tuple(args))
  try:
    specs = export.symbolic_args_specs(tuple(args), polymorphic_shapes,
                                       constraints=constraints_lib.for_jax_export(constraints))
  except ValueError as e:
    _check_spec_ranks(tuple(args), polymorphic_shapes)   # '_' on a missing axis: name it
    if constraints:   # jax.export parses both: say which one it could not use
      try:
        export.symbolic_args_specs(tuple(args), polymorphic_shapes)
      except ValueError:
        pass
      else:
        constraints_lib.parse_constraints(tuple(constraints))   # our message, if ours fails too
        raise ConstraintError(f"constraints {tuple(constraints)!r} cannot be parsed by "
                              f"jax.export: {e}") from None
    raise ShapeSpecError(f"polymorphic_shapes {polymorphic_shapes!r} do not fit the arguments: {e}") from None
  _check_ranks(tuple(args), specs)
  return jax.tree_util.tree_map(
      lambda spec, x: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=spec.sharding,
                                           weak_type=True)
      if getattr(x, "weak_type", False) else spec, specs, args)


@collector.paused()
def trace(fun: Callable, *args, polymorphic_shapes, constraints=(),
          save_everything: bool = False) -> TracedProgram:
  """Traces `fun` once with symbolic dimensions.

  Args:
    fun: the function to trace (e.g. a training step).
    *args: arrays or `jax.ShapeDtypeStruct`s; only shapes and dtypes are used.
    polymorphic_shapes: a pytree prefix of `args` with shape specs as in
      `jax.export.symbolic_args_specs` ("b, s", "b, s, _"); None keeps an
      argument static.
    constraints: strings such as "s <= 4096", "b >= 2", "s == 128*k".
    save_everything: trace as if every `jax.checkpoint` region saved all it
      computes (the step without the user's rematerialization).

  Returns:
    A `TracedProgram` whose avals carry JAX symbolic dimensions.
  """
  # As symmem.jit reads them: a lone string is an error that says how to write it.
  constraints = constraints_lib.parse_constraints(constraints).source
  specs = symbolic_specs(args, polymorphic_shapes, constraints)
  dims = jax_dims.dims_of(specs)
  cons = constraints_lib.parse_constraints(tuple(constraints), variables=dims)
  constraints_lib.check_variables(tuple(constraints), dims)
  compare_lib.check_feasible(cons)   # general inequalities that can never hold
  name = function_name(fun)
  try:
    with (_SAVE_EVERYTHING.active() if save_everything else contextlib.nullcontext(),
          _SYMBOLIC_DIMS_WITHOUT_CYCLES.active()):
      closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*specs)
  except (jax_dims.InconclusiveDimensionOperation, jax_dims.UnexpectedDimVar,
          jax.errors.ConcretizationTypeError, TypeError, ValueError, RecursionError,
          NotImplementedError) as e:
    where = trace_advice.user_frame(e.__traceback__)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = trace_advice.advice(e, args, specs, constraints)
    if isinstance(polymorphic_shapes, str) and len(args) > 1:   # likely the cause
      what = (f"polymorphic_shapes={polymorphic_shapes!r} is one spec, which applies to every "
              f"argument (as in jax.export): give one per argument, None where no axis "
              f"changes, e.g. (None, {polymorphic_shapes!r}); else: {what}")
    raise TracingError(
        f"cannot trace {name} with symbolic dimensions {sorted(dims)}"
        + (f" at {where}" if where else "") + f": {first}\nWhat to do: {what}") from e
  in_tree = jax.tree_util.tree_structure(tuple(args))
  out_tree = jax.tree_util.tree_structure(out_shape)
  return TracedProgram(fun=fun, fun_name=name, program=ir.without_dead_code(flatten(closed)),
                       closed_jaxpr=closed,
                       in_specs=specs, in_tree=in_tree, out_tree=out_tree,
                       dims=tuple(sorted(dims)), constraints=cons)
