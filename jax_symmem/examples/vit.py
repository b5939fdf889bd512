"""A Vision Transformer in Flax linen, as big_vision writes one: `nn.scan` over the blocks.

Patches from a strided convolution, a fixed 2-D sine-cosine position embedding computed
from the grid (so any resolution works), pre-norm blocks with Flax's
`nn.MultiHeadDotProductAttention` and a GELU MLP, stacked by `nn.scan` (big_vision's
`scan=True`: one block traced, its parameters stacked along a leading axis), global
average pooling, a dense head, AdamW, and a per-example weighted cross-entropy (weights
0 for padding examples).

Images vary in batch size and resolution: `polymorphic_shapes` declares height and
width as multiples of the patch size, "b, 8*h, 8*w, _", so the grid is h x w patches
and attention over its h*w tokens holds b * heads * (h*w)**2 probabilities, a
polynomial of degree 4 in the tiles.

    state = init_state(cfg)
    step = symmem.jit(train_step_fn(ViT(cfg)), polymorphic_shapes=POLYMORPHIC_SHAPES,
                      constraints=step_constraints(max_side=256, max_batch=32),
                      memory_budget="2GiB")
    for images, labels, weights in batches:   # (b, H, W, 3), H and W multiples of the patch
      state, loss = step(state, images, labels, weights)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jax_symmem.examples import llama
from jax_symmem.examples import resnet


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  patch: int = 8
  width: int = 128
  depth: int = 4
  heads: int = 4
  mlp_dim: int = 512
  classes: int = 10
  channels: int = 3   # of the input images


# "small": 4 blocks of width 128, 0.8 M parameters. "tiny": for tests.
PRESETS = {"small": ViTConfig(),
           "tiny": ViTConfig(width=32, depth=2, heads=2, mlp_dim=64)}


def posemb_sincos_2d(h, w, width: int, temperature: float = 10_000.0):
  """big_vision's fixed position embedding, (h * w, width), for an h x w grid of any
  size (symbolic ones too: built from iotas)."""
  y, x = jnp.meshgrid(jnp.arange(h), jnp.arange(w), indexing="ij")
  omega = 1.0 / temperature ** (jnp.arange(width // 4) / (width // 4 - 1))
  y = y.reshape(-1, 1) * omega[None, :]
  x = x.reshape(-1, 1) * omega[None, :]
  return jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], axis=1)


class MlpBlock(nn.Module):
  mlp_dim: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    x = nn.gelu(nn.Dense(self.mlp_dim, kernel_init=nn.initializers.xavier_uniform())(x))
    return nn.Dense(d, kernel_init=nn.initializers.xavier_uniform())(x)


class Encoder1DBlock(nn.Module):
  """Pre-norm attention and MLP, each added to the residual stream. Called by `nn.scan`:
  (carry, broadcast) -> (carry, per-layer output)."""
  cfg: ViTConfig

  @nn.compact
  def __call__(self, x, _):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.cfg.heads,
                                        kernel_init=nn.initializers.xavier_uniform())(y, y)
    x = x + y
    x = x + MlpBlock(self.cfg.mlp_dim)(nn.LayerNorm()(x))
    return x, None


class ViT(nn.Module):
  """`remat_policy="layer"` puts the scanned block under `nn.remat` (per-layer
  checkpointing: only each block's input is saved), as big_vision's `remat_policy`
  does; another `jax.checkpoint_policies` name saves what it names."""
  cfg: ViTConfig
  remat_policy: str | None = None

  @nn.compact
  def __call__(self, images):
    cfg = self.cfg
    x = nn.Conv(cfg.width, (cfg.patch, cfg.patch), strides=(cfg.patch, cfg.patch),
                padding="VALID", name="embedding")(images)
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c) + posemb_sincos_2d(h, w, c)[None]
    block = Encoder1DBlock
    if self.remat_policy is not None:
      block = nn.remat(block, prevent_cse=False,
                       policy=llama.checkpoint_policy(self.remat_policy))
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=nn.broadcast, length=cfg.depth)(cfg, name="encoderblock")(x, None)
    x = nn.LayerNorm(name="encoder_norm")(x)
    return nn.Dense(cfg.classes, kernel_init=nn.initializers.zeros, name="head")(
        jnp.mean(x, axis=1))


# The ResNet's images: batches, polymorphic shapes (8-pixel tiles) and all.
POLYMORPHIC_SHAPES = resnet.POLYMORPHIC_SHAPES
example_batch = resnet.example_batch   # (cfg, batch, height, width=None, seed=0)


def step_constraints(max_side: int, max_batch: int, patch: int = 8) -> tuple[str, ...]:
  """Bounds for `POLYMORPHIC_SHAPES` (whose tile is 8 pixels: `patch` must be 8 there)."""
  if patch != 8:
    raise ValueError(f"POLYMORPHIC_SHAPES declares 8-pixel tiles; patch is {patch}")
  return (f"8*h <= {max_side}", f"8*w <= {max_side}", f"b <= {max_batch}")


def init_state(cfg: ViTConfig, seed: int = 0, learning_rate: float = 1e-3) -> dict:
  """{"params", "opt_state"}: the pytree the step takes and returns."""
  return llama.init_linen_state(
      ViT(cfg), seed, learning_rate,
      example_args=(jnp.zeros((1, cfg.patch, cfg.patch, cfg.channels)),))


def train_step_fn(model: ViT, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, images, labels, weights) -> (state, loss)` AdamW step."""
  tx = llama.make_optimizer(learning_rate)

  def loss_fn(params, images, labels, weights):
    logits = model.apply({"params": params}, images)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)

  def train_step(state, images, labels, weights):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], images, labels, weights)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, loss

  return train_step
