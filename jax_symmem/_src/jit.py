"""`symmem.jit`: a drop-in for `jax.jit` that plans memory once and decides per shape.

At the first call the step is traced once with symbolic dims and analysed
(schedule, rematerialization rounds; without a `memory_budget` the plan is made only
where something reads it, `analysis.Planning`, `_as_written_first`). Every call then:

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
   compiled next (a few jumps, then every other round). Only when XLA reports
   every round over the budget (or the step's arguments and outputs alone) does
   the call raise `BudgetError`: a variant over budget never runs.
5. with `speed_trials=True`, a shape that comes back also runs its least-memory
   round (an annotated step: its round as written), in turn with the dispatched one
   on timed calls, and keeps the faster (`speed_trial.py`): fewer FLOPs recomputed is
   not always faster on XLA.

Recomputation is fenced with optimization barriers and compiled with XLA:CPU's
`cse_barrier_expander` disabled, or XLA would merge it back (F1).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import math
import threading
import time
import types
from typing import Any, Callable

from absl import logging
import jax

from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import budget as budget_lib
from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src.device import agreed_footprint as _agreed_footprint
from jax_symmem._src.device import array_bytes as _array_bytes
from jax_symmem._src.device import agreed_reserved as _agreed_reserved
from jax_symmem._src.device import agreed_seconds as _agreed_seconds
from jax_symmem._src.device import device_memory as _device_memory
from jax_symmem._src.device import live_bytes as _live_bytes
from jax_symmem._src import sharding as sharding_lib
from jax_symmem._src import speed_trial as speed_trial_lib
from jax_symmem._src import tracing
from jax_symmem._src import validation
from jax_symmem._src import variants as variants_lib
from jax_symmem._src.errors import (BudgetError, PlanningError, ShapeError, ShapeSpecError,
                                    SymmemError)
# The compile policy's constants, where callers have always found them.
from jax_symmem._src.variants import (  # noqa: F401
    CPU_COMPILER_OPTIONS, FAST_PATH_CPU_OPTIONS, GPU_COMPILER_OPTIONS,
    IMPOSE_MIN_BYTES, MAX_RECOMPILES)


def resolve_budget(memory_budget) -> int | None:
  """Bytes; a float in (0, 1] is a fraction of the device's memory; a string a size
  ('200MiB'); None: the device limit."""
  memory_budget = budget_lib.parse(memory_budget)
  _, limit = _device_memory()
  if memory_budget is None:
    return limit
  if isinstance(memory_budget, float):
    if limit is None:
      raise ValueError(
          f"memory_budget={memory_budget} is a fraction of device memory, but "
          f"{jax.devices()[0].platform} reports no memory limit; give the budget in bytes")
    return int(memory_budget * limit)
  return memory_budget


@dataclasses.dataclass
class _Entry:
  """Everything `symmem.jit` keeps for one set of static arguments."""
  analysis: analysis_lib.Analysis | None          # None: this key runs under jax.jit
  arg_splits: tuple[int, ...] = ()                # shards per argument leaf (sharding)
  spec_dtypes: tuple | None = None                # the traced leaf dtypes
  fallback: Callable | None = None
  # "fusions" -> the largest (XLA's figure + XNNPACK's bound) / prediction of round 0
  # compiled with XLA:CPU's XNNPACK fusions (`variants.compile_with_fusions`).
  ratios: dict[str, float] = dataclasses.field(default_factory=dict)
  # Rounds compile with XLA:CPU's other scheduler: the last search that fitted only with it
  # said so (`variants._with_the_other_scheduler`), so later shapes start from it.
  other_scheduler: bool = False
  # Per XLA:CPU scheduler (True: the other one): round -> XLA/model, and round -> the peak
  # it was measured at. A ratio measured with one scheduler does not scale the other's.
  calibrations: dict[bool, variants_lib.Calibration] = dataclasses.field(
      default_factory=lambda: {False: variants_lib.Calibration(), True: variants_lib.Calibration()})
  # The step as written compiled before the plan (`_as_written_first`): (the prediction
  # made without planning, XLA's figure less it) at the largest such shape so far, which
  # corrects the next shape's prediction (`_predicted_over`).
  unplanned_offset: tuple[int, int] | None = None
  variants: dict[tuple, variants_lib.Variant] = dataclasses.field(default_factory=dict)
  # (dims, reserved MiB, budget) -> the round dispatched, or the BudgetError it raised.
  decisions: dict[tuple, int] = dataclasses.field(default_factory=dict)
  refused: dict[tuple, str] = dataclasses.field(default_factory=dict)
  # (dims, reserved MiB, budget) -> [(round, XLA's figure)] compiled there, while a round
  # that recomputes less than the one dispatched may still fit (`_refine`).
  searches: dict[tuple, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
  refinements: dict[tuple, int] = dataclasses.field(default_factory=dict)   # compiles per key
  # Speed trials (`speed_trials=True`): the keys whose trial is running, and those settled
  # (key -> {round: fastest call's seconds}; {} where no trial could run).
  trials: dict[tuple, speed_trial_lib.SpeedTrial] = dataclasses.field(default_factory=dict)
  timed: dict[tuple, dict[int, float]] = dataclasses.field(default_factory=dict)
  # (dims, the leaves' types) -> the bytes per device of the leaves that are jax.Arrays:
  # what a budgeted call subtracts from the live bytes, summed once per shape.
  arg_bytes: dict[tuple, int] = dataclasses.field(default_factory=dict)
  # (shape, dtype) per leaf of a batch with an empty axis -> XLA's figure as jax.jit compiles it.
  empty_footprints: dict[tuple, int] = dataclasses.field(default_factory=dict)

  @property
  def calibration(self) -> variants_lib.Calibration:
    """That of the scheduler the step's rounds now compile with."""
    return self.calibrations[self.other_scheduler]


