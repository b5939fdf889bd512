"""Compiling a step's variants for one shape: which round, which XLA options, when to stop.

`compile_fitting` is a pure function of the analysis, the dims, a `CompilePolicy`
and a `lower` callable that turns (program, order, options) into an executable; it
returns every variant it compiled and the one to dispatch, or raises BudgetError.
`symmem.jit` (jit.py) keeps the cache around it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

from absl import logging
import jax

from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import body_remat
from jax_symmem._src import fence
from jax_symmem._src import interpret
from jax_symmem._src import remat
from jax_symmem._src import tracing
from jax_symmem._src import xnnpack
from jax_symmem._src.budget import refusal_advice, sizes
from jax_symmem._src.errors import BudgetError

# XLA:CPU options for variants compiled under a memory budget: keep our fences
# (F1); XLA's memory-optimized scheduler (lowest real peak at most lengths in
# experiments/bench_fence.py); XNNPACK for single dots only (XNNPACK_DOTS). They cost
# step time (0.52 s -> 0.66-0.71 s per option on the benchmark transformer), so without
# a budget the step compiles exactly as jax.jit would.
#
# XNNPACK fusions of several ops hold buffers memory_analysis() does not count (F2),
# so a budget checked against XLA's figure would not hold; XNNPACK running each dot
# alone holds none it does not count (python -m experiments.bench_xnnpack --fusions
# off,individual_dot: the same footprint as without XNNPACK and a real peak at or below
# it on every round measured, 2026-12-03) and is faster on CPUs where XNNPACK's GEMMs
# beat XLA's own (an AMD EPYC host: scanned Llama round 3 at s=512, 372 vs 431 ms).
XNNPACK_DOTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
CPU_COMPILER_OPTIONS = {
    "xla_disable_hlo_passes": "cse_barrier_expander",
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    **XNNPACK_DOTS,
}
# ... except for rounds with fenced recomputation (optimization barriers: our fences,
# at the top level or inside a scan body, or jax.checkpoint's own in a step as
# written): the memory-optimized scheduler moves it back up next to the forward pass
# (experiments/flat_reach.py: GPT-2-style step, b=4, s=512, XLA footprint of per-layer
# checkpointing 363 MiB with it vs 174 without; the planner's last round 325 vs 190;
# HF FlaxT5 with gradient_checkpointing as written, b=4, s=256, t=128: 84.8 vs 53.3;
# gradient accumulation's last round, llama_accum s=512: 143.5 vs 134.5), so those
# compile with XLA's default scheduler; and so do rounds that rewrite a scan body,
# fenced or not (scan residuals of a scanned model regenerated inside gradient
# accumulation's body: last round 4.74 vs 3.74 MiB on tests/test_body_remat.py's
# nested step at m=2, b=4, s=256; a Mistral-style probe at m=2, b=4, s=512: 95.6 vs
# 84.0 MiB, with its checkpointed layers 92.6 vs 73.6).
SCHEDULER_OPTION = "xla_cpu_scheduler_type"
GPU_COMPILER_OPTIONS: dict[str, str] = {}
MAX_RECOMPILES = 3
# Under a budget, round 0 (nothing recomputed) compiles as jax.jit would except that
# XNNPACK runs single dots only (XNNPACK_DOTS), so its figure is the truth the budget
# is checked against. The memory-optimized scheduler would cost
# step time for next to no memory there (round 0 at s=256: scanned Llama 0.275 vs
# 0.258 s, same 257.2 MiB XLA footprint; unrolled Llama 0.248 vs 0.240 s, 236.2 vs
# 237.2 MiB; jax.jit 0.258 / 0.246 s).
FAST_PATH_CPU_OPTIONS = dict(XNNPACK_DOTS)
# ... unless round 0 fits with XLA:CPU's own XNNPACK fusions, as jax.jit compiles it
# (`compile_with_fusions`): XLA's figure plus a bound on what the fusions hold beside it
# (`xnnpack.hidden_bytes_bound`) within the budget. They run elementwise chains and
# reductions in XNNPACK, which XLA:CPU's own loops run slower (GPT-2's GELU and norms,
# a ViT's stacked residuals read back in its backward scan).
FUSION_OPTION = next(iter(XNNPACK_DOTS))
IMPOSE_MIN_BYTES = fence.MIN_BYTES


@dataclasses.dataclass(frozen=True)
class CompilePolicy:
  """How variants compile under a budget, and how many more rounds may be tried."""
  budget: int | None
  reserved: int = 0                     # bytes other live arrays hold
  platform: str = "cpu"
  impose_schedule: bool = False
  max_recompiles: int = MAX_RECOMPILES
  agree: Callable[[int], int] = lambda footprint: footprint   # across processes (device.py)
  # Rounds compile with XLA:CPU's other scheduler (`_with_the_other_scheduler`).
  other_scheduler: bool = False
  # `budget` is the device's own memory limit (no memory_budget was given): messages say so.
  device_limit: bool = False

  @property
  def bound(self) -> str:
    return _bound(self.device_limit)

  @property
  def memory_options(self) -> Mapping[str, str]:
    return CPU_COMPILER_OPTIONS if self.platform == "cpu" else GPU_COMPILER_OPTIONS

  def options_for(self, analysis, k: int) -> tuple[dict, bool]:
    """(compiler options, whether memory_analysis() may calibrate the model)."""
    if self.budget is None:
      return {}, False   # exactly as jax.jit; XNNPACK fusions may hide buffers (F2)
    options = round_options(analysis, k, self.platform)
    return (_the_other_scheduler(options) if self.other_scheduler and self.platform == "cpu"
            and not self.impose_schedule else options), True

  def fits(self, footprint: int) -> bool:
    return self.budget is None or footprint + self.reserved <= self.budget


@dataclasses.dataclass(frozen=True)
class Variant:
  """One compiled executable of a step at one shape."""
  dims: Mapping[str, int]
  round: int
  executable: Any
  xla_bytes: int              # memory_analysis(): arguments + outputs + temps - aliased,
                              #   + Analysis.round_scratch
  memory_options: bool        # compiled with the memory-saving XLA options
  # The XLA options it was compiled with ({} exactly as jax.jit): a budget's round 0
  # differs from jax.jit by XNNPACK fusions alone, which can move the last bits.
  compiler_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
  # Compiled with XLA:CPU's XNNPACK fusions (`compile_with_fusions`): xla_bytes then
  # includes the bound on what they hold beside XLA's figure.
  xnnpack_fusions: bool = False
  # The outputs' tree where it came from the trace of the step as written rather than
  # the symbolic one: its auxiliary data can differ by trace (checkify's error codes).
  out_tree: Any = None

  def describe(self) -> dict:
    return {"dims": dict(self.dims), "round": self.round, "xla_bytes": self.xla_bytes,
            "memory_options": self.memory_options,
            "compiler_options": dict(self.compiler_options),
            "xnnpack_fusions": self.xnnpack_fusions}


def fenced_recomputation(analysis, k: int) -> bool:
  """Whether round k recomputes behind optimization barriers anywhere in its program:
  our fences (remat.apply_regions, also inside scan bodies) or, in the step as
  written, those of the user's jax.checkpoint regions."""
  return any(n.name == "optimization_barrier" for _, n in analysis.rounds[k].program.walk())


