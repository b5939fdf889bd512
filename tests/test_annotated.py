"""Steps that already hold jax.checkpoint / nn.remat regions: undone per shape where memory allows."""

import dataclasses
import functools
import gc

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax.linen import partitioning as nn_partitioning

import jax_symmem as symmem
from jax_symmem._src import interpret
from jax_symmem._src import tracing
from jax_symmem.examples import llama
from tests import budgets

SHAPES = (None, "b, s", "b, s")
CONSTRAINTS = ("s <= 128", "b <= 2", "s >= 2")


def _grad_of_checkpointed(w, x):
  layer = jax.checkpoint(lambda h: jnp.sin(jnp.tanh(h @ w)) @ w.T)
  return jnp.sum(layer(layer(x)) ** 2)


def test_tracing_saving_everything_drops_the_recomputation():
  w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
  fun = jax.grad(_grad_of_checkpointed)
  as_written = tracing.trace(fun, w, x, polymorphic_shapes=(None, "b, _"))
  saving = tracing.trace(fun, w, x, polymorphic_shapes=(None, "b, _"), save_everything=True)
  assert tracing.has_checkpoints(as_written.closed_jaxpr)
  count = lambda t, name: sum(1 for _, n in t.program.walk() if n.name == name)
  # The forward's sin/tanh run twice per layer as written (once recomputed), once saving.
  assert count(as_written, "tanh") == 2 * count(saving, "tanh") == 4
  # The patch is gone after tracing: the next trace recomputes again.
  again = tracing.trace(fun, w, x, polymorphic_shapes=(None, "b, _"))
  assert count(again, "tanh") == 4
  # ... and computes the same gradient.
  program = saving.specialize(b=4)
  (grad,) = jax.jit(lambda *a: interpret.run(program, a))(w, x)
  chex.assert_trees_all_close(grad, jax.jit(fun)(w, x), rtol=1e-6)


@functools.lru_cache(maxsize=None)
def _tiny_llama_analysis(remat_policy, scan):
  """The tiny Llama step planned from its arguments' shapes (analysed, never run); the
  module's tests share each and only read it."""
  cfg = llama.PRESETS["tiny"]
  state = jax.eval_shape(lambda: llama.init_state(cfg, scan_layers=scan))
  batch = jax.eval_shape(lambda: llama.example_batch(cfg, 2, 16))
  return symmem.analyze(llama.train_step_fn(llama.Llama(cfg, remat_policy, scan)), state,
                        *batch, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)


@pytest.fixture(scope="module", autouse=True)
def _release_analyses():
  yield
  _tiny_llama_analysis.cache_clear()
  gc.collect()


# Scanned in the fast tier; unrolled (the same rounds, twice the tracing) slow.
@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True])
def test_rounds_start_without_the_annotation_and_end_as_written(scan):
  analysis = _tiny_llama_analysis("layer", scan)
  plain = _tiny_llama_analysis(None, scan)
  dims = {"b": 2, "s": 128}
  assert analysis.rounds[-1].as_written and not any(r.as_written for r in analysis.rounds[:-1])
  # Round 0 is the step without the user's recomputation: as the unannotated model
  # (within 1 %: inside a scan, the region's backward half stays a separate call whose
  # few small values AD places a little differently).
  assert analysis.round_peak(0, dims) == pytest.approx(plain.round_peak(0, dims), rel=0.01)
  assert analysis.round_peak(len(analysis.rounds) - 1, dims) < analysis.round_peak(0, dims)
  # Without a budget the figures are the step's as written, the static anchor's too: the
  # same program planned with exact shapes (it was round 0's, the checkpoints undone).
  written = analysis.round_peak(analysis.as_written_round, dims)
  assert analysis.peak_bytes(**dims) == written
  assert analysis.static_peak_bytes(**dims) == pytest.approx(written, rel=0.02)
  assert analysis.static_peak_bytes(**dims) < 0.9 * analysis.round_peak(0, dims)


# Compiles three variants: slow; the rounds test covers the plan fast.
@pytest.mark.slow
def test_symmem_jit_skips_the_annotation_where_memory_allows():
  cfg = dataclasses.replace(llama.PRESETS["tiny"], n_layers=1)   # one layer: compiles fast
  state = llama.init_state(cfg)
  fn = llama.train_step_fn(llama.Llama(cfg, "layer"))
  analysis = symmem.analyze(fn, state, *llama.example_batch(cfg, 2, 16),
                            polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  long = {"b": 2, "s": 128}
  budget = budgets.tight_budget(analysis, long, (state, *llama.example_batch(cfg, 2, 128)))
  step = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS, memory_budget=budget)
  for s in (8, 128):
    tokens, mask = llama.example_batch(cfg, 2, s, seed=s)
    out = step(state, tokens, mask)
    (variant,) = [v for v in step.variants() if v["dims"] == {"b": 2, "s": s}]
    options = variant["compiler_options"]   # exactly what symmem.jit compiled with
    expected = jax.jit(fn).lower(state, tokens, mask).compile(compiler_options=options)(
        state, tokens, mask)
    chex.assert_trees_all_close(out, expected, rtol=1e-5, atol=1e-6)
    del out, expected
    if s == 8:
      assert step.last_call["round"] == 0   # no recomputation for the short batch
  assert step.last_call["round"] > 0 and step.last_call["xla_bytes"] <= step.last_call["budget"]


