"""The T5 example: symmem.jit's step matches jax.jit's at two (s, t) shapes, two symbolic lengths."""

import gc

import chex
import jax
import pytest

import jax_symmem as symmem
from jax_symmem.examples import t5
from tests import budgets

CFG = t5.PRESETS["tiny"]
# (b, s, t): two shapes with s != t, one with s > t and one with s < t.
BATCHES = ((2, 12, 8), (3, 20, 28))
MAX_BATCH = 4


def _batches():
  return [t5.example_batch(CFG, b, s, t, seed=k) for k, (b, s, t) in enumerate(BATCHES)]


def _run(step, state):
  losses = []
  for batch in _batches():
    state, loss = step(state, *batch)
    losses.append(loss)
    if isinstance(step, symmem.SymmemFunction):
      assert "fallback" not in step.last_call, "symmem.jit fell back to jax.jit"
  return state, losses


@pytest.fixture(scope="module")
def init():
  yield t5.init_state(CFG, seed=0)
  gc.collect()


# Two shapes of an encoder-decoder compiled twice: slow; the trace tests stay fast.
@pytest.mark.slow
def test_symmem_flag_matches_jax_jit(init):
  step = t5.make_train_step(CFG, use_symmem=True, max_batch=MAX_BATCH)
  assert isinstance(step, symmem.SymmemFunction)
  got = _run(step, init)
  want = _run(t5.make_train_step(CFG), init)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert step.last_call["dims"] == dict(zip("bst", BATCHES[-1]))
  info = step.cache_info()
  assert info["fallback_calls"] == 0 and info["compiles"] == 2


def test_relative_position_buckets():
  # Exact buckets for small distances, log-spaced and capped beyond; keys after the
  # query get the upper half when bidirectional and bucket 0 when causal.
  both = t5.relative_position_buckets(1, 40, bidirectional=True, num_buckets=8, max_distance=16)
  assert both[0, :4].tolist() == [0, 5, 6, 6] and set(both[0, 8:].tolist()) == {7}
  before = t5.relative_position_buckets(40, 1, bidirectional=True, num_buckets=8,
                                        max_distance=16)
  assert before[:4, 0].tolist() == [0, 1, 2, 2] and before[-1, 0] == 3   # the lower half
  causal = t5.relative_position_buckets(40, 1, bidirectional=False, num_buckets=8,
                                        max_distance=16)
  assert causal[:4, 0].tolist() == [0, 1, 2, 3] and causal[-1, 0] == 7
  assert causal[4:8, 0].tolist() == [4, 4, 5, 5] and set(causal[16:, 0].tolist()) == {7}
  assert (t5.relative_position_buckets(3, 5, bidirectional=False, num_buckets=8,
                                       max_distance=16)[0, 1:] == 0).all()


def test_symmem_trace_has_two_lengths():
  state = jax.eval_shape(lambda: t5.init_state(CFG, seed=0))
  batch = jax.eval_shape(lambda: t5.example_batch(CFG, 2, 12, 8))   # traced, never run
  traced = symmem.trace(t5.make_train_step(CFG, remat_policy="layer"), state, *batch,
                        polymorphic_shapes=t5.POLYMORPHIC_SHAPES,
                        constraints=t5.step_constraints(64, 64, MAX_BATCH))
  assert set(traced.dims) == {"b", "s", "t"}
  graph = symmem.shape_graph(traced)
  b, s, t = (symmem.Poly.var(d) for d in "bst")
  sizes = [graph.bytes(v) for v in graph.values]
  # Encoder self-attention (b h s s), decoder self-attention (b h t t), cross (b h t s).
  for attn in (b * s * s, b * t * t, b * t * s):
    assert 4 * CFG.n_heads * attn in sizes


@pytest.mark.slow
def test_step_under_a_tight_budget_matches_jax_jit_with_the_same_options(init):
  # A budget between the no-eviction and the lowest modeled peak: remat rounds run,
  # compiled with the memory-saving XLA options; the reference uses the same options.
  from jax_symmem._src import jit as jit_lib
  batch, dims = t5.example_batch(CFG, 4, 40, 24), {"b": 4, "s": 40, "t": 24}
  probe = t5.make_train_step(CFG, use_symmem=True, max_batch=MAX_BATCH)
  analysis = probe.analyze(init, *batch)
  step = t5.make_train_step(CFG, use_symmem=True, max_batch=MAX_BATCH,
                            memory_budget=budgets.tight_budget(analysis, dims, (init, *batch)))
  got = step(init, *batch)
  assert "fallback" not in step.last_call and step.last_call["round"] > 0
  options = (jit_lib.CPU_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu"
             else jit_lib.GPU_COMPILER_OPTIONS)
  ref = t5.make_train_step(CFG).lower(init, *batch).compile(compiler_options=options)
  chex.assert_trees_all_close(got, ref(init, *batch), rtol=1e-5, atol=1e-6)
