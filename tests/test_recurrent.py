"""A recurrent LM as Flax writes one: `nn.RNN` over an LSTM cell is a `lax.scan` over time,
so the loop's trip count is the symbolic sequence length and what the forward scan stacks
for the backward one (each step's gates and states) grows with it."""

import chex
import flax.linen as nn
import jax
import pytest

import jax_symmem as symmem
from jax_symmem._src import loop_remat
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


def _setup():
  model = RecurrentLM()
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
