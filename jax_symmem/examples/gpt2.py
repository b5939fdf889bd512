"""A GPT-2-style decoder in Flax linen, with the same step factory as `llama.py`.

LayerNorm, learned position embeddings, causal multi-head attention with
biases, a GELU MLP and an LM head tied to the token embedding. Positions are
`jnp.arange(s)` looked up in a (max_len, d_model) table, so one trace with
symbolic (b, s) covers every batch with s <= max_len.

    state = init_state(cfg, seed=0)
    step = make_train_step(cfg, use_symmem=True)     # or use_symmem=False
    state, loss = step(state, tokens, mask)

`GPT2(cfg, layer_drop=p)` trains with LayerDrop (Fan et al., 2019): each layer is
skipped with probability p, drawn per layer from the "layerdrop" RNG stream under
`nn.cond`, so a skipped layer costs nothing; `layer_drop_train_step_fn` is its
`(state, tokens, mask, key)` step. Under AD each layer becomes a forward/backward
`lax.cond` pair, as stochastic depth does in vision models.

`GPT2Config(dropout=p)` trains with dropout where GPT-2 (and HF's port) has it: on the
embeddings, the attention probabilities and each residual branch's output, drawn from
the "dropout" RNG stream; `dropout_train_step_fn` is its `(state, tokens, mask, key)`
step.

`GPT2(cfg, scan_layers=True)` stacks the layers' weights and runs them with `nn.scan`
(each layer draws its own dropout masks: the "dropout" stream is split per layer), as
large JAX models write it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_symmem.examples import llama
from jax_symmem.examples.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GPT2Config(ModelConfig):
  n_layers: int = 2
  d_ff: int = 256
  max_len: int = 256           # rows of the position table: the longest sequence
  norm_eps: float = 1e-5
  dropout: float = 0.0         # embeddings, attention probabilities, residual branches


PRESETS = {
    "tiny": GPT2Config(),   # tests
    # 4.5 M parameters (51 MiB with the AdamW state); real peak of the jax.jit step
    # (jax_symmem.measure, arguments included): 310 MiB at b=2, s=512, 881 at b=4, s=700.
    "small": GPT2Config(vocab=4096, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_len=1024),
}


class Block(nn.Module):
  """One pre-norm GPT-2 layer: attention and MLP, each with a residual."""
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dt = llama.layer_dtypes(cfg)
    norm = lambda name: nn.LayerNorm(cfg.norm_eps, **dt, name=name)
    h = norm("ln_1")(x)
    qkv = nn.DenseGeneral((3, cfg.n_heads, cfg.d_head), **dt, name="qkv")(h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    drop = _dropout(cfg)
    out = llama.causal_attention(q, k, v, jnp.dtype(cfg.dtype), drop)
    x = x + drop(nn.DenseGeneral(cfg.d_model, axis=(-2, -1), **dt, name="proj")(out))
    h = nn.Dense(cfg.d_ff, **dt, name="fc")(norm("ln_2")(x))
    return x + drop(nn.Dense(cfg.d_model, **dt, name="fc_proj")(nn.gelu(h, approximate=True)))


class ScanBlock(nn.Module):
  """`Block` in `nn.scan`'s (carry, x) -> (carry, y) form."""
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x, _):
    return Block(self.cfg, name="block")(x), None


def _dropout(cfg: GPT2Config) -> Callable:
  """Dropout at `cfg.dropout` (a fresh module per call site), or the identity at 0."""
  if not cfg.dropout:
    return lambda x: x
  return lambda x: nn.Dropout(cfg.dropout, deterministic=False)(x)