def draws_in(analysis, k: int) -> bool:
  """Whether round k's program makes random draws at its top level (which it pins)."""
  return any(n.name == "random_bits" for n in analysis.round_program(k).nodes)


def rewrites_a_scan_body(analysis, k: int) -> bool:
  """Whether rounds 1..k evict anything inside a scan body (`BodyEviction`s)."""
  return any(isinstance(r, body_remat.BodyEviction)
             for j in range(1, k + 1) for r in analysis.rounds[j].regions)


def round_options(analysis, k: int, platform: str = "cpu") -> dict:
  """The XLA options round k compiles with under a budget."""
  if platform != "cpu":
    return dict(GPU_COMPILER_OPTIONS)
  if k == 0:
    options = dict(FAST_PATH_CPU_OPTIONS)
    if not analysis.is_as_written(k) and draws_in(analysis, k):   # pinned draws' fences
      options.update(fence.FENCE_COMPILER_OPTIONS)
    return options
  options = dict(CPU_COMPILER_OPTIONS)
  if fenced_recomputation(analysis, k) or rewrites_a_scan_body(analysis, k):
    del options[SCHEDULER_OPTION]   # the default scheduler keeps the recomputation late
  return options


def footprint(executable) -> int:
  ma = executable.memory_analysis()
  return 0 if ma is None else _arguments_and_outputs(ma) + ma.temp_size_in_bytes


def resident_bytes(executable) -> int:
  """What XLA holds for the arguments and outputs, less their aliases: the same for every
  round of a step at a shape (the same signature), so no round's footprint is below it."""
  ma = executable.memory_analysis()
  return 0 if ma is None else _arguments_and_outputs(ma)


def _arguments_and_outputs(ma) -> int:
  return ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes


def round_function(analysis, k: int, dims: Mapping[str, int]) -> Callable:
  """Round k at dims as a function of the flat arguments returning the flat outputs,
  in that round's order: what `symmem.jit` compiles (tests and benchmarks too).

  The step as written (`Analysis.as_written_round`) is the user's own function, which
  jax.jit traces at these shapes: exactly jax.jit's program. The symbolic trace
  specialized to the dims is equivalent but can differ in form (a slice along a
  symbolic dim traces as a gather), and that moved the last bits of AdamW's updates."""
  if analysis.is_as_written(k):
    return _flat_function(analysis.traced)
  return _specialized_function(analysis, k, dims)


