"""`symmem.jit`: a drop-in for `jax.jit` that plans memory once and decides per shape.

At the first call the step is traced once with symbolic dims and analysed
(schedule, rematerialization rounds). Every call then:

1. binds the dims from the arguments and checks the constraints;
2. reads the bytes other live arrays hold (device `memory_stats()` where the
   backend has them, `jax.live_arrays()` on CPU: DESIGN.md F6);
3. picks the smallest eviction round whose modeled peak fits the budget: the
   guard is resolved on the host, before dispatch, because inside one
   executable XLA plans memory statically and a `lax.cond` guard saves nothing
   (F5);
4. runs the executable compiled for (dims, round), compiling it on a miss.
   After compiling, XLA's own `memory_analysis()` is checked against the budget;
   if the variant does not fit, the round that XLA's figure predicts to fit is
   compiled next (bounded), ending with the last round. Only when XLA reports
   every variant tried, the last round included, over the budget does the call
   raise `BudgetError`: a variant over budget never runs.

Recomputation is fenced with optimization barriers and compiled with XLA:CPU's
`cse_barrier_expander` disabled, or XLA would merge it back (F1).
"""

from __future__ import annotations

import functools
import math
import re
import threading
from typing import Any, Callable, Mapping, Sequence

from absl import logging
import jax

from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import fence
from jax_symmem._src.device import agreed_footprint as _agreed_footprint
from jax_symmem._src.device import agreed_reserved as _agreed_reserved
from jax_symmem._src.device import device_memory as _device_memory
from jax_symmem._src.device import live_bytes as _live_bytes
from jax_symmem._src import interpret
from jax_symmem._src import sharding as sharding_lib
from jax_symmem._src import jax_dims
from jax_symmem._src import tracing
from jax_symmem._src.errors import BudgetError, ShapeError, ShapeSpecError, SymmemError
from jax_symmem._src.poly import Poly, Var

# XLA:CPU options for variants compiled under a memory budget: keep our fences
# (F1); XLA's memory-optimized scheduler (lowest real peak at most lengths in
# experiments/bench_fence.py); no XNNPACK fusions, whose buffers memory_analysis()
# does not count (F2), so the budget check sees real temps. They cost step time
# (0.52 s -> 0.66-0.71 s per option on the benchmark transformer), so without a
# budget the step compiles exactly as jax.jit would.
CPU_COMPILER_OPTIONS = {
    "xla_disable_hlo_passes": "cse_barrier_expander",
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    "xla_cpu_experimental_ynn_fusion_type": "",
}
GPU_COMPILER_OPTIONS: dict[str, str] = {}
MAX_RECOMPILES = 3
# Under a budget, a step whose modeled peak is at most 1/FAST_PATH_MARGIN of it
# needs no remat and skips the memory-optimized scheduler (it costs step time); it
# compiles as jax.jit would except for XNNPACK fusions, whose buffers memory_analysis()
# does not see (F2) and which used more memory than the model: b=2, s=512 on the
# bench transformer, 231.5 MiB real with them vs 192 modeled; 187.9 MiB XLA footprint
# without them, at the same step time (0.251 vs 0.259 s; 0.093 vs 0.081 s at s=256).
FAST_PATH_MARGIN = 2.0
FAST_PATH_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
IMPOSE_MIN_BYTES = 2**20


def resolve_budget(memory_budget) -> int | None:
  """Bytes; a float in (0, 1] is a fraction of the device's memory; None: the device limit."""
  _, limit = _device_memory()
  if memory_budget is None:
    return limit
  if isinstance(memory_budget, bool):
    raise TypeError("memory_budget must be bytes (int) or a fraction (float in (0, 1])")
  if isinstance(memory_budget, float):
    if not 0 < memory_budget <= 1:
      raise ValueError(f"a fractional memory_budget must be in (0, 1], got {memory_budget}")
    if limit is None:
      raise ValueError(
          f"memory_budget={memory_budget} is a fraction of device memory, but "
          f"{jax.devices()[0].platform} reports no memory limit; give the budget in bytes")
    return int(memory_budget * limit)
  if int(memory_budget) <= 0:
    raise ValueError(f"memory_budget must be positive, got {memory_budget}")
  return int(memory_budget)


