"""A GPT-2-style decoder written the Equinox way: modules as pytrees, layers scanned.

Equinox users keep a deep model's compile time flat by building the layers with
`eqx.filter_vmap` (one module whose arrays carry a leading layer axis) and running
them under `jax.lax.scan`, splitting arrays from the static rest with
`eqx.partition` / `eqx.combine` (Equinox's documented scan-over-layers pattern).
The modules work on one sequence (`eqx.nn.MultiheadAttention`, `eqx.nn.MLP` over
positions by `jax.vmap`) and the loss vmaps the model over the batch, so the
program's dots carry the batch as a vmapped dimension rather than a Flax one.
`remat_policy="layer"` wraps the scanned layer in `eqx.filter_checkpoint`
(per-layer checkpointing). `scan_layers=False` keeps the layers as a list of blocks
called in a Python loop instead (the other way Equinox models are written; each
call under `eqx.filter_checkpoint` for "layer"). Needs equinox (`pip install -e
".[experiments]"`).

    state = init_state(cfg)                      # {"params", "opt_state"}
    step = train_step_fn(cfg)                    # pure (state, tokens, mask) -> (state, loss)
    state, loss = jax.jit(step)(state, tokens, mask)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_symmem.examples import llama
from jax_symmem.examples.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GPTConfig(ModelConfig):
  n_layers: int = 2
  d_ff: int = 256
  max_len: int = 256           # rows of the position table: the longest sequence


class Block(eqx.Module):
  """One pre-norm layer over a (seq, d_model) sequence."""
  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, cfg: GPTConfig, key):
    k_attn, k_mlp = jax.random.split(key)
    self.norm1 = eqx.nn.LayerNorm(cfg.d_model)
    self.attention = eqx.nn.MultiheadAttention(cfg.n_heads, cfg.d_model, key=k_attn)
    self.norm2 = eqx.nn.LayerNorm(cfg.d_model)
    self.mlp = eqx.nn.MLP(cfg.d_model, cfg.d_model, cfg.d_ff, depth=1,
                          activation=jax.nn.gelu, key=k_mlp)

  def __call__(self, x, mask):
    h = jax.vmap(self.norm1)(x)
    x = x + self.attention(h, h, h, mask=mask)
    return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class GPT(eqx.Module):
  embedding: eqx.nn.Embedding
  positions: eqx.nn.Embedding
  layers: Block | list         # one Block, every array with a leading n_layers axis; or a list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, cfg: GPTConfig, key, scan_layers: bool = True):
    k_emb, k_pos, k_layers, k_head = jax.random.split(key, 4)
    self.embedding = eqx.nn.Embedding(cfg.vocab, cfg.d_model, key=k_emb)
    self.positions = eqx.nn.Embedding(cfg.max_len, cfg.d_model, key=k_pos)
    keys = jax.random.split(k_layers, cfg.n_layers)
    if scan_layers:
      self.layers = eqx.filter_vmap(lambda k: Block(cfg, k))(keys)
    else:
      self.layers = [Block(cfg, k) for k in keys]
    self.norm = eqx.nn.LayerNorm(cfg.d_model)
    self.head = eqx.nn.Linear(cfg.d_model, cfg.vocab, use_bias=False, key=k_head)

  def __call__(self, tokens, remat_policy: str | None = None):
    """Logits (seq, vocab) of one sequence of token ids; "layer": each layer checkpointed."""
    s = tokens.shape[0]
    x = jax.vmap(self.embedding)(tokens) + jax.vmap(self.positions)(jnp.arange(s))
    mask = jnp.tril(jnp.ones((s, s), bool))
    checkpoint = eqx.filter_checkpoint if remat_policy == "layer" else (lambda f: f)
    if isinstance(self.layers, list):   # a Python loop: each layer traced in turn
      call = checkpoint(lambda block, x: block(x, mask))
      for block in self.layers:
        x = call(block, x)
    else:
      arrays, static = eqx.partition(self.layers, eqx.is_array)
      layer = checkpoint(lambda x, layer_arrays: (eqx.combine(layer_arrays, static)(x, mask), None))
      x, _ = jax.lax.scan(layer, x, arrays)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def _split(cfg: GPTConfig, seed: int = 0, scan_layers: bool = True):
  """(float arrays, the rest): what the step trains, and what it combines them with."""
  return eqx.partition(GPT(cfg, jax.random.PRNGKey(seed), scan_layers), eqx.is_inexact_array)


def init_state(cfg: GPTConfig, seed: int = 0, learning_rate: float = 1e-3, *,
               scan_layers: bool = True) -> dict:
  """{"params", "opt_state"}: the model's float arrays and their AdamW state."""
  params, _ = _split(cfg, seed, scan_layers)
  return {"params": params, "opt_state": llama.make_optimizer(learning_rate).init(params)}


def train_step_fn(cfg: GPTConfig, *, remat_policy: str | None = None,
                  learning_rate: float = 1e-3, scan_layers: bool = True) -> Callable:
  """The pure `(state, tokens, mask) -> (state, loss)` AdamW step (next-token loss)."""
  if remat_policy not in (None, "layer"):
    raise ValueError(f"remat_policy must be None or 'layer', got {remat_policy!r}")
  _, static = eqx.filter_eval_shape(_split, cfg, 0, scan_layers)   # no arrays made

  def loss_fn(params, tokens, mask):
    model = eqx.combine(params, static)
    logits = jax.vmap(lambda t: model(t, remat_policy))(tokens)
    return llama.next_token_loss(logits, tokens, mask)

  return llama.adamw_train_step(loss_fn, learning_rate=learning_rate)


def example_batch(cfg: GPTConfig, batch: int, seq: int, seed: int = 0):
  """Random (tokens int32, mask f32) of shape (batch, seq), all positions real."""
  return llama.example_batch(cfg, batch, seq, seed)


__all__ = ["Block", "GPT", "GPTConfig", "example_batch", "init_state", "train_step_fn"]
