"""The Flax examples: the one-flag switch to symmem.jit keeps the numbers, bucketing, tracing."""

import dataclasses
import gc
from unittest import mock

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem.examples import batching
from jax_symmem.examples import gpt2
from jax_symmem.examples import llama
from jax_symmem.examples import llama_nnx
from tests import budgets

CFG = llama.PRESETS["tiny"]
# The fast tier's model: one narrow layer, the same code paths, quicker to trace and compile.
CFG_ONE_LAYER = llama.LlamaConfig(vocab=64, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                                  max_len=64)
CONFIGS = {"tiny": CFG, "one_layer": CFG_ONE_LAYER}
# Three steps at two shapes: a second shape compiles, the repeat is a cache hit.
BATCHES = ((2, 16), (3, 40), (2, 16))
# The fast tier's one-layer linen run: three steps at one shape (a compile, two hits).
# A second shape under the flag compiles in the tiny runs (slow tier); symmem.jit's
# compile per shape is covered fast by test_jit's no-budget test.
BATCH_SHAPES = {"tiny": BATCHES, "one_layer": ((2, 16),) * 3}
SHAPES = (None, "b, s", "b, s")
MAX_LEN, MAX_BATCH = 64, 4


def _batches(cfg=CFG, shapes=BATCHES):
  return [llama.example_batch(cfg, b, s, seed=k) for k, (b, s) in enumerate(shapes)]


def _assert_tree_close(got, want):
  # atol only for elements at or near zero, where rtol alone would demand bitwise
  # equality. Under a budget the fast path compiles without XNNPACK fusions (so that
  # memory_analysis() sees every buffer), which changes gradients by ~1e-7; AdamW's
  # m / sqrt(v) amplifies that on near-zero gradients: observed 4.5e-6 on 1 of 11,008
  # parameters after 3 steps. Without a budget the results are bitwise jax.jit's.
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def _run_linen(step, initial, cfg=CFG, shapes=BATCHES):
  state, losses = initial, []
  for tokens, mask in _batches(cfg, shapes):
    state, loss = step(state, tokens, mask)
    losses.append(float(loss))
  return state, losses


@pytest.fixture(scope="module")
def linen_states():
  """config name -> (initial state, jax.jit's (state, losses) after the batches).

  Immutable arrays, never donated: safe to share between tests. Module scope, so
  they are released (and not counted as live by later modules' tests) afterwards.
  """
  inits, refs = {}, {}
  def get(name, reference=True):
    if name not in inits:
      inits[name] = llama.init_state(CONFIGS[name], seed=0)
    if reference and name not in refs:
      refs[name] = _run_linen(llama.make_train_step(CONFIGS[name]), inits[name], CONFIGS[name],
                              BATCH_SHAPES[name])
    return inits[name], refs.get(name)
  yield get
  inits.clear()
  refs.clear()
  gc.collect()


# The tiny preset (and without a budget, which compiles exactly as jax.jit: test_jit
# covers that path fast) in the slow tier; one layer with a budget in the fast one.
@pytest.mark.parametrize("name,budget", [
    ("one_layer", 2**30),
    pytest.param("tiny", 2**30, marks=pytest.mark.slow),
    pytest.param("tiny", None, marks=pytest.mark.slow)])
def test_linen_symmem_flag_matches_jax_jit(name, budget, linen_states):
  cfg = CONFIGS[name]
  initial, (want_state, want_losses) = linen_states(name)
  step = llama.make_train_step(cfg, use_symmem=True, memory_budget=budget, max_len=MAX_LEN,
                               max_batch=MAX_BATCH)
  assert isinstance(step, symmem.SymmemFunction)
  shapes = BATCH_SHAPES[name]
  state, losses = _run_linen(step, initial, cfg, shapes)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  _assert_tree_close(state, want_state)
  info = step.cache_info()
  assert info["fallback_calls"] == 0, "symmem.jit fell back to jax.jit"
  assert info["compiles"] == len(set(shapes)) and info["hits"] == len(shapes) - info["compiles"]
  assert losses[2] < losses[0]   # the same batch shape again, after two AdamW steps


