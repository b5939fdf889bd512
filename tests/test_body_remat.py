"""Rematerialization inside a scan body that holds a whole forward and backward pass
(gradient accumulation over microbatches): planned, rewritten, exact, replayable."""

import functools
import gc

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import body_remat
from jax_symmem._src import loop_remat
from jax_symmem._src import variants
from tests import programs
from tests import test_plan_cache

D, V = 16, 32
SHAPES = (None, "m, b, s", "m, b, s")
CONSTRAINTS = ("m <= 4", "b <= 4", "s >= 2", "s <= 64")


def _loss(attention):
  def loss(p, tokens, mask):
    x = p["embed"][tokens]
    for w1, w2 in p["layers"]:
      x = x + jax.nn.gelu(x @ w1) @ w2
      if attention:   # a (b, s, s) value: the body's peak moves with s
        a = jax.nn.softmax(jnp.einsum("bsd,btd->bst", x, x) / 4.0, axis=-1)
        x = x + jnp.einsum("bst,btd->bsd", a, x)
    logp = jax.nn.log_softmax(x @ p["embed"].T)
    nll = -jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)
  return loss


def _step(attention, unroll=1):
  """SGD on gradients accumulated over the microbatches: a scan whose body runs
  value_and_grad, as gradient-accumulation code writes it."""
  loss = _loss(attention)
  def step(params, tokens, mask):   # tokens, mask: (m, b, s)
    def body(grads, batch):
      value, g = jax.value_and_grad(loss)(params, *batch)
      return jax.tree.map(jnp.add, grads, g), value
    grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (tokens, mask),
                                 unroll=unroll)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), losses.mean()
  return step


def _params(layers=2, seed=0):
  rng = np.random.RandomState(seed)
  w = lambda *shape: jnp.asarray(rng.randn(*shape).astype(np.float32) / np.sqrt(shape[0]))
  return {"embed": w(V, D), "layers": [(w(D, 4 * D), w(4 * D, D)) for _ in range(layers)]}


def _batch(m, b, s, seed=1):
  rng = np.random.RandomState(seed)
  tokens = jnp.asarray(rng.randint(0, V, (m, b, s)), jnp.int32)
  mask = jnp.asarray((rng.rand(m, b, s) > 0.2).astype(np.float32))
  return tokens, mask


@functools.lru_cache(maxsize=None)
def _analyze(attention):
  """The step's analysis, planned once for the module's tests (which only read it)."""
  return symmem.analyze(_step(attention), _params(), *_batch(2, 2, 8),
                        polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)


@pytest.fixture(scope="module", autouse=True)
def _release_analyses():
  # Nothing this module planned stays alive (or counts as live arrays) in later modules.
  yield
  _analyze.cache_clear()
  gc.collect()


def _body_evictions(analysis):
  return [r for rnd in analysis.rounds for r in rnd.regions
          if isinstance(r, body_remat.BodyEviction)]


def _run_round(analysis, k, dims, args):
  out = jax.jit(variants.round_function(analysis, k, dims))(*jax.tree_util.tree_leaves(args))
  return jax.tree_util.tree_unflatten(analysis.traced.out_tree, list(out))


# Without attention slow; with it (the harder body) fast.
@pytest.mark.parametrize("attention", [pytest.param(False, marks=pytest.mark.slow), True])
def test_every_round_of_a_gradient_accumulation_step_computes_what_jax_jit_does(attention):
  analysis = _analyze(attention)
  evictions = _body_evictions(analysis)
  assert evictions, "the body's activations must be eviction candidates"
  scans = {e.node for e in evictions}
  assert all(analysis.rounds[0].program.nodes[i].name == "scan" for i in scans)
  dims = {"m": 3, "b": 4, "s": 64}
  env = analysis.graph.constraints.complete(dims)
  assert all(e.cost == e.item.cost * e.trips for e in evictions)
  assert all(e.trips.evaluate(env) == 3 for e in evictions)   # the scan runs over m
  peaks = [analysis.round_peak(k, dims) for k in range(len(analysis.rounds))]
  assert peaks[-1] < 0.8 * peaks[0], peaks
  args = (_params(seed=2), *_batch(3, 4, 64, seed=3))
  ref = jax.jit(_step(attention))(*args)
  last = len(analysis.rounds) - 1
  # Fast (attention): the first body round and the last; slow: every round.
  for k in (range(last + 1) if not attention else (0, 1, last)):
    chex.assert_trees_all_close(_run_round(analysis, k, dims, args), ref, rtol=2e-5, atol=1e-6)