def _flat_function(traced) -> Callable:
  """The step as written on flat arguments; `.out_tree` is its outputs' tree once traced
  (checkify's errors number their checks anew in each trace, in the tree's aux data)."""
  fun, in_tree = traced.fun, traced.in_tree
  def flat(*leaves):
    out, flat.out_tree = jax.tree_util.tree_flatten(
        fun(*jax.tree_util.tree_unflatten(in_tree, leaves)))
    return tuple(out)
  flat.out_tree = None
  return flat


def _specialized_function(analysis, k: int, dims: Mapping[str, int]) -> Callable:
  """Round k's program at dims, its large random draws pinned where its order puts them
  and the masks made of them stored (`fence.pinned_draws`, `fence.kept_values`;
  `Analysis.round_footprint` predicts that)."""
  env = analysis.graph.constraints.complete(dims)
  r = analysis.rounds[k]
  program = tracing.specialize_program(r.program, env)
  order = analysis.round_order(k, dims)
  draws = fence.pinned_draws(r.graph, r.program, env, IMPOSE_MIN_BYTES)
  if not draws:
    return lambda *a: tuple(interpret.run(program, a, order))
  sizes = r.graph.bytes_at(env, r.program.value_ids())
  run = fence.ordered_function(program, order,
                               fence.significant_nodes(sizes, program, IMPOSE_MIN_BYTES),
                               pinned=draws, kept=fence.kept_values(program, draws).values())
  return lambda *a: tuple(run(*a))


def _runner(analysis, k, dims, env, policy: CompilePolicy, options: dict):
  """The function jax.jit compiles for round k, and its (possibly extended) options."""
  if not policy.impose_schedule:
    return round_function(analysis, k, dims), options
  r = analysis.rounds[k]
  program = tracing.specialize_program(r.program, env)
  order = analysis.round_order(k, dims)
  # Chain nodes whose results take >= 1 MiB through optimization barriers so XLA
  # follows our order (off by default: XLA's memory-optimized scheduler did as
  # well or better at 3 of 5 lengths in experiments/bench_fence.py).
  sizes = r.graph.bytes_at(env, r.program.value_ids())
  run = fence.ordered_function(program, order,
                               fence.significant_nodes(sizes, program, IMPOSE_MIN_BYTES)
                               | fence.pinned_draws(r.graph, r.program, env, IMPOSE_MIN_BYTES))
  return (lambda *a: tuple(run(*a))), dict(options, **fence.FENCE_COMPILER_OPTIONS)


def next_round(peaks: Sequence[int], k: int, size: int, predicted: float,
               tried: Iterable[int], fits: Callable[[int], bool]) -> int | None:
  """The first later round predicted to fit after round k came out over budget.

  `peaks` are the modeled peaks of every round at this shape, `size` XLA's figure for
  round k and `predicted` the estimate that chose k. XLA's figure calibrates the model
  (prediction = size / peaks[k] * peaks[j]), and how far the estimate that chose k was
  off is kept as a margin: round j must fit even if its calibrated prediction is off by
  as much. So one more compile suffices wherever the model's error does not grow from
  round to round, without stepping round by round (experiments/bench_recompile.py
  replays this search on every round's XLA figure of the benchmark steps). None if no
  later round does.
  """
  ratio = size / max(1, peaks[k])
  margin = abs(size - predicted)
  tried = set(tried)
  # Rounded up: a prediction a fraction of a byte under the budget is not a fit.
  return next((j for j in range(k + 1, len(peaks))
               if j not in tried and fits(math.ceil(ratio * peaks[j] + margin))), None)


def earlier_round(peaks: Sequence[int], k: int, size: int, fits: Callable[[int], bool],
                  scale: Mapping[int, float]) -> int | None:
  """The first round before k predicted to fit after round k fit at once, or None.

  The model chose k because it predicted the rounds before it over budget; where XLA's
  figure for k shows the model overestimating (it counts every value, XLA fuses: conv
  nets' BatchNorm and activations), an earlier round, which recomputes less, may fit
  too. Predicted with XLA's ratio for k, or the ratio measured for that round at another
  shape where there is one (`compile_fitting` passes those that transfer: `transferable`).
  """
  ratio = size / max(1, peaks[k])
  return next((j for j in range(k) if fits(int(scale.get(j, ratio) * peaks[j]))), None)