def _check_nnx_flag_matches_jax_jit(cfg, batches):
  results, initial = [], llama_nnx.init_state(cfg, seed=0)
  for use_symmem in (False, True):
    model, optimizer = nnx.clone(initial)   # independent Variables, the same initial values
    step = llama_nnx.make_nnx_train_step(model, optimizer, use_symmem=use_symmem,
                                         memory_budget=2**30 if use_symmem else None,
                                         max_len=MAX_LEN, max_batch=MAX_BATCH)
    losses = [float(step(model, optimizer, tokens, mask)) for tokens, mask in batches]
    results.append((losses, nnx.state((model, optimizer)), step))
  (want_losses, want_state, _), (losses, state, step) = results
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  _assert_tree_close(state, want_state)
  assert isinstance(step.jitted, symmem.SymmemFunction)
  info = step.jitted.cache_info()
  assert info["fallback_calls"] == 0, "symmem.jit fell back to jax.jit"
  assert info["compiles"] == len({t.shape for t, _ in batches})
  assert info["hits"] == len(batches) - info["compiles"]
  assert int(optimizer.step[...]) == len(batches)   # the state was written back each call


# Slow: its behaviour is covered fast by test_nnx_scanned_layers_symmem_flag_matches_jax_jit
# [layer-one_shape] (the NNX flag: jax.jit's losses and the whole model and optimizer
# state written back, two steps at one shape) and test_linen_symmem_flag_matches_jax_jit
# [one_layer-...] (a memory budget through the flag); ~13 s of compiles and init.
@pytest.mark.slow
def test_nnx_symmem_flag_matches_jax_jit_one_layer():
  # The NNX path on a one-layer model, two steps at one shape (a compile, then a hit).
  cfg = CFG_ONE_LAYER
  _check_nnx_flag_matches_jax_jit(cfg, [llama.example_batch(cfg, 2, 16, seed=k) for k in (0, 1)])


# Two steps at one shape (a compile, then a cache hit) in the fast tier; at two (b, s)
# shapes in the slow one (each shape compiles jax.jit's and symmem.jit's scanned step:
# ~6 s apiece on 2 CPU cores). A second shape's compile is covered fast by
# test_linen_symmem_flag_matches_jax_jit[one_layer-...] and test_nnx_jit's in-place test.
@pytest.mark.parametrize("remat_policy,shapes", [
    ("layer", "one_shape"),
    pytest.param("layer", "two_shapes", marks=pytest.mark.slow),
    pytest.param(None, "two_shapes", marks=pytest.mark.slow)])
def test_nnx_scanned_layers_symmem_flag_matches_jax_jit(remat_policy, shapes):
  # Layers created with nnx.vmap (stacked weights) and run with nnx.scan, each under
  # nnx.remat: symmem.jit's losses and parameters are jax.jit's after each step.
  initial = llama_nnx.init_state(CFG, seed=0, scan_layers=True, remat_policy=remat_policy)
  kernel = initial[0].layers.attn.q.kernel
  assert kernel.shape == (CFG.n_layers, CFG.d_model, CFG.d_model)
  batches = (_batches()[:2] if shapes == "two_shapes"
             else [llama.example_batch(CFG, 2, 16, seed=k) for k in (0, 1)])
  results = []
  for use_symmem in (False, True):
    model, optimizer = nnx.clone(initial)
    step = llama_nnx.make_nnx_train_step(model, optimizer, use_symmem=use_symmem,
                                         max_len=MAX_LEN, max_batch=MAX_BATCH)
    losses = []
    for tokens, mask in batches:
      losses.append(step(model, optimizer, tokens, mask))
      if use_symmem:
        assert "fallback" not in step.jitted.last_call, "symmem.jit fell back to jax.jit"
    results.append((losses, nnx.state((model, optimizer))))
  chex.assert_trees_all_close(results[1], results[0], rtol=1e-5, atol=1e-6)
  info = step.jitted.cache_info()
  assert info["compiles"] == len({t.shape for t, _ in batches})
  assert info["hits"] == len(batches) - info["compiles"]
  tokens, mask = batches[0]
  graphdef, params = nnx.split(model)
  forward = str(jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))
  # jax.checkpoint prints as remat
  assert "scan[" in forward and ("remat" in forward) == (remat_policy is not None)


@pytest.mark.slow
def test_nnx_symmem_flag_matches_jax_jit():
  _check_nnx_flag_matches_jax_jit(CFG, _batches())


