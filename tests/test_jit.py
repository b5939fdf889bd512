"""symmem.jit: same numbers as jax.jit, host-side decisions, caching, clear errors, fallback."""

import dataclasses
import functools
import gc
import logging as py_logging
import threading

from absl import logging
import chex
import jax
import jax.numpy as jnp
from jax.experimental import checkify
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import device
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import remat
from jax_symmem._src import variants as variants_lib
from jax_symmem._src import xnnpack
from jax_symmem.examples import llama
from jax_symmem.examples import transformer
from tests import budgets
from tests import programs

CFG = transformer.Config(vocab=61, d_model=32, n_heads=2, d_ff=64, n_layers=2)
CONSTRAINTS = ("s >= 2", "b <= 4", "s <= 128")
SHAPES = (None, "b, s", "b, s")


def _args(b, s):
  """transformer.example_args(CFG, b, s)'s arguments, drawn with NumPy (tests/programs.py:
  jax.random's normal and randint compile per shape)."""
  return programs.transformer_args(CFG, b, s)


def _assert_tree_close(got, want, rtol=1e-5):
  chex.assert_trees_all_close(got, want, rtol=rtol, atol=1e-6)   # same structure, leaf by leaf


@functools.lru_cache(maxsize=None)
def _budgeted_step(budget):
  return symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                    constraints=CONSTRAINTS, memory_budget=budget)


def _array_bytes(args) -> int:
  """What the arrays among `args` hold: the live bytes symmem.jit does not reserve."""
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(args) if isinstance(x, jax.Array))


@functools.lru_cache(maxsize=None)
def _jax_jit_outputs(b, s):
  """jax.jit's (loss, params) for _args(b, s), compiled once per shape for
  the module's tests and kept as NumPy arrays: host memory, never among the live arrays
  a budget counts."""
  out = jax.jit(transformer.make_train_step(CFG))(*_args(b, s))
  return jax.device_get(out)


def _min_and_max_peaks(step, dims):
  a = step.analyze(*_args(2, 8))
  peaks = [a.round_peak(k, dims) for k in range(len(a.rounds))]
  return min(peaks), peaks[0], a


def test_matches_jax_jit_without_budget_and_caches_per_shape():
  step = symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                    constraints=CONSTRAINTS)
  # The smallest allowed shape, another, and that one again: a cache hit. (The largest,
  # (4, 128), compiles under a budget and with impose_schedule below.)
  for b, s in ((1, 2), (2, 17), (2, 17)):
    _assert_tree_close(step(*_args(b, s)), _jax_jit_outputs(b, s))
  info = step.cache_info()
  assert info["compiles"] == 2 and info["hits"] == 1 and info["fallback_calls"] == 0


def test_the_step_as_written_compiles_jax_jits_own_program():
  # Sliced along a symbolic dim, the traced program reads with gathers where jax.jit's
  # slices (an Equinox LM's updates then differed from jax.jit's in the last bits).
  # The step as written is compiled from the function itself, with or without a budget.
  def step(x, pos):
    return (x[:, :-1] * x[:, 1:]).sum() + (pos[:x.shape[1]] * x).sum(), x[..., 0]
  x = jnp.asarray(np.random.RandomState(0).randn(4, 16), jnp.float32)
  pos = jnp.arange(64.0)
  traced = symmem.trace(step, x, pos, polymorphic_shapes=("b, s", None),
                        constraints=("s <= 64",))
  assert "gather" in {n.name for n in traced.program.nodes}
  for budget in (None, 2**30):
    f = symmem.jit(step, polymorphic_shapes=("b, s", None), constraints=("s <= 64",),
                   memory_budget=budget)
    out = f(x, pos)
    (variant,) = f.compiled()
    assert variant.round == 0
    ref = jax.jit(step).lower(x, pos).compile(compiler_options=variant.compiler_options)
    assert variant.executable.as_text().count("gather") == ref.as_text().count("gather") == 0
    for a, b in zip(out, ref(x, pos)):
      np.testing.assert_array_equal(a, b)


def test_tight_budget_activates_regions_and_keeps_the_numbers():
  dims = {"b": 4, "s": 128}
  probe = _budgeted_step(None)
  lowest, unoptimized, analysis = _min_and_max_peaks(probe, dims)
  args = _args(4, 128)
  # Between the model's extremes, but never below what XLA reaches with every round.
  budget = budgets.tight_budget(analysis, dims, args)
  round_0_xla = budgets.xla_bytes(analysis, 0, dims, args)   # compiled once, asserted twice
  assert budget < round_0_xla
  step = symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                    constraints=CONSTRAINTS, memory_budget=budget)
  del probe
  _assert_tree_close(step(*args), _jax_jit_outputs(4, 128))
  (variant,) = step.compiled(**dims)
  assert variant.round > 0, "a budget below the unoptimized peak must activate a round"
  # Each compiled round calibrated the model against XLA's memory_analysis().
  (calibration,) = step.calibration()
  assert variant.round in calibration and calibration[variant.round] > 0
  # The recomputation survived XLA: barriers in the HLO, and less temp memory than round 0.
  assert "opt-barrier" in variant.executable.as_text()
  # ... with less memory than round 0 compiled the same way (which the budget excludes).
  assert step.last_call["xla_bytes"] <= budget < round_0_xla
  # Short batches need no eviction, and far below the budget compile as jax.jit would.
  small = _args(1, 8)
  step(*small)
  assert [v.round for v in step.compiled(b=1, s=8)] == [0]
  assert step.compiled(b=1) == step.compiled(b=1, s=8)   # partial dims filter
  assert {v.dims["s"] for v in step.compiled()} == {8, 128} and step.compiled(b=3) == []
  with pytest.raises(ValueError, match="has no dim 'q'; its dims are b, s"):
    step.compiled(q=2)   # a misspelt dim would match nothing, silently
  options = {v["dims"]["s"]: v["memory_options"] for v in step.variants()}
  assert options == {8: False, 128: True}
  assert step.last_call["dims"] == {"b": 1, "s": 8} and step.last_call["round"] == 0


def _mlp_step(ws, x):
  """SGD on a six-layer SiLU MLP: a few rounds, each compiling in a fraction of a second.
  (SiLU's derivative is traced to the same primitives by every jax the pin allows; tanh's
  is one `one_minus_square` from jax 0.12 on, which changes the rounds.)"""
  def loss(ws):
    h = x
    for w in ws:
      h = jax.nn.silu(h @ w)
    return jnp.sum(h ** 2)
  value, grads = jax.value_and_grad(loss)(ws)
  return value, [w - 0.1 * g for w, g in zip(ws, grads)]


def _mlp_args(b):
  rng = np.random.RandomState(0)
  ws = [jnp.asarray(rng.randn(32, 32) / np.sqrt(32), jnp.float32) for _ in range(6)]
  return ws, jnp.asarray(rng.randn(b, 32), jnp.float32)