def _positions_and_names(fun, argnums, argnames, option: str = "static"
                         ) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """As jax.jit does: arguments given by position also by name, and by name also by
  position, from `fun`'s signature, so a static argument may be passed either way; a
  name or position the signature lacks is jax.jit's ValueError (`option`: "static" or
  "donate", for the message)."""
  argnums = {argnums} if isinstance(argnums, int) else set(argnums)
  argnames = [argnames] if isinstance(argnames, str) else list(argnames)
  sig = signature(fun)
  if sig is None:   # as given
    return tuple(sorted(argnums)), tuple(argnames)
  params = list(sig.parameters.values())
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  kinds = {p.kind for p in params}
  if inspect.Parameter.VAR_KEYWORD not in kinds:
    invalid = set(argnames) - {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
    if invalid:
      raise ValueError(f"Jitted function has invalid argnames {invalid} in {option}_argnames. "
                       "Function does not take these args.")
  if inspect.Parameter.VAR_POSITIONAL not in kinds and any(
      i >= len(positional) or i < -len(positional) for i in argnums):
    raise ValueError(f"Jitted function has {option}_argnums={tuple(sorted(argnums))}, but only "
                     f"accepts {len(positional)} positional arguments.")
  if any(i < 0 for i in argnums):
    # jax.jit counts a negative index from the end of each call's positional arguments:
    # from the end of the parameters where a call passes them all.
    if not positional or any(p.kind is p.VAR_POSITIONAL for p in params):
      raise TypeError(f"{tracing.function_name(fun)}: argnums {sorted(argnums)} count from the "
                      "end of a fixed list of positional parameters, and it has none; count "
                      "from 0")
    argnums = {i % len(positional) for i in argnums}
  names = [p.name for p in positional]
  argnums |= {names.index(n) for n in argnames if n in names}
  argnames += [positional[i].name for i in sorted(argnums) if 0 <= i < len(positional)
               and positional[i].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
               and positional[i].name not in argnames]
  return tuple(sorted(argnums)), tuple(argnames)


def signature(fun) -> inspect.Signature | None:
  """`fun`'s signature, or None where it has none (some builtins)."""
  try:
    return inspect.signature(fun)
  except (TypeError, ValueError):   # no signature (some builtins)
    return None


def positional_count(sig: inspect.Signature | None) -> int:
  """How many parameters of a signature take positional arguments (0 without one)."""
  return 0 if sig is None else sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                   for p in sig.parameters.values())


def bind_keywords(sig: inspect.Signature | None, args: tuple, kwargs: dict,
                  static_argnums=(), static_argnames=()) -> tuple[tuple, dict]:
  """(args, kwargs) with each dynamic keyword argument at its parameter's position
  (`keyword_plan`)."""
  return apply_keyword_plan(
      keyword_plan(sig, args, kwargs, static_argnums, static_argnames), args, kwargs)


def keyword_plan(sig: inspect.Signature | None, args: tuple, kwargs: dict,
                 static_argnums=(), static_argnames=()) -> tuple[tuple[str | None, Any], ...]:
  """What goes at each position after `args`, up to the last that a dynamic keyword
  argument takes: (its keyword, None), or (None, the parameter's default); () where no
  keyword argument is dynamic.

  jax.jit traces keyword arguments as it traces positional ones. Here shape specs,
  shardings and donation are given per position, so a dynamic keyword argument is
  passed at the position Python would bind it to; the parameters between the
  positional arguments and it take their keyword arguments, or their defaults where
  that changes nothing jax.jit would trace: a static parameter's, or a default without
  arrays (None). Static keyword arguments after the last dynamic one stay keywords.
  The plan depends on the number of positional arguments and the keywords alone."""
  dynamic = [name for name in kwargs if name not in static_argnames]
  if not dynamic:
    return ()
  if sig is None:
    raise TypeError(f"the step's parameters cannot be read, so keyword arguments can only be "
                    f"static_argnames; pass {dynamic[0]!r} positionally or mark it static")
  sig.bind(*args, **kwargs)   # a call Python would refuse: Python's TypeError
  params = list(sig.parameters.values())
  position = {p.name: i for i, p in enumerate(params) if p.kind is p.POSITIONAL_OR_KEYWORD}
  for name in dynamic:
    if name not in position:
      raise TypeError(
          f"{name!r} has no position among the step's parameters (keyword-only, or taken "
          "by **kwargs); shape specs, shardings and donation are per position, so a "
          "dynamic argument needs one: pass it to a positional parameter, or mark it static")
  plan = []
  for i in range(len(args), max(position[name] for name in dynamic) + 1):
    p = params[i]
    if p.name in kwargs:
      plan.append((p.name, None))
    elif (i in static_argnums or p.name in static_argnames
          or not jax.tree_util.tree_leaves(p.default)):
      plan.append((None, p.default))
    else:
      later = next(name for name in dynamic if position[name] > i)
      raise TypeError(
          f"{later!r} is passed by keyword and goes to its position, but {p.name!r} before it "
          f"is not passed and its default ({p.default!r}) would become a traced argument; "
          f"pass {p.name!r} too, or mark it static")
  return tuple(plan)