def test_regenerations_run_inside_the_scan_behind_fences():
  analysis = _analyze(True)
  last = analysis.rounds[-1]
  (index,) = {e.node for e in _body_evictions(analysis)}
  body = last.program.nodes[index].subprograms[0]
  names = [n.name for n in body.nodes]
  assert "optimization_barrier" in names
  assert any(n.source.endswith("[recomputed]") for n in body.nodes)
  # The re-traced body still cites the user's source lines.
  assert any("test_body_remat.py" in n.source for n in body.nodes)
  assert len(last.program.nodes) == len(analysis.rounds[0].program.nodes)


def test_model_of_body_rounds_equals_running_the_body_op_by_op():
  analysis = _analyze(True)
  programs.assert_rounds_model_the_executor(analysis, {"m": 2, "b": 2, "s": 16},
                                            (_params(), *_batch(2, 2, 16)))


def test_body_rounds_replay_from_a_plan_file(tmp_path):
  def analyze():
    return analysis_lib.analyze_function(
        _step(True), _params(), *_batch(2, 2, 8), polymorphic_shapes=SHAPES,
        constraints=CONSTRAINTS, plan_cache_dir=str(tmp_path))
  cold, warm = analyze(), analyze()
  assert cold.origin == "planned" and warm.origin != "planned"
  assert _body_evictions(cold)
  test_plan_cache._assert_same_plan(cold, warm, dims=({"m": 2, "b": 4, "s": 64},))
  assert warm.plan == cold.plan


# Compiles four variants: slow; the fast tier checks every round's numbers and the last
# round's XLA footprint (test_the_last_body_round_lowers_what_xla_allocates).
@pytest.mark.slow
def test_symmem_jit_fits_a_budget_with_body_rounds_and_matches_jax_jit():
  step_fn = _step(True)
  analysis = _analyze(True)
  dims = {"m": 2, "b": 4, "s": 64}
  peaks = [analysis.round_peak(k, dims) for k in range(len(analysis.rounds))]
  step = symmem.jit(step_fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS,
                    memory_budget=(peaks[0] + peaks[-1]) // 2)
  params = _params()
  for m, s in ((2, 8), (2, 64)):
    batch = _batch(m, 4, s, seed=s)
    out = step(params, *batch)
    assert step.last_call["xla_bytes"] <= step.last_call["budget"]
    (variant,) = [v for v in step.variants() if v["dims"] == {"m": m, "b": 4, "s": s}]
    options = variant["compiler_options"]   # exactly what symmem.jit compiled with
    expected = jax.jit(step_fn).lower(params, *batch).compile(compiler_options=options)(
        params, *batch)
    chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-6)
    del out, expected
  assert step.last_call["round"] > 0   # the long microbatches needed the body's rounds


def test_body_rounds_compile_with_the_default_scheduler():
  # Fences inside a scan body are undone by XLA's memory-optimized scheduler too.
  analysis = _analyze(True)
  k = len(analysis.rounds) - 1
  assert not any(n.name == "optimization_barrier" for n in analysis.rounds[k].program.nodes)
  options = variants.round_options(analysis, k)
  assert variants.SCHEDULER_OPTION not in options
  assert options.items() <= variants.CPU_COMPILER_OPTIONS.items()


def _footprint(analysis, k, dims, flat):
  """XLA's footprint of round k at dims, compiled as symmem.jit compiles it under a budget."""
  from experiments import _common
  lowered = jax.jit(variants.round_function(analysis, k, dims)).lower(*flat)
  compiled = lowered.compile(compiler_options=variants.round_options(analysis, k))
  return _common.xla_memory(compiled)["footprint"]


def test_a_rebuilt_body_runs_one_microbatch_at_a_time_whatever_the_traced_unroll():
  # unroll=2 over m=3 microbatches: XLA would run two bodies' recomputations per trip and
  # split and concatenate the stacked losses; the rebuilt scan runs rolled, as planned.
  unrolled = symmem.analyze(_step(True, unroll=2), _params(), *_batch(2, 2, 8),
                            polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  rolled = _analyze(True)
  assert len(unrolled.rounds) == len(rolled.rounds) and _body_evictions(unrolled)
  last = len(rolled.rounds) - 1
  dims, args = {"m": 3, "b": 4, "s": 64}, (_params(seed=2), *_batch(3, 4, 64, seed=3))
  flat = jax.tree_util.tree_leaves(args)
  assert _footprint(unrolled, last, dims, flat) == _footprint(rolled, last, dims, flat)
  chex.assert_trees_all_close(_run_round(unrolled, last, dims, args),
                              jax.jit(_step(True, unroll=2))(*args), rtol=2e-5, atol=1e-6)


def test_the_last_body_round_lowers_what_xla_allocates():
  # The recomputation stays inside the loop in XLA: the last round's footprint, compiled
  # as symmem.jit compiles it under a budget, is well below round 0's.
  analysis = _analyze(True)
  dims = {"m": 2, "b": 4, "s": 64}
  flat = jax.tree_util.tree_leaves((_params(), *_batch(2, 4, 64)))
  first = _footprint(analysis, 0, dims, flat)
  last = _footprint(analysis, len(analysis.rounds) - 1, dims, flat)
  assert last < 0.8 * first, (last, first)


# -- gradient accumulation over a scanned model: the layer scan pair inside the body --------

LAYERS = 3


def _scanned_layer(h, w):
  probs = jax.nn.softmax(jnp.einsum("bsd,btd->bst", h @ w, h) / 4.0, axis=-1)
  return h + jnp.tanh(jnp.einsum("bst,btd->bsd", probs, h) @ w), None


def _nested_step(checkpoint_layers=False):
  """Microbatches scanned in the step, layers scanned in the loss (stacked weights)."""
  layer = jax.checkpoint(_scanned_layer) if checkpoint_layers else _scanned_layer
  def loss(ws, x):
    return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)
  def step(ws, xs):   # xs: (m, b, s, D)
    def micro(g, x):
      return g + jax.grad(loss)(ws, x), None
    return ws - 0.1 * jax.lax.scan(micro, jnp.zeros_like(ws), xs)[0]
  return step