def search_rounds(peaks: Sequence[int], k: int, predicted: float,
                  xla_bytes: Callable[[int], int], fits: Callable[[int], bool],
                  max_recompiles: int = MAX_RECOMPILES,
                  scale: Mapping[int, float] | None = None,
                  last: int | None = None, as_written: int = 0,
                  resident: Callable[[], int] = lambda: 0) -> list[tuple[int, int]]:
  """[(round, XLA's figure)] in the order compiled: round k (chosen by `predicted`),
  then while XLA reports the last one over budget, `next_round`, else the planner's
  last round, then the step as written (round `as_written`: what jax.jit compiles, round
  0 unless the step has jax.checkpoint regions; XLA may fit it where the model says no,
  and a step that jax.jit runs is never refused) where the model or the most favourable
  XLA/model ratio seen here puts it within the budget, then the other rounds by increasing
  modeled peak (the model can overestimate one round and not another: no BudgetError
  before they are tried), at most `max_recompiles` more. The step as written that
  neither puts within the budget (round 0 of a step without annotations, once a round
  has come out over) comes after those, before a refusal. Only where none of those fits,
  every round not yet compiled (`_before_refusing`: the one the compiled rounds nearest
  it on the ladder predict lowest first), so that a refusal is never for want
  of trying a round that fits; unless `resident()`, the bytes every round holds whatever
  it recomputes (XLA's arguments and outputs less their aliases), is itself over the
  budget: then nothing can fit and the search stops at once.
  Where round k fits at once, `earlier_round` may add one compile of a round that
  recomputes less (only given `scale`, XLA/model ratios known from other shapes: under
  a budget). `xla_bytes(k)` compiles round k. `last`: the planner's last round
  (default the last of `peaks`; an annotated step's round as written comes after it)."""
  last = len(peaks) - 1 if last is None else last
  compiled: list[tuple[int, int]] = []
  while True:
    size = xla_bytes(k)
    compiled.append((k, size))
    if fits(size) and len(compiled) == 1 and max_recompiles and scale is not None:
      j = earlier_round(peaks, k, size, fits, scale)
      if j is not None:
        compiled.append((j, xla_bytes(j)))
      return compiled
    if fits(size) or not fits(resident()):
      return compiled
    if len(compiled) > max_recompiles:
      return compiled + _before_refusing(peaks, compiled, xla_bytes, fits)
    tried = {j for j, _ in compiled}
    nxt = next_round(peaks, k, size, predicted, tried, fits)
    # The step as written early only where the model or the most favourable XLA/model
    # ratio seen here puts it within the budget (it is another program than the
    # planner's rounds: a ratio measured on them need not carry over), else after the
    # rounds that may fit (jax.jit's program far over the budget: BERT's 121.6 MiB under
    # 64.2, tests/test_variants.py), before a refusal.
    best = min(1.0, _best_ratio(peaks, compiled))
    early = (last, as_written) if fits(math.ceil(best * peaks[as_written])) else (last,)
    if nxt is None and set(early) <= tried:
      nxt = min((j for j in range(len(peaks)) if j not in tried and j != as_written),
                key=lambda j: (peaks[j], j), default=None)
    nxt = next((j for j in (nxt, *early, as_written) if j is not None and j not in tried), None)
    if nxt is None:
      return compiled
    predicted = size / max(1, peaks[k]) * peaks[nxt]
    k = nxt


def _best_ratio(peaks: Sequence[int], compiled: Iterable[tuple[int, int]]) -> float:
  """The most favourable XLA/model ratio among the rounds compiled [(round, XLA's figure)]."""
  return min(size / max(1, peaks[k]) for k, size in compiled)


def _before_refusing(peaks: Sequence[int], compiled: Sequence[tuple[int, int]],
                     xla_bytes: Callable[[int], int], fits: Callable[[int], bool]
                     ) -> list[tuple[int, int]]:
  """After the capped search found nothing that fits: every round not yet compiled, the
  one `_neighbours_predict` puts lowest first (with every compile's evidence so far),
  until one fits: [(round, XLA's figure)] compiled here.

  No ratio of XLA's figure to the model predicts every round: XLA schedules each round
  its own way, and one round can come out far below its neighbours. transformers' BART at
  b=4, s=512 (tests/test_variants.py): round 5 takes 50.7 MiB where the prediction says
  56.6 and every other round 56.7 or more; under budgets between the two, skipping the
  rounds that the most favourable ratio seen puts over the budget refused the step (19
  of 1,818 replayed searches, experiments/results/bench_recompile_third_party.json). So a
  refusal costs a compile per round; `_warn_long_search` says so when it begins. The
  order only decides how soon a round that fits is found: BigBird at s=512 under 46 MiB
  (tests/test_variants.py), whose model underestimates the later rounds more and more,
  found its one fitting round after 16 compiles by increasing modeled peak, after 5 so.
  """
  done = dict(compiled)
  more: list[tuple[int, int]] = []
  while len(done) < len(peaks):
    j = min((j for j in range(len(peaks)) if j not in done),
            key=lambda j: (_neighbours_predict(peaks, done, j), j))
    done[j] = xla_bytes(j)
    more.append((j, done[j]))
    if fits(done[j]):
      break
  return more