@pytest.mark.parametrize("case", ["fits", "predicted_over", "over_though_predicted_to_fit"])
def test_under_the_devices_limit_the_step_as_written_compiles_first_and_plans_only_if_over(
    case, monkeypatch):
  # No memory_budget on a device with a limit: a new shape compiles the step as written
  # (round 0) and runs it where XLA's figure fits, without planning. Where the prediction
  # made without a plan says it is over, the step is planned at once and no round 0 is
  # compiled in vain; where XLA's figure says so (the prediction was off), the step is
  # planned after that compile. Either way a round that fits runs.
  args = _mlp_args(512)
  make = lambda: symmem.jit(_mlp_step, polymorphic_shapes=(None, "b, _"), constraints=("b <= 512",))
  analysis = make().analyze(*args)
  tight = budgets.tight_budget(analysis, {"b": 512}, args)
  assert analysis.unplanned_footprint({"b": 512}) > tight
  if case == "over_though_predicted_to_fit":
    monkeypatch.setattr(analysis_lib.Analysis, "unplanned_footprint", lambda self, dims, donated: 0)
  limit, planned = (2**30, False) if case == "fits" else (tight, True)
  want = jax.jit(_mlp_step)(*args)
  arg_bytes = _array_bytes(args)
  monkeypatch.setattr(jit_lib, "_live_bytes", lambda: arg_bytes)   # others' arrays: none
  real, compiled = variants_lib.compile_round, []
  def compile_round(analysis, dims, k, *rest):
    compiled.append(k)
    return real(analysis, dims, k, *rest)
  monkeypatch.setattr(variants_lib, "compile_round", compile_round)
  monkeypatch.setattr(jit_lib, "_device_memory", lambda: (0, limit))
  step = make()
  for _ in range(2):   # the second call hits the variant, still without a plan where none was made
    _assert_tree_close(step(*args), want)
    assert step.analyze(*args).planning.done == planned
    assert (step.last_call["round"] > 0) == planned
    assert step.last_call["xla_bytes"] <= limit and step.last_call["budget"] == limit
  info = step.cache_info()
  assert info["hits"] == 1 and info["budget_errors"] == 0 and info["compiles"] == len(compiled)
  if case == "fits":
    assert compiled == [0]
  elif case == "predicted_over":   # the search starts from the plan's prediction
    assert compiled[0] > 0 and 0 not in step.calibration()[0]
  else:   # round 0 first, once; over the limit, its figure calibrates the plan's prediction
    assert compiled[0] == 0 and compiled.count(0) == 1 and len(compiled) >= 2
    assert 0 in step.calibration()[0]


def test_under_the_devices_limit_the_prediction_before_planning_learns_from_xla(monkeypatch):
  # The prediction made without a plan is corrected by XLA's figure less it at the largest
  # shape whose step as written compiled: a model that understates (here: patched to) no
  # longer costs a compile of a round 0 over the limit at a larger shape, neither before
  # planning nor in the plan's search, whose own figure for round 0 understates too.
  small, large = _mlp_args(64), _mlp_args(512)
  make = lambda: symmem.jit(_mlp_step, polymorphic_shapes=(None, "b, _"), constraints=("b <= 512",))
  analysis = make().analyze(*large)
  limit = budgets.tight_budget(analysis, {"b": 512}, large)
  true = analysis_lib.Analysis.unplanned_footprint
  understated = (limit - 1) / true(analysis, {"b": 512})   # the raw prediction fits
  monkeypatch.setattr(analysis_lib.Analysis, "unplanned_footprint",
                      lambda self, dims, donated=(): int(true(self, dims, donated) * understated))
  planned = analysis_lib.Analysis.dispatch_figure
  monkeypatch.setattr(analysis_lib.Analysis, "dispatch_figure", lambda self, k, dims: int(
      planned(self, k, dims) * (understated if k == 0 else 1)))
  assert analysis.dispatch_figure(0, {"b": 512}) < limit   # round 0 is the plan's first
  monkeypatch.setattr(jit_lib, "_live_bytes", lambda: _array_bytes(large))
  real, compiled = variants_lib.compile_round, []
  def compile_round(analysis, dims, k, *rest):
    compiled.append((dims["b"], k))
    return real(analysis, dims, k, *rest)
  monkeypatch.setattr(variants_lib, "compile_round", compile_round)
  monkeypatch.setattr(jit_lib, "_device_memory", lambda: (0, limit))
  step = make()
  _assert_tree_close(step(*small), jax.jit(_mlp_step)(*small))
  assert compiled == [(64, 0)] and not step.analyze(*small).planning.done
  offset = step.last_call["xla_bytes"] - int(true(analysis, {"b": 64}) * understated)
  assert (limit - 1) + offset > limit   # corrected, the prediction at b=512 is over
  _assert_tree_close(step(*large), jax.jit(_mlp_step)(*large))
  assert step.analyze(*large).planning.done and step.last_call["round"] > 0
  assert (512, 0) not in compiled and step.last_call["xla_bytes"] <= limit


def test_the_models_verdict_under_the_devices_limit_names_the_limit(monkeypatch):
  # No memory_budget: the analysis' bound is the device's limit, and where the op-by-op
  # model finds no round under it, its refusal names the limit, not a budget.
  args = _mlp_args(512)
  make = lambda **kw: symmem.jit(_mlp_step, polymorphic_shapes=(None, "b, _"),
                                 constraints=("b <= 512",), **kw)
  probe = make(memory_budget=2**30).analyze(*args)
  assert not probe.device_limit
  limit = min(probe.round_peak(k, {"b": 512}) for k in range(len(probe.rounds))) // 2
  monkeypatch.setattr(jit_lib, "_device_memory", lambda: (0, limit))
  analysis = make().analyze(*args)
  assert analysis.device_limit and analysis.memory_budget == limit
  assert f"device limit {limit:,} B" in repr(analysis)
  with pytest.raises(symmem.BudgetError, match=r"^the device's [0-9.]+ [KM]iB memory limit is below "
                     r"the smallest achievable peak at \{'b': 512\}.*a device with more memory"):
    analysis.peak_bytes(b=512)
  assert analysis.peak_bytes(b=8) <= limit
  with pytest.raises(symmem.BudgetError, match=r"^memory budget .*raise the budget"):
    make(memory_budget=limit).analyze(*args).peak_bytes(b=512)


# name -> (step, polymorphic shapes, constraints, example args, refused args, their dims)
_REFUSED_STEPS = {
    "mlp": lambda: (_mlp_step, (None, "b, _"), ("b <= 512",), _mlp_args(8), _mlp_args(512),
                    {"b": 512}),
    "transformer": lambda: (transformer.make_train_step(CFG), SHAPES, CONSTRAINTS,
                            _args(2, 8),
                            _args(4, 128), {"b": 4, "s": 128}),
}


# A budget that holds the step's arguments and outputs but none of its rounds: every round
# is compiled before the refusal, then the three smallest again with XLA:CPU's other
# scheduler (the MLP's 9 rounds; the transformer's 14, ~2 s each: slow tier). The search's
# order and its cap before that: tests/test_variants.py.
# Without a memory_budget the device's own limit bounds the step the same way (the MLP's
# `device_limit` case, the limit monkeypatched: the CPU has none), and the error says so.
@pytest.mark.parametrize("name, device_limit", [
    ("mlp", False), ("mlp", True), pytest.param("transformer", False, marks=pytest.mark.slow)])
