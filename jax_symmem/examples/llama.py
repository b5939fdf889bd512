"""A Llama-2-style decoder in Flax linen: optax AdamW step, one-flag switch to symmem.jit.

Token embedding, RMSNorm, rotary position embeddings, causal multi-head
attention, a SwiGLU MLP, a final norm and an LM head; the loss is a masked
next-token cross-entropy. Nothing branches on the sequence length in Python:
the rotary tables and the causal mask are built from `jnp.arange(s)` and
`x.shape`, so one trace with symbolic dims (b, s) covers every batch.

The training loop is the usual one; only the step factory's flag changes:

    state = init_state(cfg, seed=0)
    step = make_train_step(cfg, use_symmem=True, memory_budget=2 * 2**30)  # or use_symmem=False
    for tokens, mask in batches:                   # any (b, s) within max_batch, max_len
      state, loss = step(state, tokens, mask)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jax_symmem as symmem
from jax_symmem.examples.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
  n_layers: int = 2
  max_len: int = 512           # the longest sequence the step is planned for
  rope_theta: float = 10000.0

  def num_params(self) -> int:
    per_layer = 4 * self.d_model**2 + 3 * self.d_model * self.d_ff + 2 * self.d_model
    return 2 * self.vocab * self.d_model + self.n_layers * per_layer + self.d_model


PRESETS = {
    # Tests: a few seconds to trace, plan and compile on 2 CPU cores.
    "tiny": LlamaConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, d_ff=172, max_len=256),
    # The CPU experiment: 5.3 M parameters, 60 MiB with the AdamW state. Real peak of
    # the jax.jit step without remat (jax_symmem.measure, arguments included): 354 MiB
    # at b=2, s=512; 499 at b=2, s=700; 605 at b=4, s=512; 893 at b=4, s=700.
    "small": LlamaConfig(vocab=4096, d_model=256, n_layers=4, n_heads=4, d_ff=688, max_len=1024),
    # Llama-2 geometry at 1.26 B parameters (TinyLlama-1.1B's layer shape with full
    # multi-head attention; 14.1 GiB with f32 AdamW state): for analysis-only runs.
    "llama2_1b": LlamaConfig(vocab=32000, d_model=2048, n_layers=22, n_heads=32, d_ff=5632,
                             max_len=2048, dtype="bfloat16", param_dtype="float32",
                             norm_eps=1e-5),
    # Llama-2-7B's shape (32 layers, d_model 4096; 6.7 B parameters): planning-time runs only.
    "llama2_7b": LlamaConfig(vocab=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008,
                             max_len=4096, dtype="bfloat16", param_dtype="float32",
                             norm_eps=1e-5),
}


# --- the model -----------------------------------------------------------------------


def layer_dtypes(cfg) -> dict:
  """Flax layers' `dtype` (activations) and `param_dtype` from a config."""
  return {"dtype": jnp.dtype(cfg.dtype), "param_dtype": jnp.dtype(cfg.param_dtype)}


class RMSNorm(nn.Module):
  eps: float = 1e-6
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    # Normalize in f32 even when activations are bf16.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rotary_tables(seq_len, d_head: int, theta: float):
  """(cos, sin), each (s, d_head // 2), from `jnp.arange(s)`: symbolic when s is."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d_head, 2, dtype=jnp.float32) / d_head))
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
  """Rotates (b, s, h, d) pairs (x[..., :d/2], x[..., d/2:]) by the position's angles."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def causal_attention(q, k, v, dtype, probs_dropout: Callable | None = None):
  """Softmax attention of (b, s, h, d) queries over keys at or before each position.

  The mask is causal only: batches are right-padded, so a real token never sees a pad.
  `probs_dropout` (GPT-2's attention dropout) is applied to the probabilities.
  """
  s, d = q.shape[1], q.shape[-1]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d)).astype(q.dtype)
  causal = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  if probs_dropout is not None:
    probs = probs_dropout(probs)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class Attention(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    cfg = self.cfg
    dense = lambda features, name: nn.DenseGeneral(
        features, use_bias=False, **layer_dtypes(cfg), name=name)
    heads = (cfg.n_heads, cfg.d_head)
    q, k, v = dense(heads, "q")(x), dense(heads, "k")(x), dense(heads, "v")(x)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = causal_attention(q, k, v, jnp.dtype(cfg.dtype))
    return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, **layer_dtypes(cfg),
                           name="o")(out)