def _neighbours_predict(peaks: Sequence[int], done: Mapping[int, int], j: int) -> float:
  """Round j's XLA figure predicted from the rounds compiled nearest it on the ladder
  (`done`: round -> XLA's figure): their XLA/model ratios interpolated by position, or
  the one side's where j is outside them. Neighbouring rounds differ by a few evictions,
  so XLA treats them most alike (a ratio interpolated by modeled peak instead predicts
  rounds with equal peaks alike, wherever they stand)."""
  below = max((k for k in done if k < j), default=None)
  above = min((k for k in done if k > j), default=None)
  ratio = lambda k: done[k] / max(1, peaks[k])
  if below is None or above is None:
    return ratio(above if below is None else below) * peaks[j]
  t = (j - below) / (above - below)
  return (ratio(below) + t * (ratio(above) - ratio(below))) * peaks[j]


def refine_round(peaks: Sequence[int], compiled: Sequence[tuple[int, int]],
                 fits: Callable[[int], bool]) -> int | None:
  """A round that recomputes less than the one dispatched and is predicted to fit, or None.

  `compiled`: [(round, XLA's figure)] compiled at this shape so far. The first call's
  search (`search_rounds`) keeps a margin for the model's error so that one more compile
  fits, and so can land a few rounds past the smallest fitting one (more recomputation
  than needed, on every later call). Once the shape comes back, the rounds before the
  smallest fitting one are predicted from the rounds compiled nearest them on the ladder
  (`_neighbours_predict`): XLA's ratio to the model moves from round to round (XLA
  schedules recomputation its own way), so no one round's ratio predicts the others. The
  first of them predicted to fit.

  Interpolated by position rather than by modeled peak (as it was until 2026-12-06):
  replayed on every recorded search (experiments/RESULTS.md, "Which round, from the
  rounds compiled nearest it"), the refined rounds land 0.12 rounds past the smallest
  fitting one on average instead of 0.19, for 0.25 refinement compiles a search instead
  of 0.22.
  """
  done = dict(compiled)
  fitting = [k for k, size in compiled if fits(size)]
  if not fitting:
    return None
  return next((j for j in range(min(fitting))
               if j not in done and fits(int(_neighbours_predict(peaks, done, j)))), None)


def refine_on_ladder(analysis, dims: Mapping[str, int], searched: Sequence[tuple[int, int]],
                     fits: Callable[[int], bool]) -> int | None:
  """`refine_round` at dims for `searched` [(round, XLA's figure)], walking the rounds in
  ladder order (`_on_ladder`): the round to compile, or None."""
  order, at, ranked = _on_ladder(analysis, dims,
                                 analysis_lib.RoundPeaks(analysis, dims, predicted=True))
  p = refine_round(ranked, [(at[r], size) for r, size in searched], fits)
  return None if p is None else order[p]


def _on_ladder(analysis, dims: Mapping[str, int], peaks: Sequence[int]
               ) -> tuple[tuple[int, ...], dict[int, int], Sequence[int]]:
  """(the rounds in `Analysis.ladder` order, each round's position there, `peaks` read by
  position): the searches walk positions (rounds by the recomputation they add), so an
  annotated step's round as written comes before the planned rounds that recompute more;
  their callers map positions back to rounds."""
  order = analysis.ladder(dims)
  return order, {r: p for p, r in enumerate(order)}, analysis_lib.InOrder(peaks, order)


def _bound(device_limit: bool, size: str = "") -> str:
  """'the budget', or "the device's limit" where no memory_budget was given; with a size
  'the 1.0 MiB budget' / "the device's 1.0 MiB limit"."""
  size = f"{size} " if size else ""
  return f"the device's {size}limit" if device_limit else f"the {size}budget"


def over_budget(nbytes: int, budget: int, reserved: int = 0, *more: int,
                device_limit: bool = False) -> tuple[str, ...]:
  """(`nbytes`, what it must fit in, *`more`) as a BudgetError prints them: 'the <budget>
  budget', or with `reserved` bytes held by other live arrays 'the <budget - reserved>
  that the <budget> budget leaves beside <reserved> held by other live arrays' (none left
  where they hold more than the budget); "the device's <budget> limit" for 'the <budget>
  budget' where no memory_budget was given (`device_limit`). The figures, the room they
  must fit in and `more` share units (`sizes`); the budget and the reserved bytes read on
  their own (8 bytes reserved printed every figure in bytes)."""
  bound = functools.partial(_bound, device_limit)
  figure, room, *rest = sizes(nbytes, max(0, budget - reserved), *more)
  if not reserved:
    return (figure, bound(room), *rest)
  if reserved >= budget:
    return (figure, f"{bound(sizes(budget)[0])}, which {sizes(reserved)[0]} held by other "
                    "live arrays already fill", *rest)
  return (figure, f"the {room} that {bound(sizes(budget)[0])} leaves beside "
                  f"{sizes(reserved)[0]} held by other live arrays", *rest)


