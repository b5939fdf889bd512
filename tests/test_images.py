"""The image models of `jax_symmem.examples`: a ResNet (convolutions, batch norm), a
Vision Transformer (big_vision's nn.scan over blocks, attention a polynomial of degree 4
in the image's tiles) and a diffusion UNet (transposed convolutions up, skip connections,
noise drawn in the step), on images of varying size and batch."""

import chex
import jax
import jax.numpy as jnp
import pytest

import jax_symmem as symmem
from jax_symmem.examples import resnet
from jax_symmem.examples import unet
from jax_symmem.examples import vit
from tests import budgets

# (module, model class, the preset the fast tests run, a small config for the budget test)
EXAMPLES = {
    "resnet": (resnet, resnet.ResNet, resnet.PRESETS["tiny"],
               resnet.ResNetConfig(widths=(8, 16, 32), blocks=1)),
    "vit": (vit, vit.ViT, vit.PRESETS["tiny"],
            vit.ViTConfig(width=32, depth=3, heads=2, mlp_dim=128)),
    "unet": (unet, unet.UNet, unet.PRESETS["tiny"],
             unet.UNetConfig(widths=(8, 16, 32), groups=4, time_dim=16)),
}
SHAPES = ((4, 16, 24), (2, 32, 16))   # (b, height, width): aspect ratios change too


def _symmem_step(example, cfg, remat_policy=None, memory_budget=None):
  module, model, _, _ = EXAMPLES[example]
  return symmem.jit(module.train_step_fn(model(cfg, remat_policy)),
                    polymorphic_shapes=module.POLYMORPHIC_SHAPES,
                    constraints=module.step_constraints(64, 8), memory_budget=memory_budget)


# The fast tier runs the ResNet (convolutions, batch norm, the aspect ratio changing
# between shapes) and the UNet at one shape (its compiles took 14 s of the fast tier at
# two); the ViT (a conv patch embedding, then scanned encoder blocks, each also covered
# by the ResNet and the scanned Llama's fast tests) compiles for 13 s here.
@pytest.mark.parametrize("remat_policy", [None, pytest.param("layer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("example", ["resnet", "unet", pytest.param("vit", marks=pytest.mark.slow)])
def test_a_step_without_a_budget_is_jax_jit(example, remat_policy):
  module, model, cfg, _ = EXAMPLES[example]
  state = module.init_state(cfg)
  step = _symmem_step(example, cfg, remat_policy)
  reference = jax.jit(module.train_step_fn(model(cfg, remat_policy)))
  shapes = SHAPES[:1] if (example, remat_policy) == ("unet", None) else SHAPES
  for b, height, width in shapes:
    args = (state, *module.example_batch(cfg, b, height, width))
    chex.assert_trees_all_equal(step(*args), reference(*args))
    assert step.last_call["dims"] == {"b": b, "h": height // 8, "w": width // 8}
  assert step.cache_info()["fallback_calls"] == 0


def test_the_vit_position_embedding_follows_the_grid():
  # The sine-cosine table is built from iotas: any grid, symbolic ones too.
  table = vit.posemb_sincos_2d(3, 5, 16)
  assert table.shape == (15, 16)
  row, col = 2, 4   # grid position (2, 4): row-major index 14; its first quarter sin(col * omega)
  chex.assert_trees_all_close(table[5 * row + col, :4],
                              jnp.sin(col / 10_000.0 ** (jnp.arange(4) / 3)), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_under_a_budget_large_images_evict_and_the_step_stays_jax_jit(example):
  # A budget between the largest images' modeled peaks without eviction and at the
  # lowest round: small images run as written, the largest evict (inside the scanned
  # blocks, for the ViT); each call fits by XLA's own figure and computes what jax.jit
  # computes with the same options.
  module, model, _, cfg = EXAMPLES[example]
  state = module.init_state(cfg)
  fn = module.train_step_fn(model(cfg))
  longest = (state, *module.example_batch(cfg, 8, 64, 64))
  analysis = symmem.analyze(fn, *longest, polymorphic_shapes=module.POLYMORPHIC_SHAPES,
                            constraints=module.step_constraints(64, 8))
  budget = budgets.tight_budget(analysis, {"b": 8, "h": 8, "w": 8}, longest)
  step = _symmem_step(example, cfg, memory_budget=budget)
  rounds = budgets.rounds_run_within(
      step, budget, fn, [(state, *module.example_batch(cfg, 2, 16, 24)), longest],
      lambda got, want: chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6))
  assert rounds[0] == 0 < rounds[1]
  assert step.cache_info()["compiles"] <= 3   # one for the small images, at most 2 for the large