def test_budget_below_what_xla_reaches_raises_after_asking_xla(name, device_limit, monkeypatch):
  fun, shapes, constraints, example, args, dims = _REFUSED_STEPS[name]()
  probe = symmem.jit(fun, polymorphic_shapes=shapes, constraints=constraints)
  analysis = probe.analyze(*example)
  resident = variants_lib.resident_bytes(jax.jit(fun).lower(*args).compile())
  held_apart = device.live_bytes() - sum(device.array_bytes(a) for a in jax.tree.leaves(args))
  limit = held_apart + resident + 4096
  if device_limit:
    monkeypatch.setattr(jit_lib, "_device_memory", lambda: (None, limit))
  step = symmem.jit(fun, polymorphic_shapes=shapes, constraints=constraints,
                    memory_budget=None if device_limit else limit)
  with pytest.raises(symmem.BudgetError, match=r"XLA's memory_analysis\(\) reports") as e:
    step(*args)
  assert "alone take" not in str(e.value)
  if device_limit:   # no budget was given: the error names the device's limit instead
    assert "the device's" in str(e.value) and "limit" in str(e.value)
    assert "budget" not in str(e.value) and "a device with more memory" in str(e.value)
  else:
    assert "budget" in str(e.value) and "the device's" not in str(e.value)
  info = step.cache_info()
  compiled = budgets.rounds_compiled(e.value)
  assert sorted(compiled) == list(range(len(analysis.rounds))) and len(compiled) >= 3
  # Then the smallest again with XLA:CPU's other scheduler, before refusing.
  again = budgets.rounds_compiled_again(e.value)
  assert len(again) == variants_lib.OTHER_SCHEDULER_TRIES and set(again) <= set(compiled)
  assert info["compiles"] == len(compiled) + len(again) and info["budget_errors"] == 1
  assert info["recompiles"] == info["compiles"] - 1   # counted although the call raised
  with pytest.raises(symmem.BudgetError):   # refused again without compiling again
    step(*args)
  assert step.cache_info()["compiles"] == info["compiles"]
  assert step.cache_info()["budget_errors"] == 2