@dataclasses.dataclass
class Calibration:
  """What compiled rounds showed of the model under one XLA:CPU scheduler: round -> XLA's
  figure over the prediction (`ratios`), and round -> that prediction (`at`)
  (`compile_round` fills both)."""
  ratios: dict[int, float] = dataclasses.field(default_factory=dict)
  at: dict[int, int] = dataclasses.field(default_factory=dict)


def transferable(calibration: Mapping[int, float], calibrated_at: Mapping[int, int],
                 peaks: Sequence[int]) -> dict[int, float]:
  """The XLA/model ratios that `earlier_round` believes at a shape with modeled peaks
  `peaks`: those measured where that round's modeled peak was at least as large.

  What the model misses includes buffers whose size does not grow with the shape
  (outputs XLA allocates apart, runtime overheads), which weigh more at small shapes:
  a DP-SGD step read 1.52 for round 0 at s=64 and 0.97 at s=256, and the ratio from
  s=64 kept round 0 from being tried at s=256, where it fit. From a smaller shape,
  XLA's ratio for the round just compiled at this shape is the better evidence.
  """
  return {j: r for j, r in calibration.items() if calibrated_at.get(j, 0) >= peaks[j]}


def compile_round(analysis, dims: Mapping[str, int], k: int, policy: CompilePolicy,
                  lower: Callable[[Callable, dict], Any], calibration: Calibration | None
                  ) -> Variant:
  """Round k at dims, compiled with the policy's options for it (`lower(fn, options)`).

  Updates `calibration` (the policy's scheduler's: round -> XLA / predicted, and round ->
  the prediction that ratio was measured against, `Analysis.dispatch_figure`) where XLA's
  figure is truthful; None: no prediction is made (the step as written tried before the
  plan exists, `symmem.jit` under the device's limit)."""
  env = analysis.graph.constraints.complete(dims)
  options, truthful = policy.options_for(analysis, k)
  fn, options = _runner(analysis, k, dims, env, policy, options)
  exe = lower(fn, options)
  # XLA's figure, and the scratch it does not count (a dilated convolution's on CPU).
  size = policy.agree(footprint(exe) + analysis.round_scratch(k, dims))   # same branch everywhere
  if truthful and calibration is not None:
    calibrate(analysis, dims, k, size, calibration)
  logging.info("jax_symmem: compiled %s at %s, round %d: XLA footprint %.1f MiB",
               analysis.traced.fun_name, dims, k, size / 2**20)
  mem = bool(policy.memory_options) and all(
      options.get(key) == value for key, value in policy.memory_options.items()
      if key != SCHEDULER_OPTION)   # the scheduler orders work, never changes numbers
  return Variant(dict(dims), k, exe, size, mem, dict(options),
                 out_tree=getattr(fn, "out_tree", None))


def calibrate(analysis, dims: Mapping[str, int], k: int, size: int,
              calibration: Calibration) -> None:
  """Records XLA's figure `size` for round k at dims against the prediction. XLA fuses and
  schedules on its own, so its figure is the truth (where it sees every buffer: not with
  jax.jit's own options, F2; callers check)."""
  if size:
    calibration.at[k] = analysis.dispatch_figure(k, dims)
    calibration.ratios[k] = size / max(1, calibration.at[k])


