"""A denoising-diffusion UNet in Flax linen, as DDPM-style training code writes it.

Residual blocks (GroupNorm, SiLU, 3x3 convolutions, the timestep's embedding added in
between), a strided 3x3 convolution down and an `nn.ConvTranspose` up per level, skip
connections concatenated on the way up. The step draws each image's noise level and
noise from a key, noises the images and regresses the noise (epsilon prediction),
weighted per example (weights 0 for padding examples), with AdamW.

Diffusion fine-tuning trains on aspect-ratio buckets, so the image's height and width
change between batches: `polymorphic_shapes` declares them as multiples of the total
stride, "b, 8*h, 8*w, _" (`h` and `w` count 8-pixel tiles). Its memory holds two things
the transformers of the other examples do not: activations that grow with the pixels at
every level, and the scratch XLA:CPU's transposed convolution takes outside its buffers
(a strided convolution's input gradient, the up-sampling itself), which `symmem.jit`
counts beside XLA's figure.

    state = init_state(cfg)
    step = symmem.jit(train_step_fn(UNet(cfg)), polymorphic_shapes=POLYMORPHIC_SHAPES,
                      constraints=step_constraints(max_side=256, max_batch=32),
                      memory_budget="2GiB")
    for images, key, weights in batches:   # (b, H, W, 3) with H, W multiples of 8
      state, loss = step(state, images, key, weights)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_symmem.examples import llama
from jax_symmem.examples import resnet


@dataclasses.dataclass(frozen=True)
class UNetConfig:
  widths: tuple[int, ...] = (32, 64, 128)   # channels per level; each level below halves
  groups: int = 8                           #   the resolution (three levels: 1/1 .. 1/4)
  time_dim: int = 64                        # the timestep embedding's width
  channels: int = 3                         # of the images


# "small": 574 k parameters. "tiny": for tests.
PRESETS = {"small": UNetConfig(), "tiny": UNetConfig(widths=(8, 16), groups=4, time_dim=16)}


def timestep_embedding(t, dim: int):
  """Sinusoidal embedding of noise levels t in [0, 1): (b,) -> (b, dim)."""
  freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(dim // 2) / (dim // 2))
  angles = 1000.0 * t[:, None] * freqs[None]
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class ResBlock(nn.Module):
  features: int
  groups: int

  @nn.compact
  def __call__(self, x, temb):
    h = nn.Conv(self.features, (3, 3))(nn.silu(nn.GroupNorm(self.groups)(x)))
    h = h + nn.Dense(self.features)(nn.silu(temb))[:, None, None, :]
    h = nn.Conv(self.features, (3, 3))(nn.silu(nn.GroupNorm(self.groups)(h)))
    if x.shape[-1] != self.features:
      x = nn.Conv(self.features, (1, 1))(x)
    return x + h


class UNet(nn.Module):
  """`remat_policy="layer"` puts each residual block under `nn.remat` (per-layer
  checkpointing: only the blocks' inputs are saved)."""
  cfg: UNetConfig
  remat_policy: str | None = None

  @nn.compact
  def __call__(self, x, t):
    cfg = self.cfg
    block = ResBlock
    if self.remat_policy is not None:
      block = nn.remat(ResBlock, policy=llama.checkpoint_policy(self.remat_policy))
    temb = nn.Dense(cfg.time_dim)(nn.silu(nn.Dense(cfg.time_dim)(
        timestep_embedding(t, cfg.time_dim))))
    x = nn.Conv(cfg.widths[0], (3, 3), name="stem")(x)
    skips = []
    for i, width in enumerate(cfg.widths):
      x = block(width, cfg.groups, name=f"down{i}")(x, temb)
      if i < len(cfg.widths) - 1:
        skips.append(x)
        x = nn.Conv(width, (3, 3), strides=2, name=f"downsample{i}")(x)
    for i in reversed(range(len(cfg.widths) - 1)):
      x = nn.ConvTranspose(cfg.widths[i], (2, 2), strides=(2, 2), name=f"upsample{i}")(x)
      x = block(cfg.widths[i], cfg.groups, name=f"up{i}")(
          jnp.concatenate([x, skips[i]], axis=-1), temb)
    x = nn.silu(nn.GroupNorm(cfg.groups, name="out_norm")(x))
    return nn.Conv(cfg.channels, (3, 3), name="out")(x)


POLYMORPHIC_SHAPES = (None, "b, 8*h, 8*w, _", None, "b")


step_constraints = resnet.step_constraints   # bounds on the same 8-pixel tiles and batch


def init_state(cfg: UNetConfig, seed: int = 0, learning_rate: float = 1e-4) -> dict:
  """{"params", "opt_state"}: the pytree the step takes and returns."""
  return llama.init_linen_state(UNet(cfg), seed, learning_rate,
                                example_args=(jnp.zeros((1, 8, 8, cfg.channels)), jnp.zeros((1,))))


def train_step_fn(model: UNet, *, learning_rate: float = 1e-4) -> Callable:
  """The pure `(state, images, key, weights) -> (state, loss)` AdamW step: noise levels t
  uniform in [0, 1), images noised as sqrt(1 - t) x + sqrt(t) noise, noise regressed."""
  def loss_fn(params, images, key, weights):
    t_key, noise_key = jax.random.split(key)
    t = jax.random.uniform(t_key, images.shape[:1])
    noise = jax.random.normal(noise_key, images.shape)
    scale = lambda v: v[:, None, None, None]
    noisy = scale(jnp.sqrt(1.0 - t)) * images + scale(jnp.sqrt(t)) * noise
    errors = jnp.mean((model.apply({"params": params}, noisy, t) - noise) ** 2, axis=(1, 2, 3))
    return jnp.sum(errors * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  return llama.adamw_train_step(loss_fn, learning_rate=learning_rate)


def example_batch(cfg: UNetConfig, batch: int, height: int, width: int | None = None,
                  seed: int = 0):
  """(images, key, weights): random images, the step's noise key, and weights that leave
  out about one example in eight (a padded last batch)."""
  width = height if width is None else width
  rng = np.random.RandomState(seed + 7 * height + width)
  images = rng.uniform(-1.0, 1.0, (batch, height, width, cfg.channels)).astype(np.float32)
  return (jnp.asarray(images), jax.random.PRNGKey(seed + height * 1000 + width),
          jnp.asarray(rng.rand(batch) > 0.125, jnp.float32))