def test_checkpoint_barriers_keep_the_step_as_written_off_the_memory_optimized_scheduler():
  # jax.checkpoint fences a recomputation it differentiates with an optimization barrier
  # on its operands when JAX lowers it; inlining a region keeps that barrier (at the top
  # level for unrolled layers, in the scan body for nn.scan), and a round holding
  # barriers compiles with XLA's default scheduler, which keeps them (variants.py).
  from jax_symmem._src import variants
  cfg = llama.PRESETS["tiny"]
  for scan in (False, True):
    analysis = _tiny_llama_analysis("layer", scan)
    k = len(analysis.rounds) - 1
    program = analysis.rounds[k].program
    assert analysis.rounds[k].as_written
    top = sum(n.name == "optimization_barrier" for n in program.nodes)
    anywhere = sum(n.name == "optimization_barrier" for _, n in program.walk())
    assert top == (0 if scan else cfg.n_layers) and anywhere >= cfg.n_layers // (1 + scan)
    assert not any(n.name == "optimization_barrier" for _, n in analysis.rounds[0].program.walk())
    options = variants.round_options(analysis, k)
    assert variants.SCHEDULER_OPTION not in options
    assert options.items() <= variants.CPU_COMPILER_OPTIONS.items()
    # Without a budget (no device limit), the step runs as written.
    assert analysis.best_round({"b": 2, "s": 128}, None) == (k, True)


# Compiles the step twice: slow; the barrier test above checks the round chosen fast.
@pytest.mark.slow
def test_without_a_budget_the_step_runs_as_written_like_jax_jit():
  # No budget and no device limit (CPU): nothing to fit, so the user's checkpoint
  # regions stay, compiled exactly as jax.jit compiles the step.
  from experiments import _common
  cfg = llama.PRESETS["tiny"]
  state = llama.init_state(cfg, scan_layers=True)
  fn = llama.train_step_fn(llama.Llama(cfg, "layer", True))
  step = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  tokens, mask = llama.example_batch(cfg, 2, 64)
  out = step(state, tokens, mask)
  analysis = step.analyze(state, tokens, mask)
  assert analysis.rounds[step.last_call["round"]].as_written
  ref = jax.jit(fn).lower(state, tokens, mask).compile()
  assert step.last_call["xla_bytes"] == _common.xla_memory(ref)["footprint"]
  chex.assert_trees_all_close(out, ref(state, tokens, mask), rtol=1e-6, atol=1e-7)