def _masked_attention_loss(w, x, lengths):
  b, s, d = x.shape
  q, k, v = (jnp.reshape(x @ w[i], (b, s, 2, d // 2)) for i in range(3))
  a = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                   key_value_seq_lengths=lengths, implementation="xla")
  return jnp.mean((x + jnp.reshape(a, (b, s, d))) ** 2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's schedulers")
def test_a_budget_only_xla_cpus_other_scheduler_meets_runs_that_variant():
  # One causal attention layer masked by sequence lengths: each round takes less memory
  # under the XLA:CPU scheduler it does not compile with (round 0 the memory-optimized
  # one, a fenced round the default one) than under its own. Under a budget below every
  # round's own figure but above the other scheduler's, symmem.jit runs that variant
  # rather than refusing.
  fun = jax.grad(_masked_attention_loss)
  rng = np.random.RandomState(0)
  args = (jnp.asarray(rng.randn(3, 8, 8) / np.sqrt(8), jnp.float32),
          jnp.asarray(rng.randn(2, 64, 8), jnp.float32), jnp.asarray([64, 40], jnp.int32))
  dims, specs, constraints = {"b": 2, "s": 64}, (None, "b, s, _", "b"), ("s <= 64", "b <= 4")
  analysis = symmem.jit(fun, polymorphic_shapes=specs, constraints=constraints).analyze(*args)
  flat = jax.tree.leaves(args)
  def footprint(k, options):
    return variants_lib.footprint(jax.jit(variants_lib.round_function(analysis, k, dims)).lower(
        *flat).compile(compiler_options=options))
  own = {k: footprint(k, variants_lib.round_options(analysis, k))
         for k in range(len(analysis.rounds))}
  least = min(own, key=own.get)
  other_options = dict(variants_lib.round_options(analysis, least))
  if other_options.pop(variants_lib.SCHEDULER_OPTION, None) is None:
    other_options[variants_lib.SCHEDULER_OPTION] = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
  other = footprint(least, other_options)
  assert other < 0.9 * own[least]   # the premise, as XLA reports it
  gc.collect()   # as symmem.jit collects before it reads the live bytes: the same reading
  held_apart = device.live_bytes() - sum(device.array_bytes(a) for a in flat)
  budget = held_apart + (own[least] + other) // 2
  step = symmem.jit(fun, polymorphic_shapes=specs, constraints=constraints,
                    memory_budget=budget)
  got = step(*args)
  assert step.last_call["reserved"] == held_apart
  assert step.last_call["round"] == least and step.last_call["xla_bytes"] == other
  assert step.last_call["xla_bytes"] + step.last_call["reserved"] <= budget
  (variant,) = [v for v in step.variants() if v["round"] == least]
  assert variant["compiler_options"] == other_options
  assert step.cache_info()["budget_errors"] == 0
  chex.assert_trees_all_close(got, budgets.same_options_reference(step, fun, args), rtol=0, atol=0)
  chex.assert_trees_all_close(got, jax.jit(fun)(*args), rtol=1e-5, atol=1e-6)
  # Its rounds are now predicted from XLA's figures with that scheduler, not from the
  # usual scheduler's, which every round was compiled with first.
  (calibration,) = step.calibration()
  assert calibration[least] == other / analysis.dispatch_figure(least, dims)
  # The step now compiles its rounds with that scheduler: a new shape as tight takes one
  # compile, not its rounds with the usual scheduler first.
  compiles = step.cache_info()["compiles"]
  args = (args[0], args[1][:, :63], jnp.asarray([63, 40], jnp.int32))
  got = step(*args)
  assert step.cache_info()["compiles"] == compiles + 1 and step.last_call["dims"]["s"] == 63
  (variant,) = [v for v in step.variants() if v["dims"]["s"] == 63]
  usual = variants_lib.round_options(analysis, variant["round"])
  assert (variant["compiler_options"].get(variants_lib.SCHEDULER_OPTION)
          != usual.get(variants_lib.SCHEDULER_OPTION))
  chex.assert_trees_all_close(got, budgets.same_options_reference(step, fun, args), rtol=0, atol=0)


def test_a_budget_below_the_steps_arguments_and_outputs_is_refused_after_one_compile():
  fun, shapes, constraints, example, args, dims = _REFUSED_STEPS["mlp"]()
  resident = variants_lib.resident_bytes(jax.jit(fun).lower(*args).compile())
  step = symmem.jit(fun, polymorphic_shapes=shapes, constraints=constraints,
                    memory_budget=resident // 2)
  with pytest.raises(symmem.BudgetError, match="its arguments and outputs alone take"):
    step(*args)
  assert step.cache_info()["compiles"] == 1


def test_a_shape_that_comes_back_runs_a_round_that_recomputes_less(monkeypatch):
  # XLA's figures are scripted (ratio to the model growing with the round, as measured:
  # experiments/bench_recompile.py), the compiles and runs are real. The first call
  # reaches a fitting round in 2 compiles with the margin; the next call at that shape
  # compiles the round refine_round picks between the two and runs it; later calls hit.
  # On the ladder of values evicted one at a time: with its layer groups this 2-layer
  # step's ladder is coarse (4.5 -> 2.5 MiB in one round at b=4, s=128), with no round
  # between two that this scripted ratio separates (the scenario needs one).
  monkeypatch.setattr(remat, "LAYER_GROUPS", False)
  dims = {"b": 4, "s": 128}
  probe = symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                     constraints=CONSTRAINTS)
  analysis = probe.analyze(*_args(2, 8))
  # What symmem.jit predicts for each round before compiling (the predicted footprint).
  peaks = [analysis.dispatch_figure(k, dims) for k in range(len(analysis.rounds))]
  scripted = [int(p * (1 + 0.04 * k)) for k, p in enumerate(peaks)]

  def scenario(budget):
    fits = lambda x: x <= budget
    k = analysis.best_round(dims, budget, predicted=True)[0]
    tried = variants_lib.search_rounds(peaks, k, peaks[k], scripted.__getitem__, fits,
                                       scale={}, last=len(peaks) - 1)
    j = variants_lib.refine_round(peaks, tried, fits)
    if len(tried) == 2 and fits(tried[1][1]) and j is not None and fits(scripted[j]) \
        and variants_lib.refine_round(peaks, [*tried, (j, scripted[j])], fits) is None:
      return [r for r, _ in tried], j   # one refinement, then hits
    return None
  found = [(b, scenario(b)) for b in range(min(scripted), max(scripted), 1 << 12)]
  budget, (first, refined) = next((b, s) for b, s in found if s is not None)

  real = variants_lib.compile_round
  def compile_round(analysis, dims, k, *args):
    v = real(analysis, dims, k, *args)
    return dataclasses.replace(v, xla_bytes=scripted[k])
  monkeypatch.setattr(variants_lib, "compile_round", compile_round)
  # The scripted budget leaves no room for other live arrays: whatever earlier tests in this
  # process still hold must not count (the arguments alone are live).
  arg_bytes = _array_bytes(_args(4, 128))
  monkeypatch.setattr(jit_lib, "_live_bytes", lambda: arg_bytes)
  step = symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                    constraints=CONSTRAINTS, memory_budget=budget)
  runs = []
  for _ in range(3):
    _assert_tree_close(step(*_args(4, 128)), _jax_jit_outputs(4, 128))
    runs.append((step.last_call["round"], dict(step.cache_info())))
  assert runs[0][0] == first[1] and runs[0][1]["compiles"] == 2
  assert runs[1][0] == refined < first[1] and runs[1][1]["refinements"] == 1
  assert runs[1][1]["compiles"] == 3 and runs[1][1]["recompiles"] == 1
  assert runs[1][1]["executables"] == 1   # the variant it replaced is not kept
  assert runs[2][0] == refined and runs[2][1]["compiles"] == 3 + runs[2][1]["refinements"] - 1


def test_each_call_runs_what_fits_beside_the_live_bytes_it_reads(monkeypatch):
  # A round chosen at one reading was kept for every reading in the same MiB: a call
  # with 0.3 MiB more held elsewhere ran a variant over the budget, and once a call had
  # moved on to a later round, calls with the room back stayed there. XLA's figures are
  # scripted (the compiles and runs are real; no XNNPACK fusions).
  monkeypatch.setattr(variants_lib, "compile_with_fusions", lambda *a, **k: None)
  args, dims = _args(4, 128), {"b": 4, "s": 128}
  analysis = _budgeted_step(None).analyze(*args)
  predicted = [analysis.dispatch_figure(k, dims) for k in range(len(analysis.rounds))]
  real = variants_lib.compile_round
  def compile_round(analysis, dims, k, *rest):   # XLA's figure: what was predicted
    return dataclasses.replace(real(analysis, dims, k, *rest), xla_bytes=predicted[k])
  monkeypatch.setattr(variants_lib, "compile_round", compile_round)
  arg_bytes = _array_bytes(args)
  other = {"bytes": 0}
  monkeypatch.setattr(jit_lib, "_live_bytes", lambda: arg_bytes + other["bytes"])
  budget = predicted[0] + 100_000   # round 0 fits beside less than 0.1 MB held elsewhere
  assert min(predicted) + 300_000 <= budget   # and a later round beside 0.3 MB
  step = _budgeted_step(budget)
  want = _jax_jit_outputs(4, 128)
  runs = []
  for held in (0, 300_000, 300_000, 0, 0):
    other["bytes"] = held
    _assert_tree_close(step(*args), want)
    call = step.last_call
    assert call["xla_bytes"] + call["reserved"] <= budget, call   # never over the budget
    runs.append((call["round"], step.cache_info()["compiles"]))
  rounds, compiles = zip(*runs)
  assert rounds[0] == 0 and rounds[1] == rounds[2] > 0 and rounds[3:] == (0, 0), runs
  assert compiles[0] == 1 and compiles[1] == compiles[4]   # back to round 0: no compile


# XNNPACK's fusion check compiles every round: slow; the other test_jit tests cover round 0 fast.
@pytest.mark.slow
def test_round_0_compiles_as_jax_jit_where_xnnpacks_fusions_fit(monkeypatch):
  if jax.devices()[0].platform != "cpu":
    pytest.skip("XNNPACK fusions are XLA:CPU's")
  if jax.__version_info__ < (0, 10):   # tests/test_xnnpack.py checks that
    pytest.skip("jax 0.9's XLA:CPU forms no XNNPACK fusions by default: nothing to fit")
  fn = transformer.make_train_step(CFG)
  args, dims = _args(4, 128), {"b": 4, "s": 128}
  arg_bytes = _array_bytes(args)
  live = {"other": 0}   # bytes of arrays other than the arguments
  monkeypatch.setattr(jit_lib, "_live_bytes", lambda: arg_bytes + live["other"])
  own = jax.jit(fn).lower(*args).compile()   # jax.jit's own: XNNPACK fuses dots and chains
  with_fusions = variants_lib.footprint(own) + xnnpack.hidden_bytes_bound(own.as_text())
  analysis = _budgeted_step(None).analyze(*args)
  single_dots = budgets.xla_bytes(analysis, 0, dims, args)   # round 0 with single dots
  assert single_dots < with_fusions   # the fusions' inner values cost room
  predicted = analysis.dispatch_figure(0, dims)
  make = lambda budget: symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS,
                                   memory_budget=budget)
  # Room for them: round 0 exactly as jax.jit compiles it, bit for bit jax.jit's numbers.
  step = make(with_fusions)
  chex.assert_trees_all_equal(step(*args), own(*args))
  (variant,) = step.compiled(**dims)
  assert step.last_call["xnnpack_fusions"] and variant.compiler_options == {}
  assert variant.xla_bytes == with_fusions and step.cache_info()["compiles"] == 1
  # Other live arrays take that room: the single-dot round 0 replaces it, within the budget.
  live["other"] = with_fusions - single_dots
  _assert_tree_close(step(*args), _jax_jit_outputs(4, 128))
  assert not step.last_call["xnnpack_fusions"] and step.last_call["round"] == 0
  assert step.last_call["xla_bytes"] + step.last_call["reserved"] <= with_fusions
  assert step.cache_info()["compiles"] == 2
  live["other"] = 0
  # Room for single dots only: tried once, then round 0 with single dots (2 compiles).
  budget = (single_dots + with_fusions) // 2
  assert predicted <= budget   # the planner dispatches round 0 there
  step = make(budget)
  _assert_tree_close(step(*args), _jax_jit_outputs(4, 128))
  assert step.last_call["round"] == 0 and not step.last_call["xnnpack_fusions"]
  assert step.last_call["xla_bytes"] == single_dots and step.cache_info()["compiles"] == 2
  # A shape the learned ratio (with_fusions / predicted) puts over: no second try.
  ratio = with_fusions / predicted
  small = _args(4, 120)
  assert step.analyze(*small).dispatch_figure(0, {"b": 4, "s": 120}) * ratio > budget
  step(*small)
  assert not step.last_call["xnnpack_fusions"] and step.cache_info()["compiles"] == 3
  # Far below the budget they fit again.
  step(*_args(1, 8))
  assert step.last_call["xnnpack_fusions"] and step.cache_info()["compiles"] == 4


def test_no_budget_error_for_a_budget_jax_jit_meets():
  # An elementwise chain: the op-by-op model counts every intermediate, XLA fuses
  # them into one loop, so the model says nothing fits where jax.jit's step does
  # (compiled with the options symmem.jit uses under a budget, which XLA sees through).
  def chain(x):
    for _ in range(6):
      x = jnp.sin(x) * 1.5 + jnp.cos(x)
    return jnp.sum(x)
  x = jnp.linspace(0.0, 1.0, 1 << 18).reshape(512, 512)
  ref_exe = jax.jit(chain).lower(x).compile(compiler_options=jit_lib.CPU_COMPILER_OPTIONS)
  ma = ref_exe.memory_analysis()
  xla = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
  analysis = symmem.analyze(chain, x, polymorphic_shapes=("n, _",), constraints=("n <= 512",))
  lowest = min(analysis.round_peak(k, {"n": 512}) for k in range(len(analysis.rounds)))
  budget = xla + (1 << 20)
  assert lowest > budget   # the model alone would refuse
  step = symmem.jit(chain, polymorphic_shapes=("n, _",), constraints=("n <= 512",),
                    memory_budget=budget)
  np.testing.assert_allclose(step(x), jax.jit(chain)(x), rtol=1e-6)
  assert step.last_call["xla_bytes"] <= budget and step.cache_info()["budget_errors"] == 0


def test_shape_outside_the_constraints_names_dim_and_constraint():
  step = _budgeted_step(None)
  with pytest.raises(symmem.ShapeError, match=r"s = 200 is outside \[2, 128\].*s <= 128"):
    step(*_args(2, 200))


def test_shape_specs_that_do_not_fit_and_a_batch_passed_by_keyword():
  params, tokens, mask = _args(2, 8)
  fresh = symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                     constraints=CONSTRAINTS)
  with pytest.raises(symmem.ShapeSpecError, match="has 3 entries for 4 array arguments"):
    fresh(params, tokens, mask, mask)   # before any trace: the shapes' structure
  step = _budgeted_step(None)
  want = step(params, tokens, mask)
  compiles = step.cache_info()["compiles"]
  # By keyword, as jax.jit takes it: at its position, the same trace and executable.
  chex.assert_trees_all_equal(step(params, tokens, mask=mask), want)
  chex.assert_trees_all_equal(step(params, mask=mask, tokens=tokens), want)
  assert step.cache_info()["compiles"] == compiles