class SwiGLU(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dense = lambda features, name: nn.Dense(
        features, use_bias=False, **layer_dtypes(cfg), name=name)
    return dense(cfg.d_model, "down")(
        nn.silu(dense(cfg.d_ff, "gate")(x)) * dense(cfg.d_ff, "up")(x))


class Block(nn.Module):
  """One pre-norm decoder layer: attention and MLP, each with a residual."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    cfg = self.cfg
    norm = lambda name: RMSNorm(cfg.norm_eps, **layer_dtypes(cfg), name=name)
    x = x + Attention(cfg, name="attn")(norm("attn_norm")(x), cos, sin)
    return x + SwiGLU(cfg, name="mlp")(norm("mlp_norm")(x))


def checkpoint_policy(remat_policy: str):
  """The `jax.checkpoint` policy `remat_policy` names: None (save nothing) for "layer",
  else the `jax.checkpoint_policies` attribute of that name."""
  if remat_policy == "layer":
    return None
  policy = getattr(jax.checkpoint_policies, remat_policy, None)
  if policy is None:
    raise ValueError(f"unknown remat_policy {remat_policy!r}: use None, 'layer' or a "
                     "jax.checkpoint_policies name")
  return policy


def remat_block(block_cls, remat_policy: str | None):
  """`block_cls` under `nn.remat` as `remat_policy` asks (None: `block_cls` itself).

  "layer": save nothing inside the layer; otherwise the name of a
  `jax.checkpoint_policies` policy such as "dots_saveable". On XLA:CPU, compile
  with `compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"}` or
  XLA merges the recomputation back (DESIGN.md F1).
  """
  if remat_policy is None:
    return block_cls
  return nn.remat(block_cls, policy=checkpoint_policy(remat_policy))


class ScanBlock(nn.Module):
  """`Block` in `nn.scan`'s (carry, x) -> (carry, y) form; cos and sin are broadcast."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    return Block(self.cfg, name="block")(x, cos, sin), None


class Llama(nn.Module):
  """`scan_layers=True` stacks the layers' weights and runs them with `nn.scan`, the
  pattern large JAX models use to keep compile time flat in depth."""
  cfg: LlamaConfig
  remat_policy: str | None = None
  scan_layers: bool = False

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.d_model, **layer_dtypes(cfg),
                 embedding_init=nn.initializers.normal(0.02), name="embed")(tokens)
    cos, sin = rotary_tables(tokens.shape[1], cfg.d_head, cfg.rope_theta)
    if self.scan_layers:
      layers = nn.scan(remat_block(ScanBlock, self.remat_policy), variable_axes={"params": 0},
                       split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast),
                       length=cfg.n_layers)
      x, _ = layers(cfg, name="layers")(x, cos, sin)
    else:
      block = remat_block(Block, self.remat_policy)
      for i in range(cfg.n_layers):
        x = block(cfg, name=f"layer_{i}")(x, cos, sin)
    x = RMSNorm(cfg.norm_eps, **layer_dtypes(cfg), name="final_norm")(x)
    return nn.Dense(cfg.vocab, use_bias=False, **layer_dtypes(cfg),
                    name="lm_head")(x)


# --- loss, optimizer, step -------------------------------------------------------------


def masked_cross_entropy(logits, labels, weights):
  """Weighted mean of the cross-entropy of `logits` (..., vocab) against integer `labels`.

  Computed in f32; `weights` (0 or 1 per label, same shape as `labels`) select what
  counts, and the mean is over their sum (0 when nothing counts).
  """
  weights = weights.astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def next_token_loss(logits, tokens, mask):
  """Masked next-token cross-entropy: position t predicts token t+1.

  A pair counts when both its positions are real tokens; the loss is the mean
  over counted pairs (0 when there are none).
  """
  mask = mask.astype(jnp.float32)
  return masked_cross_entropy(logits[:, :-1], tokens[:, 1:], mask[:, :-1] * mask[:, 1:])


def make_optimizer(learning_rate: float = 1e-3) -> optax.GradientTransformation:
  return optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1)


def init_linen_state(model: nn.Module, seed: int = 0, learning_rate: float = 1e-3,
                     example_args: tuple | None = None) -> dict:
  """{"params", "opt_state"} of a linen model: the pytree the step takes and returns.

  `example_args` are what `model.init` is called with (default: one (1, 2) int32
  token batch, what a decoder-only LM takes).
  """
  if example_args is None:
    example_args = (jnp.zeros((1, 2), jnp.int32),)

  @jax.jit   # op-by-op initialization takes seconds even for the tiny preset
  def init(key):
    params = model.init(key, *example_args)["params"]
    return {"params": params, "opt_state": make_optimizer(learning_rate).init(params)}
  return init(jax.random.PRNGKey(seed))