def compile_with_fusions(analysis, dims: Mapping[str, int], policy: CompilePolicy,
                         lower: Callable[[Callable, dict], Any],
                         ratios: dict[str, float]) -> Variant | None:
  """Round 0 at dims compiled with XLA:CPU's XNNPACK fusions (round 0 as written: exactly
  as jax.jit compiles it), if XLA's figure, the scratch it leaves out and the largest
  fusion's inner values (`xnnpack.hidden_bytes_bound`) fit the budget; else None.

  `ratios["fusions"]` keeps the largest ratio of that sum to the round's prediction
  (`Analysis.dispatch_figure`) seen at the step's earlier shapes: where it predicts no
  fit, nothing is compiled, so a compile is spent in vain only where the ratios seen so
  far predict a fit that XLA's figure then denies."""
  if policy.budget is None or policy.platform != "cpu" or policy.impose_schedule:
    return None
  predicted = max(1, analysis.dispatch_figure(0, dims))
  ratio = ratios.get("fusions")
  if ratio is not None and not policy.fits(math.ceil(predicted * ratio)):
    return None
  options, _ = policy.options_for(analysis, 0)
  options.pop(FUSION_OPTION, None)   # XLA's own XNNPACK fusions
  fn = round_function(analysis, 0, dims)
  exe = lower(fn, options)
  try:
    hidden = xnnpack.hidden_bytes_bound(exe.as_text())
  except ValueError as e:   # HLO this version does not read: no bound, no such variant
    logging.warning("jax_symmem: no bound on XNNPACK's buffers (%s); round 0 of %s compiles "
                    "without its fusions", e, analysis.traced.fun_name)
    ratios["fusions"] = math.inf
    return None
  size = policy.agree(footprint(exe) + analysis.round_scratch(0, dims) + hidden)
  ratios["fusions"] = max(ratios.get("fusions", 0.0), size / predicted)
  logging.info("jax_symmem: compiled %s at %s, round 0 with XNNPACK fusions: XLA footprint "
               "and their inner values %.1f MiB%s", analysis.traced.fun_name, dims,
               size / 2**20, "" if policy.fits(size) else " (over the budget)")
  if not policy.fits(size):
    return None
  return Variant(dict(dims), 0, exe, size, False, dict(options), xnnpack_fusions=True,
                 out_tree=getattr(fn, "out_tree", None))


# After this many compiles at one shape, none within the budget, the search says so once:
# each further round is a compile (minutes on a large step), and absl shows no INFO lines
# by default (a Gemma step under a tight budget compiled 9 rounds, experiments/RESULTS.md).
LONG_SEARCH = 3


def _warn_long_search(analysis, dims, compiled: Sequence[Variant], policy: CompilePolicy):
  # In bytes where two figures would read the same in MiB (rounds XLA lays out alike).
  *figures, room = sizes(*(v.xla_bytes for v in compiled), policy.budget - policy.reserved)
  logging.warning(
      "jax_symmem: %s at %s: %d rounds compiled and none within %s by XLA's "
      "memory_analysis() (%s; %s available): the other rounds (%d) are compiled "
      "too, one compile each until one fits, then the smallest again with XLA's other "
      "scheduler, before a BudgetError",
      analysis.traced.fun_name, dict(dims), len(compiled), policy.bound,
      ", ".join(f"round {v.round} {f}" for v, f in zip(compiled, figures)), room,
      len(analysis.rounds) - len(compiled))


# Rounds compiled again with XLA:CPU's other scheduler before a refusal: the smallest by
# XLA's figure (a scheduler that suits a step suits its rounds alike: on the decoder below
# it took 27-36 % off each of its three).
OTHER_SCHEDULER_TRIES = 3


def _the_other_scheduler(options: Mapping[str, str]) -> dict:
  """`options` with XLA:CPU's other scheduler: the memory-optimized one for the default."""
  options = dict(options)
  if options.pop(SCHEDULER_OPTION, None) is None:
    options[SCHEDULER_OPTION] = CPU_COMPILER_OPTIONS[SCHEDULER_OPTION]
  return options


def other_scheduler(variant: Variant, policy: CompilePolicy, analysis) -> bool:
  """Whether `variant` was compiled with another XLA:CPU scheduler than `policy` gives
  its round (`_with_the_other_scheduler` found it)."""
  if policy.budget is None or variant.xnnpack_fusions:
    return False
  return (variant.compiler_options.get(SCHEDULER_OPTION)
          != policy.options_for(analysis, variant.round)[0].get(SCHEDULER_OPTION))


def _with_the_other_scheduler(analysis, dims: Mapping[str, int], compiled: list[Variant],
                              policy: CompilePolicy, lower: Callable[[Callable, dict], Any],
                              calibration: Calibration) -> list[Variant]:
  """Where no round fits with its own XLA:CPU scheduler, the `OTHER_SCHEDULER_TRIES`
  smallest by XLA's figure again with the other one, smallest first, until one fits:
  [that variant], or [].

  Each round takes the scheduler that gives the least memory on the steps measured
  (`round_options`), but a step can differ: on a two-layer decoder whose attention masks
  come from `jax.nn.dot_product_attention`'s sequence lengths (b=8, s=256), round 0 took
  51.0 MiB with the default scheduler and 36.5 with the memory-optimized one, below the
  planner's last round (41.7), while on Llama, GPT-2, T5, a ResNet and a UNet the other
  scheduler took as much or more (experiments/RESULTS.md). Paid only before a BudgetError;
  the variants are appended to `compiled`, their figures to `calibration` (the other
  scheduler's: once a step switches to it, its rounds are predicted from them). Not with
  `impose_schedule` (its fences order the program) nor off CPU."""
  if policy.platform != "cpu" or policy.impose_schedule:
    return []
  other = dataclasses.replace(policy, other_scheduler=not policy.other_scheduler)
  for v in sorted(compiled, key=lambda v: v.xla_bytes)[:OTHER_SCHEDULER_TRIES]:
    compiled.append(compile_round(analysis, dims, v.round, other, lower, calibration))
    if policy.fits(compiled[-1].xla_bytes):
      return [compiled[-1]]
  return []