def _nested_args(m, b, s, seed=0):
  rng = np.random.RandomState(seed)
  return (jnp.asarray(rng.randn(LAYERS, D, D).astype(np.float32) / 4),
          jnp.asarray(rng.randn(m, b, s, D).astype(np.float32)))


@pytest.fixture(scope="module")
def nested():
  return symmem.analyze(_nested_step(), *_nested_args(2, 2, 8), polymorphic_shapes=(None, "m, b, s, _"),
                        constraints=("m <= 4", "b <= 4", "s <= 128"))


def test_residuals_of_a_scanned_model_inside_accumulation_are_evicted_exactly(nested):
  evictions = _body_evictions(nested)
  assert evictions and all(isinstance(e.item, loop_remat.LoopEviction) for e in evictions)
  dims = {"m": 2, "b": 4, "s": 128}
  peaks = [nested.round_peak(k, dims) for k in range(len(nested.rounds))]
  assert peaks[-1] < 0.6 * peaks[0], peaks
  args = _nested_args(2, 4, 128, seed=1)
  ref = jax.jit(_nested_step())(*args)
  for k in range(len(nested.rounds)):
    chex.assert_trees_all_close(_run_round(nested, k, dims, args), ref, rtol=2e-5, atol=1e-6)
  # The model of every round is what running it op by op, loops included, allocates.
  programs.assert_rounds_model_the_executor(nested, {"m": 2, "b": 2, "s": 16},
                                            _nested_args(2, 2, 16), range(len(nested.rounds)))


def test_the_nested_last_round_reaches_per_layer_checkpointing_in_xla(nested):
  # As symmem.jit compiles it under a budget (a body rewrite: XLA's default scheduler),
  # against jax.checkpoint on the scanned layer compiled with the same options.
  from experiments import _common
  dims = {"m": 2, "b": 4, "s": 128}
  args = _nested_args(2, 4, 128)
  flat = jax.tree_util.tree_leaves(args)
  last = len(nested.rounds) - 1
  options = variants.round_options(nested, last)
  assert variants.SCHEDULER_OPTION not in options
  def footprint(fn, k_options):
    return _common.xla_memory(jax.jit(fn).lower(*flat).compile(
        compiler_options=k_options))["footprint"]
  first = footprint(variants.round_function(nested, 0, dims), variants.round_options(nested, 0))
  ours = footprint(variants.round_function(nested, last, dims), options)
  per_layer = footprint(lambda ws, xs: _nested_step(checkpoint_layers=True)(ws, xs), options)
  assert ours < 0.6 * first and ours <= 1.05 * per_layer, (ours, per_layer, first)


def test_nested_rounds_replay_from_a_plan_file(tmp_path):
  def analyze():
    return analysis_lib.analyze_function(
        _nested_step(), *_nested_args(2, 2, 8), polymorphic_shapes=(None, "m, b, s, _"),
        constraints=("m <= 4", "b <= 4", "s <= 128"), plan_cache_dir=str(tmp_path))
  cold, warm = analyze(), analyze()
  assert cold.origin == "planned" and warm.origin != "planned" and _body_evictions(cold)
  test_plan_cache._assert_same_plan(cold, warm, dims=({"m": 2, "b": 4, "s": 64},))
  assert warm.plan == cold.plan


def test_no_value_is_attributed_to_jax_symmems_own_code(nested):
  # A rewritten scan body is re-traced from the planner: its ops' frames are ours, and
  # the frames beyond them the planner's caller; neither is where the op was written.
  for analysis in (nested, _analyze(True)):
    for r in analysis.rounds:
      for _, node in r.program.walk():
        assert "jax_symmem/_src" not in node.source and "jax_symmem\\_src" not in node.source
    assert "tracing.py" not in analysis.plan