def init_state(cfg: LlamaConfig, seed: int = 0, learning_rate: float = 1e-3,
               scan_layers: bool = False) -> dict:
  """{"params", "opt_state"}: the pytree the step takes and returns."""
  return init_linen_state(Llama(cfg, scan_layers=scan_layers), seed, learning_rate)


def step_constraints(max_len: int, max_batch: int) -> tuple[str, ...]:
  return (f"s <= {max_len}", f"b <= {max_batch}", "s >= 2")


def jit_polymorphic(step: Callable, *, use_symmem: bool, polymorphic_shapes: tuple,
                    constraints: tuple[str, ...], memory_budget=None):
  """`jax.jit(step)`, or `symmem.jit(step)` with these symbolic shapes and constraints.

  The one switch of a training loop: both take and return the same pytrees.
  """
  if not use_symmem:
    return jax.jit(step)
  return symmem.jit(step, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
                    memory_budget=memory_budget)


def jit_step(step: Callable, *, use_symmem: bool, memory_budget=None, max_len: int,
             max_batch: int):
  """`jax.jit(step)`, or `symmem.jit` with symbolic (b, s) tokens and mask."""
  return jit_polymorphic(step, use_symmem=use_symmem, polymorphic_shapes=(None, "b, s", "b, s"),
                         constraints=step_constraints(max_len, max_batch),
                         memory_budget=memory_budget)


def adamw_train_step(loss_fn: Callable, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, *batch) -> (state, loss)` AdamW step of `loss_fn(params, *batch)`.

  `state` is `init_linen_state`'s {"params", "opt_state"}.
  """
  tx = make_optimizer(learning_rate)

  def train_step(state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], *batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, loss

  return train_step


def train_step_fn(model: nn.Module, *, learning_rate: float = 1e-3) -> Callable:
  """The pure (unjitted) `(state, tokens, mask) -> (state, loss)` AdamW step of a linen LM."""
  def loss_fn(params, tokens, mask):
    return next_token_loss(model.apply({"params": params}, tokens), tokens, mask)
  return adamw_train_step(loss_fn, learning_rate=learning_rate)


def accumulating_train_step_fn(model: nn.Module, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, tokens, mask) -> (state, loss)` AdamW step with gradient
  accumulation: tokens and mask are (m, b, s), m microbatches of b sequences, and a
  `lax.scan` over them averages the gradients before one update (the microbatches'
  activations are live one at a time)."""
  tx = make_optimizer(learning_rate)

  def loss_fn(params, tokens, mask):
    return next_token_loss(model.apply({"params": params}, tokens), tokens, mask)

  def train_step(state, tokens, mask):
    params = state["params"]
    def microbatch(grads, batch):
      loss, g = jax.value_and_grad(loss_fn)(params, *batch)
      return jax.tree.map(jnp.add, grads, g), loss
    grads, losses = jax.lax.scan(microbatch, jax.tree.map(jnp.zeros_like, params),
                                 (tokens, mask))
    grads = jax.tree.map(lambda g: g / tokens.shape[0], grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, losses.mean()

  return train_step


def make_train_step(cfg: LlamaConfig, *, learning_rate: float = 1e-3,
                    remat_policy: str | None = None, scan_layers: bool = False,
                    use_symmem: bool = False, memory_budget=None, max_len: int | None = None,
                    max_batch: int = 16):
  """A jitted `(state, tokens, mask) -> (state, loss)` AdamW step.

  Args:
    cfg: the model.
    learning_rate: AdamW's learning rate (`init_state`'s optimizer state fits any).
    remat_policy: None (no rematerialization), "layer" (`nn.remat` around each
      decoder block) or a `jax.checkpoint_policies` name applied per block.
    scan_layers: run the layers with `nn.scan` over stacked weights (initialize the
      state with the same flag).
    use_symmem: compile with `symmem.jit` (symbolic (b, s), one memory plan for
      every batch shape) instead of `jax.jit`.
    memory_budget: `symmem.jit`'s budget in bytes (ignored by `jax.jit`).
    max_len, max_batch: the largest (s, b) planned for (default `cfg.max_len`, 16).
  """
  return jit_step(train_step_fn(Llama(cfg, remat_policy, scan_layers),
                                learning_rate=learning_rate),
                  use_symmem=use_symmem, memory_budget=memory_budget,
                  max_len=cfg.max_len if max_len is None else max_len, max_batch=max_batch)


def example_batch(cfg: LlamaConfig, batch: int, seq: int, seed: int = 0):
  """Random (tokens int32, mask f32) of shape (batch, seq), all positions real."""
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq), 0, cfg.vocab, jnp.int32)
  return tokens, jnp.ones((batch, seq), jnp.float32)
