"""The Vision Transformer example (big_vision's nn.scan over blocks): images of varying
size and batch, so attention is a polynomial of degree 4 in the image's tiles."""

import chex
import jax
import pytest

import jax_symmem as symmem
from jax_symmem.examples import vit
from tests import budgets

CFG = vit.PRESETS["tiny"]
SHAPES = ((4, 16, 24), (2, 32, 16))   # (b, height, width): aspect ratios change too


def _symmem_step(cfg, remat_policy=None, memory_budget=None):
  return symmem.jit(vit.train_step_fn(vit.ViT(cfg, remat_policy)),
                    polymorphic_shapes=vit.POLYMORPHIC_SHAPES,
                    constraints=vit.step_constraints(64, 8), memory_budget=memory_budget)


@pytest.mark.parametrize("remat_policy", [None, pytest.param("layer", marks=pytest.mark.slow)])
def test_a_scanned_vit_step_without_a_budget_is_jax_jit(remat_policy):
  state = vit.init_state(CFG)
  step = _symmem_step(CFG, remat_policy)
  reference = jax.jit(vit.train_step_fn(vit.ViT(CFG, remat_policy)))
  for b, height, width in SHAPES:
    args = (state, *vit.example_batch(CFG, b, height, width))
    chex.assert_trees_all_equal(step(*args), reference(*args))
    assert step.last_call["dims"] == {"b": b, "h": height // 8, "w": width // 8}
  assert step.cache_info()["fallback_calls"] == 0


def test_the_position_embedding_follows_the_grid():
  # The sine-cosine table is built from iotas: any grid, symbolic ones too, and the
  # same table as for a concrete grid.
  table = vit.posemb_sincos_2d(3, 5, 16)
  assert table.shape == (15, 16)
  chex.assert_trees_all_close(table[5 * 2 + 4, :4], jax.numpy.sin(
      4.0 / 10_000.0 ** (jax.numpy.arange(4) / 3)), rtol=1e-6)


@pytest.mark.slow
def test_under_a_budget_large_images_evict_and_the_step_stays_jax_jit():
  # A budget between the largest images' modeled peaks without eviction and at the
  # lowest round: small images run as written, the largest evict inside the scanned
  # blocks; each call fits by XLA's own figure and computes what jax.jit computes with
  # the same options.
  cfg = vit.ViTConfig(width=32, depth=3, heads=2, mlp_dim=128)
  state = vit.init_state(cfg)
  fn = vit.train_step_fn(vit.ViT(cfg))
  longest = (state, *vit.example_batch(cfg, 8, 64, 64))
  analysis = symmem.analyze(fn, *longest, polymorphic_shapes=vit.POLYMORPHIC_SHAPES,
                            constraints=vit.step_constraints(64, 8))
  budget = budgets.tight_budget(analysis, {"b": 8, "h": 8, "w": 8}, longest)
  step = _symmem_step(cfg, memory_budget=budget)
  rounds = budgets.rounds_run_within(
      step, budget, fn, [(state, *vit.example_batch(cfg, 2, 16, 24)), longest],
      lambda got, want: chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6))
  assert rounds[0] == 0 < rounds[1]
  assert step.cache_info()["compiles"] <= 3   # one for the small images, at most 2 for the large