@pytest.mark.slow
def test_linen_step_under_a_tight_budget_matches_jax_jit_with_the_same_options(linen_states):
  # A budget between the no-eviction and the lowest modeled peak: a remat round runs,
  # compiled with the memory-saving XLA options. Against plain jax.jit, AdamW turns
  # the options' rounding noise on near-zero gradients into ~1e-4 differences in a
  # few weights, so the reference is jax.jit compiled with the same options.
  from jax_symmem._src import jit as jit_lib
  state, _ = linen_states("tiny", reference=False)
  tokens, mask = llama.example_batch(CFG, 4, 64)
  dims = {"b": 4, "s": 64}
  probe = llama.make_train_step(CFG, use_symmem=True, max_len=MAX_LEN, max_batch=MAX_BATCH)
  analysis = probe.analyze(state, tokens, mask)
  step = llama.make_train_step(CFG, use_symmem=True,
                               memory_budget=budgets.tight_budget(analysis, dims,
                                                                  (state, tokens, mask)),
                               max_len=MAX_LEN, max_batch=MAX_BATCH)
  # The budget is a few MiB: the reference states this module holds must not count
  # against it as other live arrays.
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    got = step(state, tokens, mask)
  assert step.last_call["round"] > 0 and step.cache_info()["fallback_calls"] == 0
  options = (jit_lib.CPU_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu"
             else jit_lib.GPU_COMPILER_OPTIONS)
  ref = llama.make_train_step(CFG).lower(state, tokens, mask).compile(compiler_options=options)
  _assert_tree_close(got, ref(state, tokens, mask))


@pytest.mark.slow
def test_nnx_scanned_layers_under_a_tight_budget_match_jax_jit_with_the_same_options():
  # As the linen test above, on nnx.scan'ed layers: the remat rounds evict from the
  # forward/backward scan pair.
  from jax_symmem._src import jit as jit_lib
  model, optimizer = llama_nnx.init_state(CFG, seed=0, scan_layers=True)
  state, (tokens, mask) = nnx.state((model, optimizer)), llama.example_batch(CFG, 4, 64)
  dims = {"b": 4, "s": 64}
  probe = llama_nnx.make_nnx_train_step(model, optimizer, use_symmem=True, max_len=MAX_LEN,
                                        max_batch=MAX_BATCH).jitted
  analysis = probe.analyze(state, tokens, mask)
  step = llama_nnx.make_nnx_train_step(
      model, optimizer, use_symmem=True, max_len=MAX_LEN, max_batch=MAX_BATCH,
      memory_budget=budgets.tight_budget(analysis, dims, (state, tokens, mask))).jitted
  # The budget is a few MiB: arrays other tests of this module hold must not count
  # against it as other live arrays.
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    got = step(state, tokens, mask)
  assert "fallback" not in step.last_call and step.last_call["round"] > 0
  options = (jit_lib.CPU_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu"
             else jit_lib.GPU_COMPILER_OPTIONS)
  plain = llama_nnx.make_nnx_train_step(model, optimizer).jitted
  ref = plain.lower(state, tokens, mask).compile(compiler_options=options)
  chex.assert_trees_all_close(got, ref(state, tokens, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module,remat_policy,scan_layers",
                         [(llama, None, False), (gpt2, "layer", False), (gpt2, None, True)])
def test_symmem_trace_of_the_flax_steps(module, remat_policy, scan_layers):
  cfg = module.PRESETS["tiny"]
  state = jax.eval_shape(lambda: module.init_state(cfg, seed=0, scan_layers=scan_layers))
  tokens, mask = jax.eval_shape(lambda: module.example_batch(cfg, 2, 8))   # traced, never run
  step = module.make_train_step(cfg, remat_policy=remat_policy, scan_layers=scan_layers)
  traced = symmem.trace(step, state, tokens, mask, polymorphic_shapes=SHAPES,
                        constraints=llama.step_constraints(cfg.max_len, MAX_BATCH))
  assert traced.dims == ("b", "s")
  graph = symmem.shape_graph(traced)
  assert not graph.implied   # every op relation already holds: nothing new about b, s
  # The largest value is an attention-sized b * heads * s^2 buffer at the longest length
  # (scanned: the forward scan's stack of every layer's).
  (top,) = graph.largest(1)
  b, s = symmem.Poly.var("b"), symmem.Poly.var("s")
  layers = cfg.n_layers if scan_layers else 1
  assert graph.bytes(top.id) == 4 * cfg.n_heads * layers * b * s**2
  # The rotary / position tables follow s: some value is exactly (s, d) or (s, d/2).
  assert any(len(v.dims) == 2 and str(v.dims[0]) == "s" for v in graph.values.values())


def test_gpt2_max_len_cannot_exceed_the_position_table():
  with pytest.raises(ValueError, match="learned positions"):
    gpt2.make_train_step(gpt2.PRESETS["tiny"], max_len=10**4)


def test_gpt2_steps_refuse_what_they_cannot_run():
  with pytest.raises(ValueError, match="dropout_train_step_fn"):
    gpt2.make_train_step(dataclasses.replace(gpt2.PRESETS["tiny"], dropout=0.1))
  model = gpt2.GPT2(gpt2.PRESETS["tiny"], layer_drop=0.5, scan_layers=True)
  with pytest.raises(ValueError, match="unrolled layers"):
    jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)))


