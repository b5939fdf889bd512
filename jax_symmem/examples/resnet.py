"""A ResNet image classifier in Flax linen, as the Flax examples write it: batch norm.

Basic residual blocks (two 3x3 convolutions, each followed by `nn.BatchNorm`, a 1x1
projection where a stage halves the resolution or widens), stages at 1/1, 1/2 and
1/4 of the input resolution, global average pooling, a dense head. Training updates
the batch statistics (`mutable=["batch_stats"]`) beside the parameters; the loss is a
per-example weighted cross-entropy (weights 0 for padding examples).

Images vary in batch size and resolution (aspect-ratio buckets): `polymorphic_shapes`
declares height and width as multiples of the total stride, "b, 8*h, 8*w, _", so the
strided convolutions' output sizes stay polynomials (`h` and `w` count 8-pixel tiles).

    state = init_state(cfg)
    step = symmem.jit(train_step_fn(ResNet(cfg)), polymorphic_shapes=POLYMORPHIC_SHAPES,
                      constraints=step_constraints(max_side=256, max_batch=32),
                      memory_budget="2GiB")
    for images, labels, weights in batches:   # (b, H, W, 3) with H, W multiples of 8
      state, loss = step(state, images, labels, weights)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_symmem.examples import llama


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  widths: tuple[int, ...] = (16, 32, 64)   # channels per stage; stages after the first halve
  blocks: int = 2                          #   the resolution
  classes: int = 10
  channels: int = 3                        # of the input images


# "small": 6 residual blocks, 175 k parameters; XLA's figure of its step at b=16,
# 128 x 128 on CPU is 286 MiB (2026-12-04). "tiny": for tests.
PRESETS = {"small": ResNetConfig(), "tiny": ResNetConfig(widths=(8, 16), blocks=1)}


class ResidualBlock(nn.Module):
  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(x)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.features, (3, 3))(y))
    if x.shape[-1] != self.features or self.strides != 1:
      x = norm()(conv(self.features, (1, 1), self.strides)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """`remat_policy="layer"` puts each residual block under `nn.remat` (per-layer
  checkpointing: only the blocks' inputs are saved)."""
  cfg: ResNetConfig
  remat_policy: str | None = None

  @nn.compact
  def __call__(self, images, train: bool = True):
    cfg = self.cfg
    block = ResidualBlock
    if self.remat_policy is not None:   # `train` is a Python bool (argument 2 after self, x)
      block = nn.remat(ResidualBlock, policy=llama.checkpoint_policy(self.remat_policy),
                       static_argnums=(2,))
    x = nn.Conv(cfg.widths[0], (3, 3), use_bias=False, name="stem")(images)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="stem_norm")(x))
    for i, width in enumerate(cfg.widths):
      for j in range(cfg.blocks):
        x = block(width, 2 if i and not j else 1, name=f"stage{i}_block{j}")(x, train)
    return nn.Dense(cfg.classes, name="head")(jnp.mean(x, axis=(1, 2)))


POLYMORPHIC_SHAPES = (None, "b, 8*h, 8*w, _", "b", "b")


def step_constraints(max_side: int, max_batch: int) -> tuple[str, ...]:
  return (f"8*h <= {max_side}", f"8*w <= {max_side}", f"b <= {max_batch}")


def init_state(cfg: ResNetConfig, seed: int = 0, learning_rate: float = 1e-3) -> dict:
  """{"params", "batch_stats", "opt_state"}: the pytree the step takes and returns."""
  model = ResNet(cfg)

  @jax.jit   # op-by-op initialization takes seconds
  def init(key):
    variables = model.init(key, jnp.zeros((1, 8, 8, cfg.channels)), train=False)
    params = variables["params"]
    return {"params": params, "batch_stats": variables["batch_stats"],
            "opt_state": llama.make_optimizer(learning_rate).init(params)}
  return init(jax.random.PRNGKey(seed))


def train_step_fn(model: ResNet, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, images, labels, weights) -> (state, loss)` AdamW step."""
  tx = llama.make_optimizer(learning_rate)

  def loss_fn(params, batch_stats, images, labels, weights):
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                  mutable=["batch_stats"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss, updates["batch_stats"]

  def train_step(state, images, labels, weights):
    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], state["batch_stats"], images, labels, weights)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates),
            "batch_stats": batch_stats, "opt_state": opt_state}, loss

  return train_step


def example_batch(cfg: ResNetConfig, batch: int, height: int, width: int | None = None,
                  seed: int = 0):
  """(images, labels, weights): random images, labels, and weights that leave out about
  one example in eight (a padded last batch)."""
  width = height if width is None else width
  rng = np.random.RandomState(seed + 7 * height + width)
  images = rng.standard_normal((batch, height, width, cfg.channels)).astype(np.float32)
  return (jnp.asarray(images), jnp.asarray(rng.randint(0, cfg.classes, batch), jnp.int32),
          jnp.asarray(rng.rand(batch) > 0.125, jnp.float32))
