"""The Mixture-of-Experts decoder of `jax_symmem.examples.moe`: top-k routing with a
capacity that is a floor division of the sequence length, dispatch tensors quadratic in it,
a cumulative sum and `lax.top_k` under symbolic dims, scanned or unrolled layers."""

import fractions
import math

import chex
import jax
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem.examples import llama
from jax_symmem._src import loop_remat
from jax_symmem.examples import moe
from tests import budgets

CFG = moe.PRESETS["tiny"]
SHAPES = ((2, 16), (3, 100), (1, 256))   # capacities 10, 63, 160


def _symmem_step(cfg, scan, remat_policy=None, memory_budget=None):
  return symmem.jit(moe.train_step_fn(moe.MoE(cfg, remat_policy, scan)),
                    polymorphic_shapes=(None, "b, s", "b, s"),
                    constraints=llama.step_constraints(cfg.max_len, 8),
                    memory_budget=memory_budget)


@pytest.mark.parametrize("factor, top_k, n_experts", [(1.25, 2, 4), (1.0, 1, 8), (2.0, 2, 3),
                                                      (0.3, 1, 5)])
def test_the_capacity_is_the_exact_ceiling_of_its_share(factor, top_k, n_experts):
  cfg = moe.MoEConfig(capacity_factor=factor, top_k=top_k, n_experts=n_experts)
  for s in range(1, 300):
    assert cfg.capacity(s) == math.ceil(fractions.Fraction(factor).limit_denominator(1000)
                                        * s * top_k / n_experts)


def _route_by_hand(probs, top_k, capacity):
  """GShard's dispatch written as the loop it describes."""
  b, s, n = probs.shape
  dispatch, combine = np.zeros((b, s, n, capacity)), np.zeros((b, s, n, capacity))
  for i in range(b):
    used = [0] * n
    for t in range(s):
      chosen = np.argsort(-probs[i, t], kind="stable")[:top_k]
      gates = probs[i, t, chosen] / probs[i, t, chosen].sum()
      for e, gate in zip(chosen, gates):
        if used[e] < capacity:
          dispatch[i, t, e, used[e]], combine[i, t, e, used[e]] = 1.0, gate
          used[e] += 1
  return dispatch, combine


@pytest.mark.parametrize("top_k, capacity", [
    (1, 3), (2, 2), pytest.param(2, 7, marks=pytest.mark.slow),
    pytest.param(3, 20, marks=pytest.mark.slow)])
def test_route_fills_each_expert_in_token_order_and_drops_the_rest(top_k, capacity):
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(top_k * capacity), (2, 9, 4)), -1)
  got = moe.route(probs, top_k, capacity)
  want = _route_by_hand(np.asarray(probs, np.float64), top_k, capacity)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_a_step_without_a_budget_is_jax_jit(scan):
  state = moe.init_state(CFG, scan_layers=scan)
  step = _symmem_step(CFG, scan)
  reference = jax.jit(moe.train_step_fn(moe.MoE(CFG, scan_layers=scan)))
  for b, s in SHAPES:
    args = (state, *moe.example_batch(CFG, b, s))
    chex.assert_trees_all_equal(step(*args), reference(*args))
    assert step.last_call["dims"] == {"b": b, "s": s}
  assert step.cache_info()["fallback_calls"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("remat_policy", [None, "layer"])
def test_under_a_budget_long_sequences_evict_inside_the_scan(remat_policy):
  # A budget between the longest batch's modeled peaks without eviction and at the
  # lowest round: short batches run as written, the longest evicts (what the scan's
  # forward pass stacks for its backward pass: the dispatch tensors among them); each
  # call fits by XLA's own figure and computes what jax.jit computes with the same options.
  # With nn.remat on the scanned layer, the short batch runs without the recomputation.
  cfg = CFG
  state = moe.init_state(cfg, scan_layers=True)
  fn = moe.train_step_fn(moe.MoE(cfg, remat_policy, scan_layers=True))
  longest = (state, *moe.example_batch(cfg, 4, 256))
  analysis = symmem.analyze(fn, *longest, polymorphic_shapes=(None, "b, s", "b, s"),
                            constraints=llama.step_constraints(cfg.max_len, 8))
  assert any(isinstance(r, loop_remat.LoopEviction)   # the scan's stacked residuals
             for rnd in analysis.rounds for r in rnd.regions)
  budget = budgets.tight_budget(analysis, {"b": 4, "s": 256}, longest)
  step = _symmem_step(cfg, True, remat_policy, memory_budget=budget)
  rounds = budgets.rounds_run_within(
      step, budget, fn, [(state, *moe.example_batch(cfg, 2, 32)), longest],
      lambda got, want: chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6))
  assert rounds[0] == 0 < rounds[1]
  assert step.cache_info()["compiles"] <= 3   # one for the short batch, at most 2 for the long