def test_untraceable_function_falls_back_to_jax_jit_with_one_warning(caplog):
  def f(x):
    if x.shape[0] > 3:      # Python control flow on a dim: not traceable symbolically
      return x * 2.0
    return x + 1.0
  g = symmem.jit(f, polymorphic_shapes=("n",))
  with caplog.at_level(py_logging.WARNING):
    for n in (2, 5, 5):
      np.testing.assert_allclose(g(jnp.ones(n)), jax.jit(f)(jnp.ones(n)))
  warnings = [r for r in caplog.records if "falls back to jax.jit" in r.getMessage()]
  assert len(warnings) == 1 and "Python control flow" in warnings[0].getMessage()
  assert g.cache_info()["fallback_calls"] == 3


def test_inside_a_jax_transformation_the_step_is_traced_as_jax_jit_traces_it(caplog):
  # An enclosing jax.jit, vmap, grad or eval_shape passes tracers: no shape to decide for,
  # the enclosing program's memory is XLA's to plan. Before, the compiled executable was
  # called with the tracers (a TypeError from JAX) and each call counted as a cache hit.
  step = symmem.jit(_mlp_step, polymorphic_shapes=(None, "b, _"), constraints=("b <= 64",),
                    memory_budget="1GiB")
  ref = jax.jit(_mlp_step)
  ws, x = _mlp_args(4)
  chex.assert_trees_all_close(step(ws, x), ref(ws, x))   # a direct call: planned
  loss = lambda f: lambda ws, x: f(ws, x)[0]
  with caplog.at_level(py_logging.WARNING):
    chex.assert_trees_all_close(jax.jit(loss(step))(ws, x), jax.jit(loss(ref))(ws, x))
    chex.assert_trees_all_close(jax.grad(loss(step))(ws, x), jax.grad(loss(ref))(ws, x))
    xs = jnp.stack([x, 2 * x])
    chex.assert_trees_all_close(jax.vmap(loss(step), (None, 0))(ws, xs),
                                jax.vmap(loss(ref), (None, 0))(ws, xs))
    chex.assert_trees_all_equal_shapes_and_dtypes(jax.eval_shape(step, ws, x),
                                                  jax.eval_shape(ref, ws, x))
  warnings = [r.getMessage() for r in caplog.records if "inside a JAX transformation" in
              r.getMessage()]
  assert len(warnings) == 1 and "'1GiB'" in warnings[0]   # once, naming the budget
  info = step.cache_info()
  assert info["traced_calls"] == 4 and info["hits"] == 0 and info["compiles"] == 1
  # There a keyword-only array (which a direct call cannot bind to a position) is traced
  # as jax.jit traces it too.
  scaled = symmem.jit(lambda w, *, x: w * x, polymorphic_shapes=(None,))
  np.testing.assert_allclose(jax.jit(lambda w, x: scaled(w, x=x))(2.0, x), 2 * np.asarray(x))
  assert scaled.cache_info()["traced_calls"] == 1