@pytest.mark.slow
def test_gpt2_layer_drop_step_under_a_tight_budget_matches_jax_jit_with_the_same_options():
  # The LayerDrop example (each layer under nn.cond on its own draw): its rounds evict
  # from the forward/backward cond pairs, and the budgeted step computes what jax.jit
  # compiled with the same options computes, for draws that keep and that skip layers.
  from jax_symmem._src import jit as jit_lib
  from jax_symmem._src import loop_remat
  cfg = gpt2.GPT2Config(vocab=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)
  fn = gpt2.layer_drop_train_step_fn(gpt2.GPT2(cfg, layer_drop=0.5))
  state = gpt2.init_state(cfg)
  tokens, mask = gpt2.example_batch(cfg, 4, 64)
  shapes, constraints = (None, "b, s", "b, s", None), llama.step_constraints(MAX_LEN, MAX_BATCH)
  key = jax.random.key(0)
  analysis = symmem.analyze(fn, state, tokens, mask, key, polymorphic_shapes=shapes,
                            constraints=constraints)
  assert len(loop_remat.cond_pairs(analysis.traced.program)) == cfg.n_layers
  budget = budgets.tight_budget(analysis, {"b": 4, "s": 64}, (state, tokens, mask, key))
  step = symmem.jit(fn, polymorphic_shapes=shapes, constraints=constraints, memory_budget=budget)
  options = (jit_lib.CPU_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu"
             else jit_lib.GPU_COMPILER_OPTIONS)
  ref = jax.jit(fn).lower(state, tokens, mask, key).compile(compiler_options=options)
  losses = set()
  for seed in range(4):   # other draws skip other layers: both branches of each cond run
    key = jax.random.key(seed)
    with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
      got = step(state, tokens, mask, key)
    assert step.last_call["round"] > 0 and step.cache_info()["fallback_calls"] == 0
    _assert_tree_close(got, ref(state, tokens, mask, key))
    losses.add(float(got[1]))
  assert len(losses) > 1   # the draws did differ


def test_bucketing_groups_pads_and_bounds_the_shapes():
  rng = np.random.default_rng(0)
  lengths = rng.integers(3, 300, 101)
  batch_size, multiple = 4, 64
  index_batches = batching.bucket_indices(lengths, batch_size, multiple, seed=1)
  batches = batching.bucket_batches(lengths, batch_size, multiple, vocab=97, seed=1)
  seen = np.concatenate([idx for idx, _ in index_batches])
  assert sorted(seen.tolist()) == list(range(len(lengths)))   # every example exactly once
  shapes = set()
  for (idx, padded), (tokens, mask) in zip(index_batches, batches):
    assert tokens.dtype == np.int32 and tokens.shape == mask.shape == (batch_size, padded)
    assert padded % multiple == 0 and padded - multiple < lengths[idx].max() <= padded
    np.testing.assert_array_equal(mask.sum(axis=1)[:len(idx)], lengths[idx])
    assert (mask[len(idx):] == 0).all()                          # filler rows of a short last batch
    assert ((tokens > 0) == (mask > 0)).all() and tokens.max() < 97
    shapes.add(tokens.shape)
  assert len(shapes) <= batching.num_buckets(int(lengths.max()), multiple)
  # Similar lengths together: sorted batches never overlap in length.
  spans = sorted((lengths[idx].min(), lengths[idx].max()) for idx, _ in index_batches)
  assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:]))
  # Seeded: the same seed gives the same batches.
  again = batching.bucket_batches(lengths, batch_size, multiple, vocab=97, seed=1)
  assert all((a[0] == b[0]).all() for a, b in zip(batches, again))
  # Without filling, only the last (longest) batch may be short.
  sizes = [t.shape[0] for t, _ in batching.bucket_batches(lengths, batch_size, multiple,
                                                          shuffle=False, fill_last=False)]
  assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and sizes[-1] == len(lengths) % batch_size


def test_codealpaca_lengths_load_from_the_repository(tmp_path):
  lengths = batching.load_codealpaca_lengths()
  assert len(lengths) == 2017 and lengths.max() == 698 and lengths.min() == 47
  with pytest.raises(FileNotFoundError, match="experiments/data"):
    batching.load_codealpaca_lengths(tmp_path / "missing.txt")