class SymmemFunction:
  """The function returned by `symmem.jit`."""

  def __init__(self, fun: Callable, *, polymorphic_shapes, constraints=(), memory_budget=None,
               impose_schedule: bool = False, static_argnums=(), static_argnames=(),
               donate_argnums=(), in_shardings=None, out_shardings=None, plan_cache_dir=None,
               **jit_kwargs):
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._shapes = polymorphic_shapes
    self._constraints = tuple(constraints)
    self._budget_arg = memory_budget
    self._plan_cache_dir = plan_cache_dir
    self._static_argnums = tuple(sorted({static_argnums} if isinstance(static_argnums, int)
                                        else set(static_argnums)))
    self._static_argnames = ((static_argnames,) if isinstance(static_argnames, str)
                             else tuple(static_argnames))
    self._donate = ((donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums))
    self._jit_kwargs = jit_kwargs
    # As in jax.jit: prefix trees of the dynamic positional arguments / the outputs.
    self._in_shardings, self._out_shardings = in_shardings, out_shardings
    self._sharding_kwargs = {k: v for k, v in (("in_shardings", in_shardings),
                                               ("out_shardings", out_shardings)) if v is not None}
    self._arg_splits: dict[Any, tuple[int, ...]] = {}    # static key -> shards per leaf
    self._impose_schedule = impose_schedule
    self._lock = threading.RLock()
    self._analyses: dict[Any, analysis_lib.Analysis | None] = {}
    self._executables: dict[Any, Any] = {}
    self._decisions: dict[Any, int] = {}
    self._calibration: dict[Any, dict[int, float]] = {}   # static key -> round -> XLA/model
    self._variants: dict[Any, dict] = {}                  # executable key -> what it is
    self.last_call: dict | None = None                    # the most recent dispatch
    self._fallbacks: dict[Any, Callable] = {}
    self._spec_dtypes: dict[Any, tuple] = {}              # static key -> traced leaf dtypes
    self._refused: dict[Any, str] = {}                    # decision key -> BudgetError text
    self._counts = {"compiles": 0, "hits": 0, "fallback_calls": 0, "recompiles": 0,
                    "budget_errors": 0}

  # -- public --
  def __call__(self, *args, **kwargs):
    static_key, dyn_args, bound = self._split(args, kwargs)
    try:
      analysis = self._analysis(static_key, bound, dyn_args)
    except ShapeSpecError:
      self._check_arrays(dyn_args)   # a str or Python number: say so as jax.jit does (TypeError)
      raise
    if analysis is None:
      return self._call_fallback(static_key, args, kwargs)
    traced = analysis.traced
    flat, tree = jax.tree_util.tree_flatten(tuple(dyn_args))
    if tree != traced.in_tree:
      raise ShapeError(f"{traced.fun_name} was traced for arguments with structure "
                       f"{traced.in_tree}, but got {tree}")
    spec_dtypes = self._spec_dtypes.get(static_key)
    if spec_dtypes is None:
      spec_dtypes = self._spec_dtypes[static_key] = tuple(
          s.dtype for s in jax.tree_util.tree_leaves(traced.in_specs))
    if any(getattr(x, "dtype", None) != d for x, d in zip(flat, spec_dtypes)):
      # The executables are specialized to the traced dtypes: another dtype would be
      # reinterpreted by the traced program (e.g. bool -> int casts), never retraced.
      self._check_dtypes(traced, dyn_args, spec_dtypes)
    try:
      dims = traced.bind_dims(*dyn_args)
    except ShapeError:
      self._explain_shape_error(traced, dyn_args)
      raise
    budget = self._budget()
    reserved = 0
    if budget is not None:
      splits = self._arg_splits.get(static_key) or (1,) * len(flat)
      # Per device; NumPy arguments are not among the live arrays the probe counts.
      arg_bytes = sum(a.nbytes // d for a, d in zip(flat, splits) if isinstance(a, jax.Array))
      reserved = max(0, _live_bytes() - arg_bytes)
      # Arrays over several processes: the largest reading of any (device.py).
      reserved = _agreed_reserved(reserved, budget, flat)
    dims_key = tuple(sorted(dims.items()))
    key = (static_key, dims_key, reserved >> 20, budget)
    with self._lock:
      k = self._decisions.get(key)
      if key in self._refused:
        self._counts["budget_errors"] += 1
        raise BudgetError(self._refused[key])
      if k is None:
        k, _ = analysis.best_round(dims, budget, reserved, self._calibration.get(static_key))
      exe_key = (static_key, dims_key, k)
      exe = self._executables.get(exe_key)
      if exe is None:
        try:
          exe, k = self._compile(analysis, static_key, dims, k, args, flat, budget, reserved)
        except BudgetError as e:
          self._refused[key] = str(e)
          self._counts["budget_errors"] += 1
          raise
        except SymmemError:
          raise
        except Exception as e:  # e.g. a primitive whose params we cannot specialize: jax.jit
          self._fall_back(static_key, f"compiling at {dims}: {type(e).__name__}: {e}")
      else:
        self._counts["hits"] += 1
      if exe is not None:
        self._decisions[key] = k
    if exe is None:
      return self._call_fallback(static_key, args, kwargs)
    self.last_call = {"dims": dims, "round": k, "reserved": reserved, "budget": budget,
                      "xla_bytes": self._variants[(static_key, dims_key, k)]["xla_bytes"]}
    out = exe(*flat)
    return jax.tree_util.tree_unflatten(traced.out_tree, out)

  def analyze(self, *args, **kwargs) -> analysis_lib.Analysis:
    """The symbolic analysis for these (example) arguments."""
    static_key, dyn_args, bound = self._split(args, kwargs)
    a = self._analysis(static_key, bound, dyn_args)
    if a is None:
      raise SymmemError(f"{self.__name__} fell back to jax.jit; see the logged warning")
    return a

  def _budget(self) -> int | None:
    # The device's limit does not change while the process runs: resolve once.
    if not hasattr(self, "_resolved_budget"):
      self._resolved_budget = resolve_budget(self._budget_arg)
    return self._resolved_budget

  def cache_info(self) -> dict[str, int]:
    """Counts: compiles, cache hits, recompiles (a variant XLA reported over budget),
    calls that fell back to jax.jit, calls refused with BudgetError, executables."""
    return dict(self._counts, executables=len(self._executables))

  def variants(self) -> list[dict]:
    """Each compiled executable: dims, eviction round, XLA's footprint in bytes
    (`memory_analysis()`: arguments + outputs + temps - aliased) and whether it was
    compiled with the memory-saving options."""
    with self._lock:
      return [dict(v) for v in self._variants.values()]

  # -- implementation --
  def _split(self, args, kwargs):
    for name in kwargs:
      if name not in self._static_argnames:
        raise TypeError(f"symmem.jit supports keyword arguments only as static_argnames; "
                        f"pass {name!r} positionally or mark it static")
    static = tuple(args[i] for i in self._static_argnums if i < len(args))
    static_key = (static, tuple(sorted(kwargs.items())))
    try:
      hash(static_key)
    except TypeError as e:
      raise TypeError(f"static arguments must be hashable: {e}") from None
    dyn = [a for i, a in enumerate(args) if i not in self._static_argnums]
    # Closes over the static arguments only: the traced program keeps `bound`, and
    # holding the first call's arrays would keep them resident (and counted as
    # other live memory against the budget) for the life of the step.
    statics, nargs = {i: args[i] for i in self._static_argnums if i < len(args)}, len(args)
    def bound(*dyn_args):
      it = iter(dyn_args)
      return self._fun(*[statics[i] if i in statics else next(it) for i in range(nargs)], **kwargs)
    bound.__name__ = getattr(self._fun, "__name__", "function")
    return static_key, dyn, bound

  def _donated_leaves(self, args) -> tuple[int, ...]:
    """Flat leaf positions of the donated positional arguments (static ones excluded)."""
    if not self._donate:
      return ()
    leaves, start = [], 0
    for i, arg in enumerate(args):
      if i in self._static_argnums:
        continue
      n = len(jax.tree_util.tree_leaves(arg))
      if i in self._donate:
        leaves.extend(range(start, start + n))
      start += n
    return tuple(leaves)

  def _dyn_shapes(self, nargs):
    shapes = self._shapes
    if isinstance(shapes, (tuple, list)) and len(shapes) == nargs + len(self._static_argnums):
      shapes = tuple(s for i, s in enumerate(shapes) if i not in self._static_argnums)
    return shapes

  def _analysis(self, static_key, bound, dyn_args):
    with self._lock:
      if static_key in self._analyses:
        return self._analyses[static_key]
      try:
        if self._jit_kwargs:
          raise NotImplementedError(
              f"jax.jit options {sorted(self._jit_kwargs)} are not supported by the memory planner "
              "yet")
        # Sharded arguments: the memory model counts bytes per device (sharding.py).
        divisors = sharding_lib.argument_divisors(self._in_shardings, dyn_args)
        self._arg_splits[static_key] = tuple(math.prod(d) for d in divisors)
        result = analysis_lib.analyze_function(
            bound, *dyn_args, polymorphic_shapes=self._dyn_shapes(len(dyn_args)),
            constraints=self._constraints, memory_budget=self._budget(),
            argument_divisors=divisors, plan_cache_dir=self._plan_cache_dir)
      except (BudgetError, ShapeError, ValueError, TypeError):
        raise   # the caller's mistake: say so rather than fall back
      except Exception as e:  # an op the pipeline cannot handle: never a wrong result
        self._fall_back(static_key, f"{type(e).__name__}: {e}")
        result = None
      self._analyses[static_key] = result
      return result

  def _compile(self, analysis, static_key, dims, k, args, flat, budget, reserved):
    env = analysis.graph.constraints.complete(dims)
    platform = jax.devices()[0].platform
    memory_options = CPU_COMPILER_OPTIONS if platform == "cpu" else GPU_COMPILER_OPTIONS
    def options_for(k):
      """(compiler options, whether to calibrate the model from memory_analysis())."""
      if budget is None:
        return {}, False   # exactly as jax.jit; XNNPACK fusions may hide buffers (F2)
      if k == 0 and FAST_PATH_MARGIN * analysis.round_peak(0, dims) + reserved <= budget:
        # Calibration stays with the memory-option variants it is applied to.
        return (FAST_PATH_CPU_OPTIONS if platform == "cpu" else {}), False
      return memory_options, True
    donate = self._donated_leaves(args)
    calibration = self._calibration.setdefault(static_key, {})
    compiled = []   # (footprint, k, executable, options)
    last = len(analysis.rounds) - 1
    while True:
      r = analysis.rounds[k]
      options, truthful = options_for(k)
      program = tracing.specialize_program(r.program, env)
      order = analysis.round_order(k, dims)
      if self._impose_schedule:
        # Chain nodes whose results take >= 1 MiB through optimization barriers so XLA
        # follows our order (off by default: XLA's memory-optimized scheduler did as
        # well or better at 3 of 5 lengths in experiments/bench_fence.py).
        sizes = {v: r.graph.bytes(v).evaluate(env) for v in r.graph.values}
        run = fence.ordered_function(program, order,
                                     fence.significant_nodes(sizes, program, IMPOSE_MIN_BYTES))
        options = dict(options, **fence.FENCE_COMPILER_OPTIONS)
      else:
        run = lambda *a, program=program, order=order: interpret.run(program, a, order)
      fn = jax.jit(lambda *a, run=run: tuple(run(*a)), donate_argnums=donate,
                   **self._flat_shardings(args, analysis.traced))
      exe = fn.lower(*flat).compile(compiler_options=options)
      self._counts["compiles"] += 1
      ma = exe.memory_analysis()
      footprint = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                   - ma.alias_size_in_bytes) if ma is not None else 0
      footprint = _agreed_footprint(footprint, flat)   # same branch in every process
      # Calibrate: XLA fuses and schedules on its own, so its figure is the truth
      # (only when it sees every buffer: not with jax.jit's own options, F2).
      if truthful and footprint:
        calibration[k] = footprint / max(1, analysis.round_peak(k, dims))
      logging.info("jax_symmem: compiled %s at %s, round %d: XLA footprint %.1f MiB",
                   analysis.traced.fun_name, dims, k, footprint / 2**20)
      compiled.append((footprint, k, exe, options))
      if budget is None or footprint + reserved <= budget or len(compiled) > MAX_RECOMPILES:
        break
      # Over budget: jump to the first later round that XLA's figure for this one,
      # applied to the model, predicts to fit (else the last), not round by round.
      ratio = footprint / max(1, analysis.round_peak(k, dims))
      tried = {c[1] for c in compiled}
      nxt = next((j for j in range(k + 1, last + 1) if j not in tried
                  and ratio * analysis.round_peak(j, dims) + reserved <= budget), None)
      # Then the last round; then round 0, as jax.jit would compile the step (XLA may
      # fit it where the model says no: never refuse a step that jax.jit runs).
      nxt = next((j for j in (nxt, last, 0) if j is not None and j not in tried), None)
      if nxt is None:
        break
      k = nxt
      self._counts["recompiles"] += 1
    fitting = [c for c in compiled if budget is None or c[0] + reserved <= budget]
    if not fitting:
      footprint, k, _, _ = min(compiled, key=lambda c: c[0])
      raise BudgetError(
          f"{analysis.traced.fun_name} at {dict(dims)}: XLA's memory_analysis() reports "
          f"{footprint / 2**20:.1f} MiB for the smallest variant compiled (round {k} of {last}"
          + (", the planner's last" if last in {c[1] for c in compiled} else "")
          + f"), above the {budget / 2**20:.1f} MiB budget"
          + (f" less {reserved / 2**20:.1f} MiB held by other live arrays" if reserved else "")
          + "; raise the budget or use shorter/smaller batches")
    footprint, k, exe, options = min(fitting, key=lambda c: c[1])   # least recomputation
    self._executables[(static_key, tuple(sorted(dims.items())), k)] = exe
    self._variants[(static_key, tuple(sorted(dims.items())), k)] = {
        "dims": dict(dims), "round": k, "xla_bytes": footprint,
        "memory_options": bool(memory_options) and memory_options.items() <= options.items()}
    return exe, k

  def _flat_shardings(self, args, traced) -> dict[str, tuple]:
    """jax.jit's in/out_shardings for the flat-argument, flat-output executable."""
    out = {}
    if self._in_shardings is not None:
      dyn = tuple(a for i, a in enumerate(args) if i not in self._static_argnums)
      out["in_shardings"] = tuple(sharding_lib.broadcast_prefix(self._in_shardings, dyn))
    if self._out_shardings is not None:
      shaped = jax.tree_util.tree_unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
      out["out_shardings"] = tuple(sharding_lib.broadcast_prefix(self._out_shardings, shaped))
    return out

  def _fall_back(self, static_key, reason: str) -> None:
    """From now on this static key runs under plain jax.jit; says why, once."""
    with self._lock:
      if static_key in self._fallbacks:   # another thread's compile failed first
        return
      logging.warning("jax_symmem: %s falls back to jax.jit: %s",
                      getattr(self._fun, "__name__", "function"), reason)
      self._fallbacks[static_key] = jax.jit(
          self._fun, static_argnums=self._static_argnums, static_argnames=self._static_argnames,
          donate_argnums=self._donate, **self._sharding_kwargs, **self._jit_kwargs)
      self._analyses[static_key] = None

  def _call_fallback(self, static_key, args, kwargs):
    with self._lock:   # `+=` on a dict item is not atomic across threads
      self._counts["fallback_calls"] += 1
      self.last_call = {"fallback": True}
    return self._fallbacks[static_key](*args, **kwargs)

  # -- argument validation (error paths only: the hot path compares dtypes and nothing else) --
  def _where(self, path) -> str:
    """`args[i]...` with i the positional index the caller used (static arguments counted)."""
    i, seen = -1, -1
    while seen < path[0].idx:
      i += 1
      seen += i not in self._static_argnums
    return f"args[{i}]{jax.tree_util.keystr(path[1:])}"

  def _check_arrays(self, dyn_args) -> None:
    """TypeError for a leaf that is not an array (jax.jit raises TypeError for a str too)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tuple(dyn_args))[0]:
      if hasattr(x, "shape") and hasattr(x, "dtype"):
        continue
      if isinstance(x, (bool, int, float, complex)):
        # jax.jit would trace it as a weakly typed scalar; jax.export's specs drop weak
        # types, so tracing it as f32/i32 could change the result dtype: refuse instead.
        raise TypeError(
            f"{self.__name__}: argument {self._where(path)} is a Python {type(x).__name__} "
            f"({x!r}); symmem.jit traces array arguments only: pass jnp.asarray({x!r}, dtype) for "
            "a value that changes between calls, or mark it static (static_argnums) for a constant")
      raise TypeError(
          f"{self.__name__}: argument {self._where(path)} of type {type(x).__name__} ({x!r:.40}) "
          "is not an array; mark it static with static_argnums/static_argnames")

  def _check_dtypes(self, traced, dyn_args, spec_dtypes) -> None:
    self._check_arrays(dyn_args)
    paths = jax.tree_util.tree_flatten_with_path(tuple(dyn_args))[0]
    for (path, x), want in zip(paths, spec_dtypes):
      if jax.dtypes.canonicalize_dtype(x.dtype) != want:   # float64 is float32 without x64
        raise TypeError(
            f"{traced.fun_name}: argument {self._where(path)} has dtype {x.dtype}, but it was "
            f"traced for {want}; symmem.jit traces once per static arguments: cast it "
            f"(x.astype({want})) or use a separate symmem.jit for the other dtype")

  def _explain_shape_error(self, traced, dyn_args) -> None:
    """A clearer ShapeError for an axis traced static whose size changed, or a size that
    is no multiple its spec declares (e.g. 8*k from 's == 8*k')."""
    paths = jax.tree_util.tree_flatten_with_path(tuple(dyn_args))[0]
    for (path, x), spec in zip(paths, jax.tree_util.tree_leaves(traced.in_specs)):
      shape = tuple(getattr(x, "shape", ()))
      if len(shape) != len(spec.shape):
        continue
      for axis, (d, n) in enumerate(zip(spec.shape, shape)):
        where = f"{traced.fun_name}: argument {self._where(path)} has shape {shape}, but axis {axis}"
        if isinstance(d, int):
          if d != n:
            raise ShapeError(
                f"{where} was traced as a constant {d} (polymorphic_shapes gives it '_', a number "
                "or None); a size that changes between calls must be a symbolic dim in "
                "polymorphic_shapes, e.g. 'b, s'")
          continue
        p = jax_dims.to_poly(d)
        if len(p.variables()) != 1 or p.degree() != 1:
          continue
        (v,) = p.variables()
        coeff = p.as_dict().get(((Var(v), 1),))
        rest = (p - coeff * Poly.var(v)).evaluate({})
        if coeff and ((n - rest) % coeff or (n - rest) // coeff < 1):
          declared = [c for c in self._constraints if re.search(rf"\b{v}\b", c)]
          raise ShapeError(f"{where} must be {p} for some integer {v} >= 1 (constraints: "
                           f"{', '.join(declared) or 'none'}), and {n} is not")


def jit(fun: Callable | None = None, *, polymorphic_shapes, constraints=(), memory_budget=None,
        impose_schedule: bool = False, plan_cache_dir=None, **jax_jit_kwargs):
  """Like `jax.jit`, for steps whose shapes change: one symbolic plan, a decision per shape.

  Args:
    fun: the step function (or use as `@symmem.jit(polymorphic_shapes=...)`).
    polymorphic_shapes: shape specs as in `jax.export.symbolic_args_specs`
      ("b, s"), one per positional argument (None for static or fully static args).
    constraints: e.g. ("s <= 4096", "b <= 64", "s == 128*k").
    memory_budget: bytes, or a float in (0, 1] as a fraction of device memory;
      default the device's limit where known, otherwise no eviction.
    impose_schedule: fence jax_symmem's memory-aware order into XLA with
      optimization barriers instead of leaving the order to XLA's scheduler.
    plan_cache_dir: a directory where memory plans are kept across processes
      (default $JAX_SYMMEM_PLAN_CACHE; neither: no cache). A restarted job replays
      the stored plan instead of planning again; with JAX's persistent compilation
      cache (`jax_compilation_cache_dir`) it also skips XLA's compiles.
    **jax_jit_kwargs: static_argnums, static_argnames, donate_argnums, in_shardings and
      out_shardings as in jax.jit. With shardings (or sharded arguments) the memory
      model and the budget are per device.
  """
  if fun is None:
    return functools.partial(jit, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
                             memory_budget=memory_budget, impose_schedule=impose_schedule,
                             plan_cache_dir=plan_cache_dir, **jax_jit_kwargs)
  return SymmemFunction(fun, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
                        memory_budget=memory_budget, impose_schedule=impose_schedule,
                        plan_cache_dir=plan_cache_dir, **jax_jit_kwargs)