def test_a_planner_defect_falls_back_to_jax_jit_and_analyze_names_it(caplog, monkeypatch):
  # A TypeError from the planner is not the caller's mistake (as one from tracing the
  # caller's function is): symmem.jit runs the step under jax.jit, with one warning.
  from jax_symmem._src import remat
  def broken(*args, **kwargs):
    raise TypeError("a planner defect")
  monkeypatch.setattr(remat, "plan_rounds", broken)
  f = lambda x: jnp.sin(x) * 2.0
  with pytest.raises(symmem.PlanningError, match="a planner defect"):
    symmem.analyze(f, jnp.ones(4), polymorphic_shapes=("n",))
  g = symmem.jit(f, polymorphic_shapes=("n",), memory_budget="1GiB")
  with caplog.at_level(py_logging.WARNING):
    for n in (2, 5):
      np.testing.assert_allclose(g(jnp.ones(n)), jax.jit(f)(jnp.ones(n)))
  warnings = [r for r in caplog.records if "falls back to jax.jit" in r.getMessage()]
  assert len(warnings) == 1 and "a planner defect" in warnings[0].getMessage()
  assert g.cache_info()["fallback_calls"] == 2
  # Without a budget each shape runs as written and nothing is planned: the defect is
  # met only where the plan is read.
  caplog.clear()
  free = symmem.jit(f, polymorphic_shapes=("n",))
  with caplog.at_level(py_logging.WARNING):
    np.testing.assert_array_equal(free(jnp.ones(3)), jax.jit(f)(jnp.ones(3)))
  assert not caplog.records and free.cache_info()["fallback_calls"] == 0
  with pytest.raises(symmem.PlanningError, match="a planner defect"):
    free.analyze(jnp.ones(3)).rounds
  # Under a device's limit it is planned where the step as written does not fit (here
  # predicted over, so planned before any compile): there the defect falls back to
  # jax.jit, as above.
  caplog.clear()
  monkeypatch.setattr(jit_lib, "_device_memory", lambda: (0, 1))   # a 1-byte device
  tiny = symmem.jit(f, polymorphic_shapes=("n",))
  with caplog.at_level(py_logging.WARNING):
    np.testing.assert_array_equal(tiny(jnp.ones(3)), jax.jit(f)(jnp.ones(3)))
  (warning,) = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
  assert "planning at {'n': 3}" in warning and "a planner defect" in warning
  assert tiny.cache_info()["fallback_calls"] == 1 and tiny.cache_info()["compiles"] == 0


def test_static_argnums_and_decorator_form():
  @symmem.jit(polymorphic_shapes=(None, "n"), static_argnums=0)
  def scale(k, x):
    return x * k
  np.testing.assert_allclose(scale(3, jnp.ones(4)), 3 * np.ones(4))
  np.testing.assert_allclose(scale(5, jnp.ones(7)), 5 * np.ones(7))
  assert scale.cache_info()["compiles"] == 2


def test_static_and_donated_arguments_by_name_or_position_as_jax_jit():
  # As jax.jit: a static argument named in static_argnames may be passed positionally (it
  # was taken for a dynamic one, and the shape specs did not fit), one in static_argnums
  # by keyword; donate_argnames donates (it fell back to jax.jit).
  def step(w, x, train=False):
    return (w * 2.0, jnp.sum(x) if train else jnp.mean(x))
  ref = jax.jit(step, static_argnames="train")
  x = jnp.arange(4.0)
  for kwargs in ({"static_argnames": "train"}, {"static_argnums": 2}):
    g = symmem.jit(step, polymorphic_shapes=(None, "n"), **kwargs)
    for call in (lambda f: f(jnp.ones(2), x, True), lambda f: f(jnp.ones(2), x, train=True),
                 lambda f: f(jnp.ones(2), x)):
      chex.assert_trees_all_close(call(g), call(ref))
    assert g.cache_info()["fallback_calls"] == 0
  g = symmem.jit(step, polymorphic_shapes=(None, "n"), donate_argnames="w")
  w = jnp.ones(2)
  new_w, _ = g(w, x)
  np.testing.assert_allclose(new_w, 2 * np.ones(2))
  assert w.is_deleted() and not x.is_deleted() and g.cache_info()["fallback_calls"] == 0


class _Scaled:
  """A model object whose method is the step, jitted with `self` static, as
  `functools.partial(jax.jit, static_argnums=0)` is written on methods."""

  def __init__(self, scale):
    self.scale = scale

  @functools.partial(symmem.jit, static_argnums=0, polymorphic_shapes=(None, "b, s"))
  def step(self, x):
    return jnp.tanh(x * self.scale).sum(-1)

  @functools.partial(jax.jit, static_argnums=0)
  def reference(self, x):
    return jnp.tanh(x * self.scale).sum(-1)


def test_clear_cache_and_static_arguments_as_under_jax_jit():
  step = symmem.jit(lambda x, n: x * n, polymorphic_shapes=("b",), static_argnums=1)
  with pytest.raises(ValueError, match="Non-hashable static arguments are not supported"):
    step(jnp.ones(2), [2])
  with pytest.raises(ValueError, match="Non-hashable static arguments are not supported"):
    jax.jit(lambda x, n: x * n, static_argnums=1)(jnp.ones(2), [2])
  # Names and positions the step lacks: jax.jit's ValueError (a misspelt static name would
  # leave that argument traced, a misspelt donation would donate nothing).
  for bad in (dict(donate_argnames="nope"), dict(donate_argnums=5), dict(static_argnames="m"),
              dict(static_argnums=(1, 5))):
    for jit in (jax.jit, functools.partial(symmem.jit, polymorphic_shapes=("b",))):
      with pytest.raises(ValueError, match=r"invalid argnames \{'(nope|m)'\} in (donate|static)"
                         r"_argnames|argnums=\(.*5,?\), but only accepts 2 positional"):
        jit(lambda x, n: x * n, **bad)
  step(jnp.ones(2), 2)
  assert step.cache_info()["compiles"] == 1 and len(step.compiled()) == 1
  step.clear_cache()   # as jax.jit's: the executables go, the next call compiles anew
  assert step.compiled() == [] and step.variants() == []
  np.testing.assert_array_equal(step(jnp.ones(2), 2), 2 * jnp.ones(2))
  assert step.cache_info()["compiles"] == 2 and len(step.compiled()) == 1
  jax.clear_caches()   # reaches symmem.jit's steps too, as it reaches jax.jit's
  assert step.compiled() == []
  step(jnp.ones(2), 2)
  assert step.cache_info()["compiles"] == 3


def test_a_method_binds_its_instance_as_jax_jit_does():
  a, b = _Scaled(2.0), _Scaled(3.0)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5), jnp.float32)
  for m in (a, b, a):
    np.testing.assert_array_equal(m.step(x), m.reference(x))
  # One trace per instance (a static argument, hashed by identity), shared by the class;
  # the bound method reaches the function's own attributes.
  assert _Scaled.step is _Scaled.__dict__["step"]
  assert a.step.cache_info() == _Scaled.step.cache_info()
  assert _Scaled.step.cache_info()["compiles"] == 2 and _Scaled.step.cache_info()["hits"] == 1
  assert a.step.last_call["dims"] == {"b": 2, "s": 5}
  # Printed as jax.jit's are, with what makes it symmem's.
  assert repr(_Scaled.step).startswith("<SymmemFunction of <function _Scaled.step at ")
  assert repr(_Scaled.step).endswith("(polymorphic_shapes=(None, 'b, s'))>")


def test_under_disable_jit_the_step_runs_as_python_as_jax_jit_does():
  seen = []
  def f(x):
    seen.append(isinstance(x, jax.core.Tracer))
    return jnp.tanh(x).sum(-1)
  step = symmem.jit(f, polymorphic_shapes=("b, s",), memory_budget="1GiB")
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5), jnp.float32)
  with jax.disable_jit():   # a debugger or a print sees the values, op by op
    np.testing.assert_array_equal(step(x), jnp.tanh(x).sum(-1))
  assert seen == [False] and step.cache_info()["compiles"] == 0
  step(x)
  assert step.cache_info()["compiles"] == 1