class GPT2(nn.Module):
  cfg: GPT2Config
  remat_policy: str | None = None
  layer_drop: float = 0.0      # LayerDrop's skip probability per layer (0: every layer runs)
  scan_layers: bool = False    # nn.scan over stacked layer weights

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    dt = llama.layer_dtypes(cfg)
    embed = nn.Embed(cfg.vocab, cfg.d_model, **dt,
                     embedding_init=nn.initializers.normal(0.02), name="wte")
    positions = nn.Embed(cfg.max_len, cfg.d_model, **dt,
                         embedding_init=nn.initializers.normal(0.01), name="wpe")
    x = _dropout(cfg)(embed(tokens) + positions(jnp.arange(tokens.shape[1]))[None])
    if self.scan_layers:
      if self.layer_drop:
        raise ValueError("layer_drop needs unrolled layers (scan_layers=False)")
      layers = nn.scan(llama.remat_block(ScanBlock, self.remat_policy),
                       variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True},
                       in_axes=nn.broadcast, length=cfg.n_layers)
      x, _ = layers(cfg, name="layers")(x, None)
      return embed.attend(nn.LayerNorm(cfg.norm_eps, **dt, name="ln_f")(x))
    block = llama.remat_block(Block, self.remat_policy)
    for i in range(cfg.n_layers):
      layer = block(cfg, name=f"h_{i}")
      if self.layer_drop and not self.is_initializing():
        keep = jax.random.bernoulli(self.make_rng("layerdrop"), 1.0 - self.layer_drop)
        x = nn.cond(keep, lambda mdl, x: mdl(x), lambda mdl, x: x, layer, x)
      else:
        x = layer(x)
    return embed.attend(nn.LayerNorm(cfg.norm_eps, **dt, name="ln_f")(x))


def init_state(cfg: GPT2Config, seed: int = 0, learning_rate: float = 1e-3,
               scan_layers: bool = False) -> dict:
  """{"params", "opt_state"}: the pytree the step takes and returns (layers stacked for
  `scan_layers`)."""
  return llama.init_linen_state(GPT2(cfg, scan_layers=scan_layers), seed, learning_rate)


def make_train_step(cfg: GPT2Config, *, learning_rate: float = 1e-3,
                    remat_policy: str | None = None, scan_layers: bool = False,
                    use_symmem: bool = False, memory_budget=None, max_len: int | None = None,
                    max_batch: int = 16):
  """A jitted `(state, tokens, mask) -> (state, loss)` AdamW step; see `llama.make_train_step`
  (`scan_layers`: initialize the state with the same flag).

  max_len defaults to (and may not exceed) `cfg.max_len`, the position table's length.
  Without dropout (`cfg.dropout == 0`); a model with dropout takes a key per step:
  `dropout_train_step_fn`.
  """
  max_len = cfg.max_len if max_len is None else max_len
  if max_len > cfg.max_len:
    raise ValueError(f"max_len={max_len} exceeds the {cfg.max_len} learned positions")
  if cfg.dropout:
    raise ValueError(f"dropout={cfg.dropout} needs a key per step: use dropout_train_step_fn")
  step = llama.train_step_fn(GPT2(cfg, remat_policy, scan_layers=scan_layers),
                             learning_rate=learning_rate)
  return llama.jit_step(step, use_symmem=use_symmem, memory_budget=memory_budget,
                        max_len=max_len, max_batch=max_batch)


def layer_drop_train_step_fn(model: GPT2, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, tokens, mask, key) -> (state, loss)` AdamW step of a LayerDrop
  model: `key` seeds the layers' skip draws (a new key per step)."""
  def loss_fn(params, tokens, mask, key):
    logits = model.apply({"params": params}, tokens, rngs={"layerdrop": key})
    return llama.next_token_loss(logits, tokens, mask)
  return llama.adamw_train_step(loss_fn, learning_rate=learning_rate)


def dropout_train_step_fn(model: GPT2, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, tokens, mask, key) -> (state, loss)` AdamW step of a model with
  `cfg.dropout`: `key` seeds the dropout masks (a new key per step)."""
  def loss_fn(params, tokens, mask, key):
    logits = model.apply({"params": params}, tokens, rngs={"dropout": key})
    return llama.next_token_loss(logits, tokens, mask)
  return llama.adamw_train_step(loss_fn, learning_rate=learning_rate)


def example_batch(cfg: GPT2Config, batch: int, seq: int, seed: int = 0):
  """Random (tokens int32, mask f32) of shape (batch, seq), all positions real."""
  return llama.example_batch(cfg, batch, seq, seed)