def apply_keyword_plan(plan, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
  if not plan:
    return args, kwargs
  taken = {name for name, _ in plan if name is not None}
  return ((*args, *(kwargs[name] if name is not None else default for name, default in plan)),
          {k: v for k, v in kwargs.items() if k not in taken})


def _jax_jit_trace_error(fun: Callable, args) -> Exception | None:
  """The error jax.jit's trace of `fun` raises at these arguments (a shape mismatch in
  the step, data-dependent shapes), or None: where the symbolic trace failed, this tells
  the step's own errors from the symbolic dims' (which falling back to jax.jit solves)."""
  try:
    jax.jit(fun).trace(*args)
  except Exception as e:  # noqa: BLE001 - whatever the step raises, the caller gets
    return e
  return None


# jax.jit's keyword options (a name outside them is a TypeError, as jax.jit raises one).
_JAX_JIT_OPTIONS = tuple(p for p in inspect.signature(jax.jit).parameters if p != "fun")
# Options that leave the traced program alone: every executable is compiled with them.
# (A compiler option the round's own XLA options also set takes the round's value: those
# keep XLA's memory figure honest, e.g. no XNNPACK fusions whose buffers it leaves out.)
_COMPILE_OPTIONS = ("keep_unused", "inline", "compiler_options")


def _check_jit_options(jit_kwargs) -> None:
  unknown = sorted(set(jit_kwargs) - set(_JAX_JIT_OPTIONS))
  if unknown:
    raise TypeError(f"symmem.jit got unexpected keyword argument(s) {', '.join(unknown)}; "
                    f"jax.jit's options are {', '.join(_JAX_JIT_OPTIONS)}")


def _least_recomputing_fit(entry: _Entry, analysis, dims, dims_key, room: int):
  """The variant compiled at dims that comes first on the ladder (recomputes least) among
  those whose XLA figure fits in `room` (the budget less the other live bytes), or None."""
  first = entry.variants.get((dims_key, 0))
  if first is not None and first.xla_bytes <= room:   # round 0 leads every ladder: no plan read
    return first
  for k in analysis.ladder(dims):
    variant = entry.variants.get((dims_key, k))
    if variant is not None and variant.xla_bytes <= room:
      return variant
  return None


def _dtypes_match(entry: _Entry, flat) -> bool:
  """Whether the leaves have the dtypes `entry` was traced for (one that fell back: yes,
  jax.jit traces anew for other dtypes itself)."""
  if entry.analysis is None:
    return True
  if entry.spec_dtypes is None:
    entry.spec_dtypes = tuple(
        s.dtype for s in jax.tree_util.tree_leaves(entry.analysis.traced.in_specs))
  return all(getattr(x, "dtype", None) == d for x, d in zip(flat, entry.spec_dtypes))


class SymmemFunction:
  """The function returned by `symmem.jit`."""

  def __init__(self, fun: Callable, *, polymorphic_shapes, constraints=(), memory_budget=None,
               impose_schedule: bool = False, static_argnums=(), static_argnames=(),
               donate_argnums=(), donate_argnames=(), in_shardings=None, out_shardings=None,
               plan_cache_dir=None, speed_trials: bool = False, **jit_kwargs):
    _check_jit_options(jit_kwargs)
    functools.update_wrapper(self, fun)
    self.__name__ = tracing.function_name(fun)   # a partial has none of its own
    self._fun = fun
    self._signature = signature(fun)
    self._keyword_plans: dict[tuple, tuple] = {}   # `_bind_keywords`
    self._positional_params = positional_count(self._signature)
    self._shapes = polymorphic_shapes
    # Malformed constraints (or one string for a tuple of them) fail here, not at a call.
    self._constraints = constraints_lib.parse_constraints(constraints).source
    self._budget_arg = memory_budget
    budget_lib.parse(memory_budget)   # a malformed budget fails here, not at the first call
    self._plan_cache_dir = plan_cache_dir
    self._static_argnums, self._static_argnames = _positions_and_names(
        fun, static_argnums, static_argnames)
    # Donated arguments are passed positionally (keyword arguments are static ones).
    self._donate, _ = _positions_and_names(fun, donate_argnums, donate_argnames, "donate")
    # Passed to every compile; the rest (device, backend) fall back to jax.jit.
    self._compile_kwargs = {k: jit_kwargs.pop(k) for k in _COMPILE_OPTIONS if k in jit_kwargs}
    self._jit_kwargs = jit_kwargs
    # As in jax.jit: prefix trees of the dynamic positional arguments / the outputs.
    self._in_shardings, self._out_shardings = in_shardings, out_shardings
    self._sharding_kwargs = {k: v for k, v in (("in_shardings", in_shardings),
                                               ("out_shardings", out_shardings)) if v is not None}
    self._impose_schedule = impose_schedule
    self._speed_trials = speed_trials
    self._lock = threading.RLock()
    self._entries: dict[Any, _Entry] = {}                 # static key -> its state
    self.last_call: dict | None = None                    # the most recent dispatch
    self._counts = {"compiles": 0, "hits": 0, "fallback_calls": 0, "recompiles": 0,
                    "refinements": 0, "budget_errors": 0, "speed_trials": 0, "traced_calls": 0,
                    "empty_batches": 0}
    self._jax_jit: Callable | None = None   # the step under plain jax.jit (`_as_jax_jit`)
    # jax.clear_caches() drops this step's traces, plans and executables too.
    self._cleared_by_jax = tracing.cleared_by_jax(self.clear_cache, "symmem.jit")

  # -- public --
  def __repr__(self) -> str:   # as jax.jit's, with what makes it symmem's
    budget = "" if self._budget_arg is None else f", memory_budget={self._budget_arg!r}"
    return (f"<SymmemFunction of {self._fun!r} (polymorphic_shapes={self._shapes!r}"
            f"{budget})>")

  def __get__(self, instance, owner=None):
    """A method binds its instance as its first argument, as functions and jax.jit's bind
    (static with `static_argnums=0`, None for it in `polymorphic_shapes`)."""
    return self if instance is None else types.MethodType(self, instance)

  def __call__(self, *args, **kwargs):
    if jax.config.jax_disable_jit:   # as under jax.jit: the step runs as Python, op by op
      return self._fun(*args, **kwargs)
    try:
      return self._call(args, kwargs)
    except tracing.InternalFloatingPointError as e:   # jax_debug_nans: as jax.jit says it
      tracing.raise_floating_point_error(e, self._fun, args, kwargs)

  def _call(self, args, kwargs):
    if kwargs:
      try:
        args, kwargs = self._bind_keywords(args, kwargs)
      except TypeError:   # inside a transformation jax.jit takes any keyword: so do we
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
          return self._call_traced(args, kwargs)
        raise
    static_key, dyn_args, flat, bound, traced = self._split(args, kwargs)
    if traced:
      return self._call_traced(args, kwargs)
    try:
      entry = self._entry_for(static_key, bound, dyn_args, flat, len(args))
    except ShapeSpecError:
      validation.check_arrays(self._caller(), dyn_args)   # a str or Python number: TypeError
      raise
    if entry.analysis is None:
      return self._call_fallback(entry, args, kwargs)
    analysis = entry.analysis
    traced = analysis.traced
    try:
      dims = traced.bind_dims(*dyn_args)
    except ShapeError:
      if validation.is_empty_batch(traced, dyn_args):
        return self._call_empty(entry, args, kwargs, flat)
      validation.explain_shape_error(self._caller(), traced, dyn_args)
      raise
    budget = self._budget()
    dims_key = tuple(sorted(dims.items()))
    reserved = 0 if budget is None else self._reserved(entry, flat, dims_key, budget)
    key = (dims_key, reserved >> 20, budget)
    try:
      with self._lock:
        if key in entry.refused:
          self._counts["budget_errors"] += 1
          raise BudgetError(entry.refused[key])
        k = entry.decisions.get(key)
        first = k is None and self._as_written_first(analysis, budget)
        over = self._predicted_over(entry, dims, args, budget, reserved) if first else None
        unplanned = first and over is None
        if unplanned:
          k = 0   # the step as written, the first round of every ladder
        elif k is None:
          scale = entry.calibration.ratios
          if over is not None:   # round 0 is the step as written: predicted at least so
            scale = {**scale, 0: max(scale.get(0, 1.0),
                                     over / max(1, analysis.dispatch_figure(0, dims)))}
          k, _ = analysis.best_round(dims, budget, reserved, scale, predicted=True)
        variant = entry.variants.get((dims_key, k))
        fusions = True
        if variant is not None and budget is not None:
          if variant.xnnpack_fusions and variant.xla_bytes + reserved > budget:
            # Compiled with XNNPACK's fusions under more room (fewer other live bytes).
            variant, fusions = None, False
          else:
            # A decision holds for a whole MiB of readings: at this one, the compiled
            # variant that recomputes least among those XLA's figure fits (an earlier
            # round where other arrays hold less now; never one over the budget).
            fitting = _least_recomputing_fit(entry, analysis, dims, dims_key, budget - reserved)
            if fitting is None:   # none compiled fits: compile from the next round on
              ladder = analysis.ladder(dims)
              k = ladder[min(ladder.index(variant.round) + 1, len(ladder) - 1)]
            variant = fitting
        if variant is None:
          try:
            variant = self._compile(entry, key, dims, k, args, flat, budget, reserved, fusions,
                                    unplanned and not analysis.planning.done)
          except BudgetError as e:
            entry.refused[key] = str(e)
            self._counts["budget_errors"] += 1
            raise
          except SymmemError:
            raise
          except Exception as e:  # e.g. a primitive whose params we cannot specialize: jax.jit
            self._fall_back(entry, f"compiling at {dims}: {type(e).__name__}: {e}")
        else:
          self._counts["hits"] += 1
          if key in entry.searches:
            variant = self._refine(entry, key, dims, variant, args, flat, budget, reserved)
          elif self._trial_due(entry, key):
            return self._trial_call(entry, key, dims, variant, args, flat, budget, reserved)
        if variant is not None:
          entry.decisions[key] = variant.round
        pending = self._pending(entry, key)
    except PlanningError as e:   # the plan, made now where first read, failed: jax.jit
      self._fall_back(entry, f"planning at {dims}: {e}")
      return self._call_fallback(entry, args, kwargs)
    if variant is None:
      return self._call_fallback(entry, args, kwargs)
    out = self._run(entry, dims, variant, flat, budget, reserved)
    self.last_call["pending"] = pending
    return out

  def analyze(self, *args, **kwargs) -> analysis_lib.Analysis:
    """The symbolic analysis for these (example) arguments."""
    args, kwargs = self._bind_keywords(args, kwargs)
    static_key, dyn_args, flat, bound, _ = self._split(args, kwargs)
    entry = self._entry_for(static_key, bound, dyn_args, flat, len(args))
    if entry.analysis is None:
      raise SymmemError(f"{self.__name__} fell back to jax.jit; see the logged warning")
    return entry.analysis

  def eval_shape(self, *args, **kwargs):
    """The outputs' shapes and dtypes, as `jax.jit(fun).eval_shape` gives them (nothing
    is traced symbolically, planned or compiled)."""
    return self._as_jax_jit().eval_shape(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """Not available: which executable runs is decided per call."""
    raise NotImplementedError(
        f"{self.__name__}: symmem.jit has no single lowering: each call's shape (and, under a "
        "budget, the memory free) picks an executable. For what was compiled use "
        ".compiled(b=..., s=...) (each with .executable.memory_analysis()) or .variants(); "
        "for the plan, .analyze(*args); for jax.jit's own lowering, "
        "jax.jit(step.__wrapped__).lower(*args)")

  trace = lower

  def cache_info(self) -> dict[str, int]:
    """Counts: compiles, cache hits, recompiles (a first call's compiles after the
    first: XLA reported a variant over budget), refinements (compiles on a shape's later
    calls of a round that recomputes less, `_refine`), calls that fell back to jax.jit,
    calls refused with BudgetError, speed trials settled (`speed_trials=True`), calls
    traced into an enclosing transformation (`traced_calls`: run as jax.jit), calls with
    an empty batch (`empty_batches`: run as jax.jit compiles the step), executables."""
    with self._lock:
      return dict(self._counts, executables=sum(len(e.variants) for e in self._entries.values()))

  def speed_trial_results(self) -> list[dict]:
    """Each settled speed trial (`speed_trials=True`): dims, the reserved MiB and budget
    it ran under, each round's fastest timed call in seconds, and the round the shape kept."""
    with self._lock:
      return [{"dims": dict(key[0]), "reserved_mib": key[1], "budget": key[2],
               "fastest_s": dict(seconds), "kept": e.decisions.get(key)}
              for e in self._entries.values() for key, seconds in e.timed.items() if seconds]

  def variants(self) -> list[dict]:
    """Each compiled executable: dims, eviction round, XLA's footprint in bytes
    (`memory_analysis()`: arguments + outputs + temps - aliased), whether it was
    compiled with the memory-saving options, and the XLA options it was compiled with
    (`compiler_options`; {} exactly as jax.jit)."""
    with self._lock:
      return [v.describe() for e in self._entries.values() for v in e.variants.values()]

  def compiled(self, **dims: int) -> list[variants_lib.Variant]:
    """The variants compiled at dims matching these (all when none are given: `b=4`
    alone gives every length at b=4), with their executables (`.executable`: e.g.
    `.as_text()`, `.memory_analysis()`). ValueError for a dim no trace has."""
    with self._lock:
      known = {d for e in self._entries.values() if e.analysis is not None
               for d in e.analysis.traced.dims}
      unknown = sorted(set(dims) - known)
      if unknown and known:
        raise ValueError(f"{self.__name__} has no dim {', '.join(map(repr, unknown))}; its "
                         f"dims are {', '.join(sorted(known))}")
      return [v for e in self._entries.values() for v in e.variants.values()
              if all(v.dims.get(k) == x for k, x in dims.items())]

  def clear_cache(self) -> None:
    """Drops every trace, plan and executable, as jax.jit's `clear_cache` drops its
    executables: the next call traces, plans and compiles anew (`cache_info()` counts on).
    `jax.clear_caches()` calls it for every live step."""
    with self._lock:
      self._entries.clear()
      if self._jax_jit is not None:
        self._jax_jit.clear_cache()

  def calibration(self) -> list[dict[int, float]]:
    """Per set of static arguments: round -> XLA's footprint / the predicted one
    (`Analysis.dispatch_figure`: `round_footprint`, or the modeled peak), from
    the variants compiled under a budget, whose XLA options let memory_analysis() see
    every buffer (what `best_round` scales by); not from variants compiled exactly as
    jax.jit (no budget)."""
    with self._lock:
      return [dict(e.calibration.ratios) for e in self._entries.values()
              if e.analysis is not None]

  # -- implementation --
  def _caller(self) -> validation.Caller:
    return validation.Caller(self.__name__, self._static_argnums, self._constraints)

  def _budget(self) -> int | None:
    # The device's limit does not change while the process runs: resolve once.
    if not hasattr(self, "_resolved_budget"):
      self._resolved_budget = resolve_budget(self._budget_arg)
    return self._resolved_budget

  def _bind_keywords(self, args, kwargs):
    # A training loop calls with the same keywords every step: the plan is kept per
    # (number of positional arguments, keywords) and replayed.
    key = (len(args), tuple(kwargs))
    plan = self._keyword_plans.get(key)
    if plan is None:
      plan = keyword_plan(self._signature, args, kwargs, self._static_argnums,
                          self._static_argnames)
      if len(self._keyword_plans) < 64:
        self._keyword_plans[key] = plan
    return apply_keyword_plan(plan, args, kwargs)

  def _split(self, args, kwargs):
    """(key, dynamic arguments, their leaves, the step bound to the static ones, traced):
    with `traced` (tracers among the dynamic arguments: a call inside an enclosing
    transformation, `_call_traced`) nothing else is read.

    The key holds what jax.jit traces anew for: the static arguments, the dynamic ones'
    pytree structure and weak types."""
    dyn, leaves, treedef = tracing.scalars_as_arrays(
        [a for i, a in enumerate(args) if i not in self._static_argnums])
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
      return None, dyn, leaves, None, True
    static = tuple(args[i] for i in self._static_argnums if i < len(args))
    static_kwargs = tuple(sorted(kwargs.items()))
    try:
      hash((static, static_kwargs))
    except TypeError as e:   # jax.jit's error and words
      raise ValueError(f"Non-hashable static arguments are not supported: {e}") from None
    # As jax.jit, a leaf's weak type is part of the trace (it decides result dtypes), and
    # so is the configuration a trace reads (rank promotion, matmul precision, ...).
    weak = tuple(bool(getattr(x, "weak_type", False)) for x in leaves)
    static_key = (static, static_kwargs, len(args), treedef, weak, tracing.trace_context())
    # Closes over the static arguments only: the traced program keeps `bound`, and
    # holding the first call's arrays would keep them resident (and counted as
    # other live memory against the budget) for the life of the step.
    statics, nargs = {i: args[i] for i in self._static_argnums if i < len(args)}, len(args)
    def bound(*dyn_args):
      it = iter(dyn_args)
      return self._fun(*[statics[i] if i in statics else next(it) for i in range(nargs)], **kwargs)
    bound.__name__ = self.__name__
    return static_key, dyn, leaves, bound, False

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

  def _dyn_shapes(self, nargs: int):
    """The shape specs of the dynamic arguments of a call with `nargs` positional ones.

    Specs may be given per parameter, static ones included: those of parameters the call
    leaves at their defaults (after its positional arguments) and of static ones are
    dropped. Otherwise they are the dynamic arguments' own, as given."""
    shapes = self._shapes
    if not isinstance(shapes, (tuple, list)):
      return shapes
    if nargs < len(shapes) <= self._positional_params:
      shapes = shapes[:nargs]
    if len(shapes) == nargs:
      shapes = tuple(s for i, s in enumerate(shapes) if i not in self._static_argnums)
    return shapes

  def _entry_for(self, static_key, bound, dyn_args, flat, nargs: int) -> _Entry:
    """The entry for a call: `_entry`, or where a leaf has another dtype than that entry
    was traced for, the entry for these dtypes, as jax.jit traces anew for them (the
    executables are specialized to the traced dtypes: run by them, floats passed to a
    step traced for bools would be cast). Only the dtypes of the first trace are read on
    each call: the key holds them only for the others."""
    entry = self._entry(static_key, bound, dyn_args, nargs)
    if _dtypes_match(entry, flat):
      return entry
    validation.check_arrays(self._caller(), dyn_args)   # a str: TypeError
    dtypes = tuple(jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True)
                   for x in flat)   # float64: float32; typed PRNG keys as they are
    if dtypes == entry.spec_dtypes:   # without x64, as under jax.jit
      return entry
    entry = self._entry(static_key + (dtypes,), bound, dyn_args, nargs)
    if not _dtypes_match(entry, flat):
      raise SymmemError(f"{self.__name__} was traced for the dtypes {dtypes} and took "
                        f"{entry.spec_dtypes} (a defect of jax_symmem)")
    return entry

  def _entry(self, static_key, bound, dyn_args, nargs: int) -> _Entry:
    """The entry for these static arguments, traced and analysed on first use."""
    with self._lock:
      entry = self._entries.get(static_key)
      if entry is not None:
        return entry
      entry = _Entry(analysis=None)
      budget = self._budget()
      if self._entries:   # as jax.jit retraces: each is traced and planned once
        logging.info("jax_symmem: %s traced again: static arguments or the arguments' pytree "
                     "structure, weak types or dtypes not seen before (%d traced so far)",
                     bound.__name__, len(self._entries))
      try:
        if self._jit_kwargs:
          raise NotImplementedError(
              f"jax.jit options {sorted(self._jit_kwargs)} are not supported by the memory planner "
              "yet")
        # Sharded arguments: the memory model counts bytes per device (sharding.py).
        divisors = sharding_lib.argument_divisors(self._in_shardings, dyn_args)
        entry.arg_splits = tuple(math.prod(d) for d in divisors or ())
        entry.analysis = analysis_lib.analyze_function(
            bound, *dyn_args, polymorphic_shapes=self._dyn_shapes(nargs),
            constraints=self._constraints, memory_budget=budget,
            argument_divisors=divisors, plan_cache_dir=self._plan_cache_dir,
            # Without a budget each shape runs as written, and under the device's limit
            # first tries to (`_as_written_first`): no round read, none planned yet.
            lazy=self._budget_arg is None)
        if self._budget_arg is None and budget is not None:   # the model's verdicts say so
          entry.analysis = dataclasses.replace(entry.analysis, device_limit=True)
      except (BudgetError, ShapeError, ValueError, TypeError):
        raise   # the caller's mistake: say so rather than fall back
      except Exception as e:  # an op the pipeline cannot handle: never a wrong result
        own = _jax_jit_trace_error(bound, dyn_args)
        if own is not None:   # the step fails under jax.jit too: its own error, as jax.jit's
          raise own from None
        self._fall_back(entry, f"{type(e).__name__}: {e}")
      finally:
        # Tracing with symbolic dims leaves exception/traceback cycles (jax's dimension
        # checks) that reach this call's frame, and so the caller's arguments and this
        # call's outputs: left to the cyclic collector they stay alive after the call and
        # count as other live arrays against the next call's budget. They are young (made
        # while the collector was paused, `collector.paused`): a collection of the young
        # generations frees them. Under a budget the collection is full, so that garbage
        # older code left in cycles does not count against it either; without one a full
        # collection only costs time (it walks every object of the process: ~0.3 s per
        # new step in the fast test tier, 19 s of its CPU time for 67 steps).
        gc.collect(2 if budget is not None else 1)
      self._entries[static_key] = entry
      return entry

  def _as_written_first(self, analysis, budget: int | None) -> bool:
    """Whether a new shape compiles the step as written before reading the plan: under
    the device's own limit (no `memory_budget` given), while nothing has needed the plan.
    Only where jax.jit's program does not fit there, which would fail under jax.jit,
    is the step planned: at once where predicted over (`_predicted_over`), else at the
    cost of that one compile; a job whose steps fit never plans (`analysis.Planning`).
    A step with jax.checkpoint regions is planned anyway: compiling its round 0 (the
    step without them) first cost more than it saved where a length was over the limit
    (experiments/RESULTS.md, "Round 0 first for checkpointed steps")."""
    return (self._budget_arg is None and budget is not None and not analysis.planning.done
            and not analysis.planning.annotated)

  def _predicted_over(self, entry: _Entry, dims, args, budget: int, reserved: int
                      ) -> int | None:
    """The step as written's footprint at dims where it is predicted over the device's
    limit without planning (`Analysis.unplanned_footprint`, plus XLA's figure less that
    prediction at the largest shape compiled so, `_Entry.unplanned_offset`), else None.
    Over, the step is planned at once, the compile of a round 0 that would not fit is
    saved, and the plan's search takes round 0's figure to be at least this prediction
    (on transformers' BART at s=512 the plan's own, in its schedule's order, read 150.4
    MiB, this one 152.7, XLA 154.5: the search compiled round 0 twice in vain, with and
    without XNNPACK's fusions). Where it fits, XLA's figure decides after compiling
    (`_compile`'s `unplanned`).

    The correction comes from a smaller shape, the only kind there is. Over 96 pairs of a
    length and the next on 33 steps (experiments/as_written_prediction.py; RESULTS.md, "The
    step as written, predicted before planning") the prediction so shifted erred by -0.29 %
    of XLA's figure on average (rms 2.06 %, 8 pairs over it by more than 2 %), alone by
    -1.72 % (rms 3.65 %), scaled by the smaller length's ratio instead by +0.80 % (rms
    2.25 %, 19 over by more than 2 %). An overstatement costs more than an understatement:
    a shape that would have fit runs a round that recomputes, where an understatement
    spends one compile. Transformers' BART at s=512: predicted 150.9 MiB against a 151.3
    limit, XLA 154.5; XLA's figure was 1.8 MiB over the prediction at s=256."""
    analysis = entry.analysis
    predicted = analysis.unplanned_footprint(dims, self._donated_leaves(args))
    if entry.unplanned_offset is not None:
      predicted = max(0, predicted + entry.unplanned_offset[1])
    if predicted + reserved <= budget:
      return None
    figure, room = variants_lib.over_budget(predicted, budget, reserved, device_limit=True)
    logging.info("jax_symmem: %s at %s: the step as written is predicted at %s, over %s; "
                 "planning", analysis.traced.fun_name, dims, figure, room)
    return predicted

  def _record_unplanned(self, entry: _Entry, dims, args, xla_bytes: int) -> None:
    """Keeps XLA's figure for the step as written less its prediction at dims where dims
    are the largest compiled so far (by the prediction)."""
    predicted = entry.analysis.unplanned_footprint(dims, self._donated_leaves(args))
    if entry.unplanned_offset is None or predicted >= entry.unplanned_offset[0]:
      entry.unplanned_offset = (predicted, xla_bytes - predicted)

  def _compile(self, entry: _Entry, key, dims, k, args, flat, budget, reserved,
               fusions: bool = True, unplanned: bool = False):
    """Compiles (dims, round k) or the round XLA says fits (variants.compile_fitting;
    round 0 with XLA:CPU's XNNPACK fusions first where `fusions`); `key` is the call's
    (dims, reserved MiB, budget). `unplanned` (`_as_written_first`): round 0 alone first,
    dispatched by XLA's figure without a prediction; where it does not fit, the plan is
    made and the search goes on from the round it predicts."""
    compiles = 0
    compile_flat = self._lower(args, flat, entry)
    def lower(fn, options):
      nonlocal compiles
      self._counts["recompiles"] += compiles > 0   # counted here: a BudgetError may follow
      compiles += 1
      return compile_flat(fn, options)
    policy = self._policy(flat, budget, reserved, entry)
    known = {}
    if unplanned:
      first = variants_lib.compile_round(entry.analysis, dims, k, policy, lower, None)
      self._record_unplanned(entry, dims, args, first.xla_bytes)
      if policy.fits(first.xla_bytes):
        entry.variants[(key[0], k)] = first
        return first
      figure, room = variants_lib.over_budget(first.xla_bytes, budget, reserved,
                                              device_limit=True)
      logging.info("jax_symmem: %s at %s: XLA's memory_analysis() reports %s for the step as "
                   "written, over %s; planning",
                   entry.analysis.traced.fun_name, dims, figure, room)
      known[k] = first
      if policy.options_for(entry.analysis, k)[1]:   # now that a prediction exists
        variants_lib.calibrate(entry.analysis, dims, k, first.xla_bytes, entry.calibration)
      k, _ = entry.analysis.best_round(dims, budget, reserved, entry.calibration.ratios,
                                       predicted=True)
    chosen, compiled = variants_lib.compile_fitting(
        entry.analysis, dims, k, policy, lower, entry.calibrations,
        entry.ratios if fusions else None, known)
    compiled += [v for v in known.values() if v not in compiled]
    if variants_lib.other_scheduler(chosen, policy, entry.analysis):
      entry.other_scheduler = not entry.other_scheduler
      logging.info("jax_symmem: %s now compiles its rounds with XLA:CPU's %s scheduler",
                   entry.analysis.traced.fun_name,
                   "other" if entry.other_scheduler else "usual")
    entry.variants[(key[0], chosen.round)] = chosen
    if budget is not None and len(compiled) > 1:   # a bracket to refine when the shape recurs
      entry.searches[key] = [(v.round, v.xla_bytes) for v in compiled]
    return chosen

  def _refine(self, entry: _Entry, key, dims, variant, args, flat, budget, reserved):
    """When a shape comes back: one compile of a round that recomputes less than the one
    its first call dispatched, where XLA's figures so far predict it fits
    (`variants.refine_round`); at most `MAX_RECOMPILES` per shape. The first call's
    search reaches a fitting round in few compiles by keeping a margin for the model's
    error; this spends a compile only on shapes that recur, which run it many times."""
    searched = entry.searches[key]
    policy = self._policy(flat, budget, reserved, entry)
    j = variants_lib.refine_on_ladder(entry.analysis, dims, searched, policy.fits)
    if j is None:
      del entry.searches[key]
      return variant
    try:
      candidate = variants_lib.compile_round(entry.analysis, dims, j, policy,
                                             self._lower(args, flat, entry), entry.calibration)
    except Exception as e:  # noqa: BLE001 - keep running the variant that works
      logging.warning("jax_symmem: compiling round %d of %s at %s to refine failed (%s: %s); "
                      "keeping round %d", j, entry.analysis.traced.fun_name, dims,
                      type(e).__name__, e, variant.round)
      del entry.searches[key]
      return variant
    self._counts["refinements"] += 1
    searched.append((j, candidate.xla_bytes))
    entry.refinements[key] = entry.refinements.get(key, 0) + 1
    if entry.refinements[key] >= variants_lib.MAX_RECOMPILES:
      del entry.searches[key]
    if not policy.fits(candidate.xla_bytes):
      return variant
    logging.info("jax_symmem: %s at %s now runs round %d (was %d): XLA footprint %.1f MiB",
                 entry.analysis.traced.fun_name, dims, j, variant.round,
                 candidate.xla_bytes / 2**20)
    entry.variants[(key[0], j)] = candidate
    # The variant it replaces stays only while another key (other reserved bytes) runs it.
    self._release(entry, key, variant.round)
    return candidate

  def _trial_call(self, entry: _Entry, key, dims, variant, args, flat, budget, reserved):
    """One call of a shape's speed trial (`speed_trial.py`), under the lock: the round
    dispatched and the challenger (an annotated step's round as written, else the
    planner's least-memory round at these dims, `Analysis.floor_round`) run in turn,
    each timed from its inputs ready to its outputs ready; when both have their timed
    calls, the shape keeps the faster."""
    analysis = entry.analysis
    trial = entry.trials.get(key)
    if trial is None:
      rival = analysis.as_written_round or analysis.floor_round(dims)
      policy = self._policy(flat, budget, reserved, entry)
      challenger = entry.variants.get((key[0], rival))
      if challenger is None and variant.round != rival:
        try:
          challenger = variants_lib.compile_round(analysis, dims, rival, policy,
                                                  self._lower(args, flat, entry),
                                                  entry.calibration)
        except Exception as e:  # noqa: BLE001 - keep running the variant that works
          logging.warning("jax_symmem: compiling round %d of %s at %s for a speed trial failed "
                          "(%s: %s)", rival, analysis.traced.fun_name, dims, type(e).__name__, e)
      if variant.round == rival or challenger is None or not policy.fits(challenger.xla_bytes):
        entry.timed[key] = {}   # nothing to time (XLA puts the challenger over: it never runs)
        out = self._run(entry, dims, variant, flat, budget, reserved)
        self.last_call["pending"] = False
        return out
      entry.variants[(key[0], rival)] = challenger
      trial = entry.trials[key] = speed_trial_lib.SpeedTrial(variant.round, rival)
    k = entry.decisions[key] = trial.next_round()
    jax.block_until_ready(flat)   # the previous step's work is not this call's time
    t0 = time.perf_counter()
    out = jax.block_until_ready(self._run(entry, dims, entry.variants[(key[0], k)], flat,
                                          budget, reserved))
    trial.record(k, time.perf_counter() - t0)
    self.last_call["speed_trial"] = True
    self.last_call["pending"] = True
    if trial.done():
      del entry.trials[key]
      # Across processes: the slowest one's times, so every process keeps the same round.
      entry.timed[key] = _agreed_seconds(trial.fastest(), flat)
      self._counts["speed_trials"] += 1
      keep = entry.decisions[key] = trial.winner(entry.timed[key])
      drop = trial.challenger if keep == trial.incumbent else trial.incumbent
      self.last_call["pending"] = keep != k   # later calls run another round than this one
      logging.info("jax_symmem: %s at %s keeps round %d after a speed trial (fastest call, "
                   "s: %s)",
                   analysis.traced.fun_name, dims, keep,
                   ", ".join(f"round {r} {t:.4f}" for r, t in sorted(entry.timed[key].items())))
      self._release(entry, key, drop)
    return out

  def _trial_due(self, entry: _Entry, key) -> bool:
    """Whether `key` (dims, reserved MiB, budget) has a speed trial to run or finish."""
    return self._speed_trials and key[2] is not None and key not in entry.timed

  def _pending(self, entry: _Entry, key) -> bool:
    """Whether later calls at `key` may run another round than this call (a refinement
    search, or a speed trial not yet settled)."""
    return key in entry.searches or self._trial_due(entry, key)

  @staticmethod
  def _release(entry: _Entry, key, k: int) -> None:
    """Drops round k's executable at key's dims unless another key there still runs it."""
    if not any(other[0] == key[0] and r == k for other, r in entry.decisions.items()
               if other != key):
      entry.variants.pop((key[0], k), None)

  def _run(self, entry: _Entry, dims, variant, flat, budget, reserved):
    """Runs `variant` on the flat arguments (recorded as `last_call`)."""
    self.last_call = {"dims": dims, "round": variant.round, "reserved": reserved,
                      "budget": budget, "xla_bytes": variant.xla_bytes,
                      "xnnpack_fusions": variant.xnnpack_fusions}
    out = variant.executable(*flat)
    return jax.tree_util.tree_unflatten(variant.out_tree or entry.analysis.traced.out_tree, out)

  @staticmethod
  def _reserved(entry: _Entry, flat, shapes_key, budget: int) -> int:
    """The bytes other live arrays hold: all live bytes less this call's arguments."""
    # The shapes and dtypes fix every array's bytes; the types say which are jax.Arrays.
    bytes_key = (shapes_key, tuple(map(type, flat)))
    arg_bytes = entry.arg_bytes.get(bytes_key)
    if arg_bytes is None:
      splits = entry.arg_splits or (1,) * len(flat)
      # Per device; NumPy arguments are not among the live arrays the probe counts.
      arg_bytes = sum(_array_bytes(a) // d for a, d in zip(flat, splits)
                      if isinstance(a, jax.Array))
      if len(entry.arg_bytes) < 4096:
        entry.arg_bytes[bytes_key] = arg_bytes
    reserved = max(0, _live_bytes() - arg_bytes)
    # Arrays over several processes: the largest reading of any (device.py).
    return _agreed_reserved(reserved, budget, flat)

  def _call_empty(self, entry: _Entry, args, kwargs, flat):
    """A batch with an empty symbolic axis (b = 0) lies outside jax.export's dims (>= 1),
    and nothing in it has an element along that axis to recompute: it runs as jax.jit
    compiles the step as written, under the budget by XLA's figure where there is one."""
    step = self._as_jax_jit()
    budget = self._budget()
    shapes = tuple((a.shape, a.dtype) for a in flat)
    with self._lock:
      self._counts["empty_batches"] += 1
      if self._counts["empty_batches"] == 1:
        logging.info("jax_symmem: %s: a batch with an empty axis runs as jax.jit compiles the "
                     "step (counted in cache_info()['empty_batches'])", self.__name__)
      dims = validation.empty_batch_dims(entry.analysis.traced, flat)
      call = {"dims": dims, "round": entry.analysis.as_written_round, "empty_batch": True,
              "budget": budget, "reserved": 0, "xla_bytes": None, "xnnpack_fusions": True}
      if budget is not None:
        xla_bytes = entry.empty_footprints.get(shapes)
        if xla_bytes is None:
          self._counts["compiles"] += 1
          xla_bytes = variants_lib.footprint(step.lower(*args, **kwargs).compile())
          entry.empty_footprints[shapes] = xla_bytes
        reserved = self._reserved(entry, flat, shapes, budget)
        call.update(reserved=reserved, xla_bytes=xla_bytes)
        if xla_bytes + reserved > budget:
          self._counts["budget_errors"] += 1
          figure, room = variants_lib.over_budget(xla_bytes, budget, reserved,
                                                  device_limit=self._budget_arg is None)
          raise BudgetError(f"{self.__name__}: a batch with an empty axis: XLA's "
                            f"memory_analysis() reports {figure} for the step as jax.jit "
                            f"compiles it, over {room}")
      self.last_call = call
    return step(*args, **kwargs)

  def _policy(self, flat, budget, reserved, entry: _Entry | None = None
              ) -> variants_lib.CompilePolicy:
    return variants_lib.CompilePolicy(
        budget=budget, reserved=reserved, platform=jax.devices()[0].platform,
        impose_schedule=self._impose_schedule,
        agree=lambda size: _agreed_footprint(size, flat),
        other_scheduler=entry is not None and entry.other_scheduler,
        device_limit=self._budget_arg is None)

  def _lower(self, args, flat, entry: _Entry) -> Callable:
    """`lower(fn, options)`: compiles `fn` on the flat arguments as jax.jit would (counted)."""
    jit_kwargs = dict(donate_argnums=self._donated_leaves(args),
                      **self._flat_shardings(args, entry.analysis.traced), **self._compile_kwargs)
    users = jit_kwargs.pop("compiler_options", None) or {}
    def lower(fn, options):
      self._counts["compiles"] += 1
      return jax.jit(fn, **jit_kwargs).lower(*flat).compile(
          compiler_options={**users, **options})
    return lower

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

  def _fall_back(self, entry: _Entry, reason: str) -> None:
    """From now on this entry runs under plain jax.jit; says why, once."""
    with self._lock:
      if entry.fallback is not None:   # another thread's compile failed first
        return
      unenforced = ("" if self._budget_arg is None else
                    f"\nThe memory budget ({self._budget_arg!r}) is not enforced on these calls "
                    "(counted in cache_info()['fallback_calls']).")
      logging.warning("jax_symmem: %s falls back to jax.jit: %s%s",
                      self.__name__, reason, unenforced)
      entry.fallback = self._as_jax_jit()
      entry.analysis = None

  def _as_jax_jit(self) -> Callable:
    """The step under plain jax.jit, with the same static, donated and sharding arguments:
    what fallbacks and calls under an enclosing transformation run (one instance)."""
    with self._lock:
      if self._jax_jit is None:
        self._jax_jit = jax.jit(
            self._fun, static_argnums=self._static_argnums, static_argnames=self._static_argnames,
            donate_argnums=self._donate, **self._sharding_kwargs, **self._compile_kwargs,
            **self._jit_kwargs)
      return self._jax_jit

  def _call_traced(self, args, kwargs):
    """A call inside another transformation (an enclosing jax.jit, vmap, grad, scan,
    eval_shape...) has tracers for arguments: there is no run-time shape to decide for,
    and XLA plans the enclosing program's memory as a whole. The step is traced into it
    as jax.jit would trace it; the budget applies only to calls made directly."""
    with self._lock:
      self._counts["traced_calls"] += 1
      if self._counts["traced_calls"] == 1:
        log = logging.warning if self._budget_arg is not None else logging.info
        log("jax_symmem: %s is called inside a JAX transformation (jax.jit, vmap, grad, "
            "scan, eval_shape...): it is traced into the enclosing program as jax.jit would "
            "trace it, without a memory plan%s (counted in cache_info()['traced_calls'])",
            self.__name__,
            "" if self._budget_arg is None else
            f"; the memory budget ({self._budget_arg!r}) applies to direct calls only")
    return self._as_jax_jit()(*args, **kwargs)

  def _call_fallback(self, entry: _Entry, args, kwargs):
    with self._lock:   # `+=` on a dict item is not atomic across threads
      self._counts["fallback_calls"] += 1
      self.last_call = {"fallback": True}
    return entry.fallback(*args, **kwargs)


class _Required:
  """A keyword without a default that says what it is for when missing (jax.jit's
  signature has no `polymorphic_shapes`, so code written for it omits it)."""

  def __repr__(self) -> str:
    return "<required>"


_NO_SHAPES = _Required()


def jit(fun: Callable | None = None, *, polymorphic_shapes=_NO_SHAPES, constraints=(),
        memory_budget=None, impose_schedule: bool = False, plan_cache_dir=None,
        speed_trials: bool = False, **jax_jit_kwargs):
  """Like `jax.jit`, for steps whose shapes change: one symbolic plan, a decision per shape.

  Args:
    fun: the step function (or use as `@symmem.jit(polymorphic_shapes=...)`).
    polymorphic_shapes: shape specs as in `jax.export.symbolic_args_specs`
      ("b, s"), one per positional argument (None for static or fully static args). A
      dynamic argument passed by keyword goes to its parameter's position, with that
      position's spec (`bind_keywords`).
    constraints: e.g. ("s <= 4096", "b <= 64", "s == 128*k").
    memory_budget: bytes, a size string ('200MiB', '6 GiB'), or a float in (0, 1] as a
      fraction of device memory; default the device's limit where known, otherwise no
      eviction. Under a budget a shape's first call compiles the round the model picks
      and, while XLA reports it over, a later one (usually 2 compiles at most); when the
      shape comes back, a round in between that XLA's figures predict to fit may be
      compiled and run instead (`cache_info()["refinements"]`, at most 3 per shape).
    impose_schedule: fence jax_symmem's memory-aware order into XLA with
      optimization barriers instead of leaving the order to XLA's scheduler.
    plan_cache_dir: a directory where memory plans are kept across processes
      (default $JAX_SYMMEM_PLAN_CACHE; neither: no cache). A restarted job replays
      the stored plan instead of planning again; with JAX's persistent compilation
      cache (`jax_compilation_cache_dir`) it also skips XLA's compiles.
    speed_trials: under a budget, when a shape comes back (after its refinement), also
      compile its least-memory round (`Analysis.floor_round`; an annotated step: its
      round as written) and time it against the dispatched
      round on the next calls, in turn (3 timed calls each, each waiting for its inputs
      and outputs); the shape keeps the faster (by 3 % or more, else the dispatched
      one). The rounds are ranked by the FLOPs they recompute, and XLA can run a round
      that recomputes more faster (a scan's stacked residuals can cost more than
      recomputing them). One more compile per recurring shape; off by default.
    **jax_jit_kwargs: static_argnums, static_argnames, donate_argnums, donate_argnames,
      in_shardings and out_shardings as in jax.jit (an argument named static may be
      passed positionally, one numbered static by keyword). With shardings (or sharded
      arguments) the memory model and the budget are per device. keep_unused, inline
      and compiler_options apply to every executable (where a round's own XLA options
      set the same flag, the round's value holds: they keep XLA's memory figure
      honest). device and backend fall back to jax.jit; another name is a TypeError.
  """
  if polymorphic_shapes is _NO_SHAPES:
    raise TypeError(
        "symmem.jit needs polymorphic_shapes: for each positional argument, which of its axes "
        "change between calls, e.g. polymorphic_shapes=(None, 'b, s', 'b, s') for a step "
        "(state, tokens, mask) whose batch and length vary (None: every shape fixed, '_' one "
        "fixed axis); then constraints such as ('s <= 4096', 'b <= 64')")
  if fun is None:
    _check_jit_options(jax_jit_kwargs)   # as jax.jit: a misspelt option fails at once
    return functools.partial(jit, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
                             memory_budget=memory_budget, impose_schedule=impose_schedule,
                             plan_cache_dir=plan_cache_dir, speed_trials=speed_trials,
                             **jax_jit_kwargs)
  return SymmemFunction(fun, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
                        memory_budget=memory_budget, impose_schedule=impose_schedule,
                        plan_cache_dir=plan_cache_dir, speed_trials=speed_trials,
                        **jax_jit_kwargs)
