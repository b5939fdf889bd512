"""The ResNet example (convolutions, batch norm): images of varying size and batch."""

import chex
import jax
import pytest

import jax_symmem as symmem
from jax_symmem.examples import resnet
from tests import budgets

CFG = resnet.PRESETS["tiny"]
SHAPES = ((4, 16, 24), (2, 32, 16))   # (b, height, width): aspect ratios change too


def _symmem_step(cfg, remat_policy=None, memory_budget=None):
  return symmem.jit(resnet.train_step_fn(resnet.ResNet(cfg, remat_policy)),
                    polymorphic_shapes=resnet.POLYMORPHIC_SHAPES,
                    constraints=resnet.step_constraints(64, 8), memory_budget=memory_budget)


@pytest.mark.parametrize("remat_policy", [None, pytest.param("layer", marks=pytest.mark.slow)])
def test_a_batch_norm_step_without_a_budget_is_jax_jit(remat_policy):
  state = resnet.init_state(CFG)
  step = _symmem_step(CFG, remat_policy)
  reference = jax.jit(resnet.train_step_fn(resnet.ResNet(CFG, remat_policy)))
  for b, height, width in SHAPES:
    args = (state, *resnet.example_batch(CFG, b, height, width))
    chex.assert_trees_all_equal(step(*args), reference(*args))
    assert step.last_call["dims"] == {"b": b, "h": height // 8, "w": width // 8}
  assert step.cache_info()["fallback_calls"] == 0


@pytest.mark.slow
def test_under_a_budget_large_images_evict_and_the_step_stays_jax_jit():
  # A budget between the longest shape's modeled peaks without eviction and at the
  # lowest round: small images run as written, the largest evict; each call fits by
  # XLA's own figure and computes what jax.jit computes with the same options.
  cfg = resnet.ResNetConfig(widths=(8, 16, 32), blocks=1)
  state = resnet.init_state(cfg)
  fn = resnet.train_step_fn(resnet.ResNet(cfg))
  longest = (state, *resnet.example_batch(cfg, 8, 64, 64))
  analysis = symmem.analyze(fn, *longest, polymorphic_shapes=resnet.POLYMORPHIC_SHAPES,
                            constraints=resnet.step_constraints(64, 8))
  budget = budgets.tight_budget(analysis, {"b": 8, "h": 8, "w": 8}, longest)
  step = _symmem_step(cfg, memory_budget=budget)
  rounds = budgets.rounds_run_within(
      step, budget, fn, [(state, *resnet.example_batch(cfg, 2, 16, 24)), longest],
      lambda got, want: chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6))
  assert rounds[0] == 0 < rounds[1]
  assert step.cache_info()["compiles"] <= 3   # one for the small images, at most 2 for the large