# Three XLA compiles: slow; the barrier test above checks the fences fast.
@pytest.mark.slow
def test_the_step_as_written_keeps_its_recomputation_in_xla():
  # Without jax.checkpoint's barriers, XLA merged the inlined recomputation with the
  # forward pass: the round "as written" allocated as much as the step without remat.
  from experiments import _common
  from jax_symmem._src import variants
  cfg = llama.PRESETS["tiny"]
  state = llama.init_state(cfg)
  fn = llama.train_step_fn(llama.Llama(cfg, "layer"))
  analysis = symmem.analyze(fn, state, *llama.example_batch(cfg, 2, 16),
                            polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  dims, args = {"b": 2, "s": 128}, (state, *llama.example_batch(cfg, 2, 128))
  flat = jax.tree_util.tree_leaves(args)
  k = len(analysis.rounds) - 1
  options = variants.round_options(analysis, k)
  footprint = lambda lowered: _common.xla_memory(lowered.compile(compiler_options=options))[
      "footprint"]
  as_written = footprint(jax.jit(variants.round_function(analysis, k, dims)).lower(*flat))
  unannotated = footprint(jax.jit(variants.round_function(analysis, 0, dims)).lower(*flat))
  assert as_written == footprint(jax.jit(fn).lower(*args)) < 0.8 * unannotated


# --- layers checkpointed as transformers' Flax models do it --------------------------------
class _EncoderLayer(nn.Module):
  """Self-attention and an MLP over (b, s, d), with the flags transformers' Flax layers
  take positionally (init_cache, deterministic, output_attentions): static under remat."""
  d: int = 16

  @nn.compact
  def __call__(self, h, mask, init_cache=False, deterministic=True, output_attentions=False):
    del init_cache, output_attentions
    q, k, v = (nn.Dense(self.d, name=n)(h) for n in ("q", "k", "v"))
    logits = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(self.d)
    probs = jax.nn.softmax(jnp.where(mask[:, None, :] > 0, logits, -1e9), axis=-1)
    h = nn.LayerNorm()(h + jnp.einsum("bqk,bkd->bqd", probs, v))
    mlp = nn.Dense(self.d)(jnp.tanh(nn.Dense(4 * self.d)(h)))
    return (nn.LayerNorm()(h + nn.Dropout(0.1, deterministic=deterministic)(mlp)),)


class _Encoder(nn.Module):
  gradient_checkpointing: bool = False

  @nn.compact
  def __call__(self, x, mask):
    # transformers' pattern (FlaxBertLayerCollection, FlaxT5Stack): flax.linen.partitioning's
    # remat with the flags static, layers named by their index.
    layer = (nn_partitioning.remat(_EncoderLayer, static_argnums=(2, 3, 4))
             if self.gradient_checkpointing else _EncoderLayer)
    for i in range(2):
      x = layer(name=str(i))(x, mask, False, True, False)[0]
    return x


def _encoder_step(checkpointed):
  model = _Encoder(checkpointed)

  def step(params, x, mask):
    loss = lambda p: jnp.sum(jnp.square(model.apply({"params": p}, x, mask)) * mask[..., None])
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree_util.tree_map(lambda p, g: p - 1e-2 * g, params, grads)

  return step


# Slow: the Flax annotated tests above undo annotations in the fast tier.
@pytest.mark.slow
def test_transformers_style_checkpointed_layers_are_undone_where_memory_allows():
  x, mask = jnp.ones((2, 8, 16)) / 4, jnp.ones((2, 8)).at[1, 6:].set(0.0)
  params = _Encoder().init(jax.random.PRNGKey(0), x, mask)["params"]
  shapes, constraints = (None, "b, s, _", "b, s"), ("s <= 256", "b <= 4")
  fn = _encoder_step(True)
  analysis = symmem.analyze(fn, params, x, mask, polymorphic_shapes=shapes,
                            constraints=constraints)
  count = lambda program, name: sum(n.name == name for _, n in program.walk())
  k = len(analysis.rounds) - 1
  assert analysis.rounds[k].as_written and analysis.as_written_round == k
  # Round 0 is the step without the recomputation (the forward's tanh once per layer),
  # as written it recomputes each layer behind jax.checkpoint's barriers.
  assert count(analysis.rounds[0].program, "tanh") == 2
  assert count(analysis.rounds[k].program, "tanh") == 4
  assert count(analysis.rounds[k].program, "optimization_barrier") >= 2
  assert not count(analysis.rounds[0].program, "optimization_barrier")
  dims = {"b": 2, "s": 256}
  assert analysis.round_peak(k, dims) < analysis.round_peak(0, dims)
  # The ladder symmem.jit walks: the planner's rounds in order, the step as written
  # before the first of them that recomputes more FLOPs (walked here node by node).
  from jax_symmem._src.flops import flops
  env = analysis.graph.constraints.complete(dims)
  walked = [sum(flops(r.graph, n).evaluate(env) for n in r.program.nodes)
            for r in analysis.rounds]
  ladder = analysis.ladder(dims)
  at = next((j for j in range(1, k) if walked[j] > walked[k]), k)
  assert ladder == tuple(range(at)) + (k,) + tuple(range(at, k))
  assert at < k   # here the planner's later rounds recompute more than the annotation
  plain = _tiny_llama_analysis(None, True)   # no jax.checkpoint regions: index order
  assert plain.ladder({"b": 2, "s": 128}) == tuple(range(len(plain.rounds)))
  # Where XLA put the rounds before it over the budget (a calibration of 10x), the step as
  # written runs, not a planned round that recomputes more in as little memory.
  budget = analysis.dispatch_figure(k, dims)
  over = {j: 10.0 for j in range(at)}
  assert analysis.best_round(dims, budget, scale=over, predicted=True) == (k, True)
  # With it over too, the first planned round after them that fits (the budget raised to
  # where one does: here the step as written is predicted the smallest).
  budget = max(budget, min(analysis.dispatch_figure(j, dims) for j in range(at, k)))
  assert analysis.best_round(dims, budget, scale={**over, k: 10.0}, predicted=True) == (
      next(j for j in ladder if j not in over and j != k
           and analysis.dispatch_figure(j, dims) <= budget), True)
  # Every round computes jax.jit's numbers (the annotated step's, as written).
  from jax_symmem._src import variants
  flat = jax.tree_util.tree_leaves((params, x, mask))
  want = jax.tree_util.tree_leaves(jax.jit(fn)(params, x, mask))
  for j in (0, k):
    got = jax.jit(variants.round_function(analysis, j, {"b": 2, "s": 8}))(*flat)
    chex.assert_trees_all_close(list(got), want, rtol=1e-5, atol=1e-6)
