"""Recurrent models as Flax writes them: `nn.RNN` over an LSTM cell is a `lax.scan` over time,
so the loop's trip count is the symbolic sequence length and what the forward scan stacks
for the backward one (each step's gates and states) grows with it; `nn.Bidirectional` adds
a second direction over the flipped sequence."""

import chex
import flax.linen as nn
import jax
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import loop_remat
from jax_symmem._src import variants
from jax_symmem.examples import llama
from tests import budgets
from tests import programs

VOCAB, WIDTH, SHAPES = 128, 32, ((2, 8), (3, 40), (4, 96))
CONSTRAINTS = ("s >= 2", "s <= 96", "b <= 4")


class RecurrentLM(nn.Module):
  """Two residual LSTM layers (Flax's `nn.RNN`, a scan over time) between an embedding
  and a projection to the vocabulary."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    for _ in range(2):
      x = x + nn.RNN(nn.OptimizedLSTMCell(WIDTH))(nn.LayerNorm()(x))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class BidirectionalLM(nn.Module):
  """Two residual bidirectional layers (`nn.Bidirectional`: an LSTM over time forward and a
  GRU backward), as a tagger or an encoder is written."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    for _ in range(2):
      both = nn.Bidirectional(nn.RNN(nn.LSTMCell(WIDTH)), nn.RNN(nn.GRUCell(WIDTH)))
      x = x + nn.Dense(WIDTH)(both(nn.LayerNorm()(x)))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _setup(model=None):
  model = model or RecurrentLM()
  state = llama.init_linen_state(model, 0, 1e-3)
  return state, llama.train_step_fn(model)


def _batch(b, s):
  return llama.example_batch(llama.LlamaConfig(vocab=VOCAB), b, s)


def _analysis(fn, state):
  return symmem.analyze(fn, state, *_batch(*SHAPES[0]), polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=CONSTRAINTS)


@pytest.mark.slow
def test_a_recurrent_step_is_jax_jit_and_its_time_steps_are_eviction_candidates():
  state, fn = _setup()
  analysis = _analysis(fn, state)
  assert any(isinstance(r, loop_remat.LoopEviction)   # residuals stacked over time
             for rnd in analysis.rounds for r in rnd.regions)
  longest = {"b": SHAPES[-1][0], "s": SHAPES[-1][1]}
  peaks = [analysis.round_peak(k, longest) for k in range(len(analysis.rounds))]
  assert peaks[-1] < peaks[0]
  step = symmem.jit(fn, polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS)
  reference = jax.jit(fn)
  for b, s in SHAPES:
    args = (state, *_batch(b, s))
    chex.assert_trees_all_equal(step(*args), reference(*args))
  assert step.cache_info()["fallback_calls"] == 0


@pytest.mark.slow
def test_the_model_of_recurrent_rounds_equals_running_the_time_steps_op_by_op():
  state, fn = _setup()
  analysis = _analysis(fn, state)
  programs.assert_rounds_model_the_executor(analysis, {"b": 2, "s": 8}, (state, *_batch(2, 8)))


@pytest.mark.slow
def test_under_a_budget_long_sequences_evict_time_steps():
  state, fn = _setup()
  analysis = _analysis(fn, state)
  b, s = SHAPES[-1]
  longest = (state, *_batch(b, s))
  budget = budgets.tight_budget(analysis, {"b": b, "s": s}, longest)
  step = symmem.jit(fn, polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS,
                    memory_budget=budget)
  rounds = budgets.rounds_run_within(
      step, budget, fn, [(state, *_batch(*SHAPES[0])), longest],
      lambda got, want: chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6))
  assert rounds[0] == 0 < rounds[1]
  assert step.cache_info()["compiles"] <= 3


@pytest.mark.slow
def test_every_round_of_a_bidirectional_step_computes_what_jax_jit_does():
  # Flax runs the backward direction as a forward scan over the flipped sequence (`rev`
  # along the symbolic axis); `lax.scan(reverse=True)` itself is covered by the scanned
  # programs of tests/test_loop_remat.py.
  state, fn = _setup(BidirectionalLM())
  analysis = _analysis(fn, state)
  scans = {r.forward for rnd in analysis.rounds for r in rnd.regions
           if isinstance(r, loop_remat.LoopEviction)}
  assert len(scans) == 4, "both directions of both layers stack time steps"
  b, s = SHAPES[1]
  dims, args = {"b": b, "s": s}, (state, *_batch(b, s))
  flat = jax.tree_util.tree_leaves(args)
  wants = {}   # jax.jit's step per set of options: the rounds share a few
  for k in range(len(analysis.rounds)):
    options = variants.round_options(analysis, k, jax.devices()[0].platform)
    got = jax.jit(variants.round_function(analysis, k, dims)).lower(*flat).compile(
        compiler_options=options)(*flat)
    key = tuple(sorted(options.items()))
    if key not in wants:
      wants[key] = jax.jit(fn).lower(*args).compile(compiler_options=options)(*args)
    want = wants[key]
    # A replay that read another time step's carry would be off by the values' scale;
    # recomputation rounds differently by ulps (tests/test_loop_remat.py, per leaf).
    for x, y in zip(got, jax.tree_util.tree_leaves(want)):
      y = np.asarray(y)
      np.testing.assert_allclose(np.asarray(x), y, rtol=2e-5,
                                 atol=1e-6 * max(1.0, float(np.max(np.abs(y), initial=0.0))))