def _nan_at_a_shape(x):
  return jnp.log(x.sum(-1) - x.shape[1])   # log of a negative: nan


@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_under_debug_nans_a_nan_is_the_floating_point_error_jax_jit_raises(budget):
  x = jnp.ones((2, 5)) * 0.5
  step = symmem.jit(_nan_at_a_shape, polymorphic_shapes=("b, s",), memory_budget=budget)
  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in log"):
      jax.jit(_nan_at_a_shape)(x)
    with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in log"):
      step(x)
  assert bool(jnp.isnan(step(x)).all())   # checks off: the value, as under jax.jit
  # Compiled without the checks, a step donates its argument into an output of its shape:
  # it is gone when a later call finds the nan (compiled with them, it is kept, as by jax.jit).
  donating = symmem.jit(lambda x: (2 * x, _nan_at_a_shape(x)), polymorphic_shapes=("b, s",),
                        donate_argnums=0, memory_budget=budget)
  donating(jnp.full((2, 5), 0.5))
  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError, match="nan.*donates its arguments"):
      donating(jnp.full((2, 5), 0.5))


def test_the_configuration_a_trace_reads_is_traced_anew_as_under_jax_jit():
  x, y = jnp.ones((2, 3)), jnp.ones((3,))
  step = symmem.jit(lambda x, y: (x + y).sum(), polymorphic_shapes=("b, s", "s"))
  assert float(step(x, y)) == 12.0
  with jax.numpy_rank_promotion("raise"):   # (b, s) + (s,) is an error there
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
      jax.jit(lambda x, y: (x + y).sum())(x, y)
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion=.raise."):
      step(x, y)
  half = symmem.jit(lambda x: x + jnp.ones((), jnp.bfloat16), polymorphic_shapes=("b, s",))
  assert half(x).dtype == jnp.float32
  with jax.numpy_dtype_promotion("strict"):
    with pytest.raises(ValueError, match="jax_numpy_dtype_promotion=strict"):   # TypePromotionError
      half(x)
  assert float(step(x, y)) == 12.0 and half(x).dtype == jnp.float32   # the first traces stay


def _checked_loss(w, x):
  for _ in range(3):
    x = jnp.tanh(x @ w)
  loss = jnp.mean(x ** 2)
  checkify.check(loss < 0.9, "loss exploded: {loss}", loss=loss)
  return loss


@pytest.mark.usefixtures("own_arrays_only")   # a budget of a few KiB to 1 MiB
@pytest.mark.parametrize("budget", [None, "1.2MiB"], ids=["as_written", "recomputing"])
def test_a_checkified_step_raises_its_checks_as_under_jax_jit(budget):
  # checkify numbers its checks anew in each trace, in the error's pytree aux data: the
  # outputs of the step as written take the tree of the trace that compiled it.
  step = checkify.checkify(jax.value_and_grad(_checked_loss), errors=checkify.user_checks)
  sj = symmem.jit(step, polymorphic_shapes=(None, "b, s, _"), constraints=("s <= 128", "b <= 32"),
                  memory_budget=budget)
  w, x = jnp.eye(64) * 0.5, jnp.ones((8, 100, 64))
  err, got = sj(w, x)
  err.throw()   # passes
  assert (sj.last_call["round"] == 0) == (budget is None)
  chex.assert_trees_all_close(got, jax.jit(step)(w, x)[1], rtol=1e-5, atol=1e-6)
  w, x = w * 1e6, x * 1e6   # the first x held apart would leave no round within the budget
  del err, got
  err, _ = sj(w, x)
  with pytest.raises(checkify.JaxRuntimeError, match=r"loss exploded: 1.0"):
    err.throw()


def test_eval_shape_as_jax_jit_and_no_lowering_but_where_to_look():
  def f(x, scale):
    return {"y": jnp.tanh(x * scale).sum(-1)}
  step = symmem.jit(f, static_argnums=1, polymorphic_shapes=("b, s",))
  x = jnp.ones((2, 5))
  assert step.eval_shape(x, 2.0) == jax.jit(f, static_argnums=1).eval_shape(x, 2.0)
  assert step.cache_info()["compiles"] == 0
  for method in (step.lower, step.trace):
    with pytest.raises(NotImplementedError, match=r"no single lowering.*\.compiled\(b="):
      method(x, 2.0)


def test_negative_static_argnums_count_from_the_end_as_in_jax_jit():
  def f(x, scale):
    return jnp.tanh(x * scale).sum(-1)
  step = symmem.jit(f, static_argnums=-1, polymorphic_shapes=("b, s",))
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5), jnp.float32)
  for scale in (2.0, 3.0, 2.0):
    np.testing.assert_array_equal(step(x, scale), jax.jit(f, static_argnums=-1)(x, scale))
  assert step.cache_info()["compiles"] == 2 and step.cache_info()["hits"] == 1
  with pytest.raises(TypeError, match="count from 0"):   # no fixed end to count from
    symmem.jit(lambda *a: a[0], static_argnums=-1, polymorphic_shapes=("n",))


def test_dynamic_arguments_by_keyword_take_their_positions_as_jax_jit_traces_them():
  # As under jax.jit, an array argument may be passed by keyword: it goes to its
  # parameter's position (with that position's shape spec), so calls either way share one
  # trace and one executable per shape. A parameter skipped before it takes its default
  # where that has no arrays (None); static keywords stay keywords; each pytree structure
  # of the arguments is traced once, as jax.jit traces it. Specs may cover every parameter.
  def step(w, x, mask=None, bias=None, scale=2.0):
    y = jnp.tanh(x @ w) * scale
    if mask is not None:
      y = y * mask[:, None]
    if bias is not None:
      y = y + bias
    return jnp.sum(y), w - 0.1 * jnp.mean(y)
  ref = jax.jit(step, static_argnames="scale")
  g = symmem.jit(step, polymorphic_shapes=(None, "b, _", "b", "_", None),
                 static_argnames="scale", constraints=("b <= 64",))
  w, bias = jnp.ones((3, 4)) / 3, jnp.arange(4.0)
  X, M = object(), object()   # stand-ins for each shape's batch and mask
  calls = [((), {"w": w, "x": X}), ((w,), {"x": X}), ((w, X), {}),                  # (w, x)
           ((w, X), {"mask": M}), ((w,), {"x": X, "mask": M, "scale": 3.0}),       # + mask
           ((w, X), {"bias": bias})]                                             # mask=None
  b = 5   # one shape: each compile is ~0.5 s, and dims bind per position as ever
  x, m = jnp.linspace(0, 1, 3 * b).reshape(b, 3), jnp.arange(b, dtype=jnp.float32) % 2
  fill = lambda a: x if a is X else m if a is M else a
  for args, kwargs in calls:
    args, kwargs = tuple(map(fill, args)), {k: fill(v) for k, v in kwargs.items()}
    chex.assert_trees_all_close(g(*args, **kwargs), ref(*args, **kwargs), rtol=1e-5, atol=1e-6)
    assert g.last_call["dims"] == {"b": b}
  # Four traces ((w, x); with a mask; with a mask and scale 3; with a bias), one compile
  # each; the first three calls share one executable.
  info = g.cache_info()
  assert (info["compiles"], info["hits"], info["fallback_calls"]) == (4, 2, 0)
  d = symmem.jit(step, polymorphic_shapes=(None, "b, _"), donate_argnames="w")
  w = jnp.ones((3, 4))
  d(x=x, w=w)   # donated by name, passed by keyword
  assert w.is_deleted() and not x.is_deleted()