def compile_fitting(analysis, dims: Mapping[str, int], k: int, policy: CompilePolicy,
                    lower: Callable[[Callable, dict], Any],
                    calibrations: Mapping[bool, Calibration],
                    ratios: dict[str, float] | None = None,
                    known: Mapping[int, Variant] | None = None
                    ) -> tuple[Variant, list[Variant]]:
  """Compiles round k at dims, then the rounds `search_rounds` picks while XLA reports
  the last one over the budget (each by `compile_round`). Where k is round 0 and
  `ratios` is given, round 0 with XLA:CPU's XNNPACK fusions comes first
  (`compile_with_fusions`) and is dispatched where it fits.

  `calibrations` holds one `Calibration` per XLA:CPU scheduler (True: the other one);
  rounds are predicted from, and calibrate, the policy's. Where none fits on CPU, the
  smallest compile again with the other scheduler (`_with_the_other_scheduler`),
  calibrating its own.

  `known`: rounds already compiled at dims with the policy's options, read rather than
  compiled again.

  Returns (the variant to dispatch: the fitting one that recomputes least, every
  variant compiled: the fusions variant alone where it is dispatched); raises
  BudgetError when none fits.
  """
  calibration = calibrations[policy.other_scheduler]
  if policy.budget is None:   # round k fits: nothing to search, and no other round to read
    only = compile_round(analysis, dims, k, policy, lower, calibration)
    return only, [only]
  if k == 0 and ratios is not None:
    fast = compile_with_fusions(analysis, dims, policy, lower, ratios)
    if fast is not None:
      return fast, [fast]
  last = remat.last_planned(analysis.rounds)
  compiled: list[Variant] = []
  held: list[int] = []   # each variant's `resident_bytes`, as every process agrees on it

  def xla_bytes(k: int) -> int:
    if len(compiled) == LONG_SEARCH and not any(policy.fits(v.xla_bytes) for v in compiled):
      _warn_long_search(analysis, dims, compiled, policy)
    compiled.append((known or {}).get(k) or
                    compile_round(analysis, dims, k, policy, lower, calibration))
    held.append(policy.agree(resident_bytes(compiled[-1].executable)))   # the same branch everywhere
    return compiled[-1].xla_bytes

  def resident() -> int:   # the least any round can take
    return min(held)

  peaks = analysis_lib.RoundPeaks(analysis, dims, predicted=True)
  scale = (None if policy.budget is None
           else transferable(calibration.ratios, calibration.at, peaks))
  order, at, ranked = _on_ladder(analysis, dims, peaks)
  search_rounds(ranked, at[k], peaks[k] * calibration.ratios.get(k, 1.0),
                lambda p: xla_bytes(order[p]), policy.fits, policy.max_recompiles,
                None if scale is None else {at[r]: v for r, v in scale.items()},
                at[last], at[analysis.as_written_round],
                resident)
  fitting = [v for v in compiled if policy.fits(v.xla_bytes)]
  own = len(compiled)
  if not fitting and policy.fits(resident()):   # else no order of the work can fit
    fitting = _with_the_other_scheduler(analysis, dims, compiled, policy, lower,
                                        calibrations[not policy.other_scheduler])
  if not fitting:
    best = min(compiled, key=lambda v: v.xla_bytes)
    alone = resident()
    figure, room, alone_str = over_budget(best.xla_bytes, policy.budget, policy.reserved, alone,
                                          device_limit=policy.device_limit)
    if not policy.fits(alone):   # no round was left to try: none can fit
      room += f"; its arguments and outputs alone take {alone_str}, whatever it recomputes"
    raise BudgetError(
        f"{analysis.traced.fun_name} at {dict(dims)}: XLA's memory_analysis() reports "
        f"{figure} for the smallest variant compiled (round {best.round} of "
        f"{len(analysis.rounds) - 1}"
        + (", the planner's last" if best.round == last else "")
        + (", the step as written" if analysis.rounds[best.round].as_written else "")
        + (" with the other scheduler" if compiled.index(best) >= own else "")
        + f"; rounds compiled: {', '.join(str(v.round) for v in compiled[:own])}"
        + (f"; again with the other XLA scheduler: "
           f"{', '.join(str(v.round) for v in compiled[own:])}" if compiled[own:] else "")
        + f"), above {room}; {refusal_advice(policy.device_limit)}")
  return min(fitting, key=lambda v: at[v.round]), compiled   # least recomputation