def test_fractional_budget_needs_a_device_limit():
  with pytest.raises(ValueError, match="reports no memory limit"):
    jit_lib.resolve_budget(0.5)
  with pytest.raises(ValueError, match=r"in \(0, 1\]"):
    jit_lib.resolve_budget(1.5)
  assert jit_lib.resolve_budget(None) is None          # CPU: no limit, no eviction
  assert jit_lib.resolve_budget(123) == 123


# Fast on the six-layer MLP (its last round's regions behind five conditionals; ~1 s
# compiles); the transformer's last round guards many more (two ~5 s compiles): slow.
@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_guarded_rewrite_runs_under_plain_jit(name):
  if name == "mlp":
    probe = symmem.jit(_mlp_step, polymorphic_shapes=(None, "b, _"), constraints=("b <= 512",))
    a = probe.analyze(*_mlp_args(8))
    args, dims = _mlp_args(100), {"b": 100}
    want = jax.jit(_mlp_step)(*args)
  else:
    a = _budgeted_step(None).analyze(*_args(2, 8))
    args, dims = _args(2, 17), {"b": 2, "s": 17}
    want = _jax_jit_outputs(2, 17)
  flat = jax.tree_util.tree_leaves(args)
  for budget in (None, a.rounds[-1].peak_at(dims)):
    fn = jax.jit(a.guarded_function(dims, budget=budget))
    text = fn.lower(*flat).as_text()
    assert "cond" in text or "case" in text
    _assert_tree_close(jax.tree_util.tree_unflatten(a.traced.out_tree, fn(*flat)), want,
                       rtol=1e-5)


def test_threads_share_one_compile_per_variant():
  step = symmem.jit(lambda x: jnp.sum(x * x), polymorphic_shapes=("n",))
  xs = [jnp.ones(9)] * 8
  threads = [threading.Thread(target=step, args=(x,)) for x in xs]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert step.cache_info()["compiles"] == 1


def test_impose_schedule_fences_the_order_and_keeps_the_numbers(monkeypatch):
  monkeypatch.setattr(variants_lib, "IMPOSE_MIN_BYTES", 64 * 1024)   # fence this small model too
  step = symmem.jit(transformer.make_train_step(CFG), polymorphic_shapes=SHAPES,
                    constraints=CONSTRAINTS, impose_schedule=True)
  args = _args(4, 128)
  _assert_tree_close(step(*args), _jax_jit_outputs(4, 128))
  (variant,) = step.compiled()
  assert "opt-barrier" in variant.executable.as_text()


@pytest.mark.usefixtures("own_arrays_only")   # a budget of a few KiB to 1 MiB
def test_jit_options_that_leave_the_program_alone_are_planned_with(tmp_path):
  # keep_unused, inline and compiler_options: no fallback, each round compiled with them
  # (XLA dumps every module it compiles where the user's xla_dump_to says).
  def step(ws, unused, x):
    return _mlp_step(ws, x)
  dump = tmp_path / "xla"
  kw = dict(polymorphic_shapes=(None, None, "b, _"), constraints=("b <= 512",))
  ws, x = _mlp_args(256)
  a = symmem.jit(step, **kw).analyze(ws, jnp.zeros(3), x)
  budget = (a.dispatch_figure(0, {"b": 256}) + a.dispatch_figure(len(a.rounds) - 1, {"b": 256})) // 2
  g = symmem.jit(step, **kw, memory_budget=budget, keep_unused=True, inline=True,
                 compiler_options={"xla_dump_to": str(dump)})
  got = g(ws, jnp.zeros(3), x)
  _assert_tree_close(got, jax.jit(_mlp_step)(ws, x))
  assert g.cache_info()["fallback_calls"] == 0 and g.last_call["round"] > 0
  dumped = {p.name.split(".")[0] for p in dump.iterdir()}
  assert len(dumped) == g.cache_info()["compiles"], dumped


def test_donate_argnums_donates_only_that_argument():
  step = symmem.jit(lambda w, x: (w * 2.0, jnp.sum(x)), polymorphic_shapes=("n", "m"),
                    donate_argnums=0)
  w, x = jnp.ones(5), jnp.ones(3)
  new_w, total = step(w, x)
  np.testing.assert_allclose(new_w, 2 * np.ones(5))
  assert float(total) == 3.0
  assert not x.is_deleted()          # not donated: still usable
  np.testing.assert_allclose(x, np.ones(3))


def test_step_does_not_keep_its_first_arguments_alive():
  # The traced program keeps the bound function; it must not hold the first call's
  # arrays, or they stay resident and count as other live memory against the budget.
  import gc
  import weakref
  step = symmem.jit(lambda x, scale: x * scale, polymorphic_shapes=("b", None),
                    constraints=("b <= 64",), static_argnums=1)
  x = jnp.arange(8.0)
  ref = weakref.ref(x)
  np.testing.assert_allclose(step(x, 3.0), np.arange(8.0) * 3)
  del x
  gc.collect()
  assert ref() is None


def test_fenced_rounds_compile_with_xla_default_scheduler():
  # The memory-optimized scheduler moves fenced recomputation back up (variants.py).
  from jax_symmem._src import variants
  a = _budgeted_step(None).analyze(*_args(2, 8))
  assert variants.round_options(a, 0) == variants.FAST_PATH_CPU_OPTIONS   # nothing recomputed
  k = next(k for k, r in enumerate(a.rounds) if r.blocks)
  options = variants.round_options(a, k)
  assert variants.SCHEDULER_OPTION not in options
  assert options.items() <= variants.CPU_COMPILER_OPTIONS.items()
  assert variants.round_options(a, k, platform="gpu") == variants.GPU_COMPILER_OPTIONS


def test_the_first_call_leaves_no_arrays_behind_for_the_next_budget():
  # Tracing with symbolic dims leaves reference cycles that reached the call's frame:
  # until the cyclic collector ran, the first call's arguments and outputs stayed alive
  # and counted as other live arrays against the next call's budget. Measured: tracing
  # the scanned Llama left ~5,000 objects in cycles, 214 of them arrays.
  cfg = llama.PRESETS["tiny"]
  step = symmem.jit(llama.train_step_fn(llama.Llama(cfg, scan_layers=True)),
                    polymorphic_shapes=SHAPES, constraints=llama.step_constraints(cfg.max_len, 8))
  args = (llama.init_state(cfg, scan_layers=True), *llama.example_batch(cfg, 2, 32))
  held = {id(x) for x in jax.tree_util.tree_leaves(args)}
  gc.collect()
  others = lambda: sum(a.nbytes for a in jax.live_arrays() if id(a) not in held)
  before = others()
  gc.disable()
  try:
    out = step(*args)
    jax.block_until_ready(out)
    del out
    assert others() == before
  finally:
    gc.enable()
