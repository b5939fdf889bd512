"""A sparse Mixture-of-Experts decoder in Flax linen (Switch / GShard routing, Mixtral's layer).

The Llama layer of `llama.py` with its MLP replaced by `n_experts` SwiGLU experts: a
router picks each token's `top_k` experts (`lax.top_k` of the softmax), each expert takes
at most `capacity` tokens of a sequence in token order (GShard's dispatch: a cumulative
sum of the routing one-hots gives each token its slot; tokens past the capacity are
dropped and pass through the residual), and the load-balancing loss of Switch
Transformers is added to the LM loss. The dispatch and combine tensors are (b, s, E, C)
with C proportional to s, so the layer's memory grows with s**2 like attention's.

The capacity is written with integer arithmetic on the sequence length,
`ceil(capacity_factor * s * top_k / n_experts)`, so one trace with symbolic (b, s)
covers every batch (a float `int(1.25 * s)` cannot be traced symbolically).

    state = init_state(cfg, seed=0, scan_layers=True)
    step = llama.jit_step(train_step_fn(MoE(cfg, scan_layers=True)), use_symmem=True,
                          memory_budget="600MiB", max_len=cfg.max_len, max_batch=8)
    state, loss = step(state, tokens, mask)
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_symmem.examples import llama


@dataclasses.dataclass(frozen=True)
class MoEConfig(llama.LlamaConfig):
  n_experts: int = 4
  top_k: int = 2
  capacity_factor: float = 1.25   # slots per expert over the even share s * top_k / n_experts
  aux_loss_weight: float = 0.01   # Switch Transformers' load-balancing loss

  def capacity(self, s):
    """Slots per expert and sequence: ceil(capacity_factor * s * top_k / n_experts), in
    integer arithmetic so that `s` may be a symbolic dim."""
    factor = fractions.Fraction(self.capacity_factor).limit_denominator(1000)
    divisor = factor.denominator * self.n_experts
    return (factor.numerator * self.top_k * s + divisor - 1) // divisor


PRESETS = {
    "tiny": MoEConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_len=256),
}


def route(probs, top_k: int, capacity):
  """GShard's top-k dispatch of router probabilities `probs` (b, s, E): (dispatch,
  combine), each (b, s, E, capacity). dispatch[b, t, e, c] is 1 where token t of sequence
  b takes slot c of expert e; combine holds its gate there (the token's top_k
  probabilities renormalized to sum to 1). Slots go to earlier tokens first and, within a
  token, to its first choice first; a choice past its expert's capacity is dropped."""
  b, s, n = probs.shape
  gates, experts = jax.lax.top_k(probs, top_k)                          # (b, s, k)
  gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  choice = jax.nn.one_hot(experts, n, dtype=jnp.float32).reshape(b, s * top_k, n)
  slot = (jnp.cumsum(choice, axis=1) - 1.0) * choice
  kept = choice * (slot < capacity)
  dispatch = (jax.nn.one_hot(slot.astype(jnp.int32), capacity, dtype=jnp.float32)
              * kept[..., None]).reshape(b, s, top_k, n, capacity)
  combine = jnp.sum(dispatch * gates[..., None, None], axis=2)
  return jnp.sum(dispatch, axis=2), combine


class Experts(nn.Module):
  """Routes each token to its top_k experts within their capacity; returns the combined
  expert outputs and the layer's load-balancing loss."""
  cfg: MoEConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    n, k, dtypes = cfg.n_experts, cfg.top_k, llama.layer_dtypes(cfg)
    b, s, _ = x.shape
    capacity = cfg.capacity(s)
    logits = nn.Dense(n, use_bias=False, **dtypes, name="router")(x)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)        # (b, s, E)
    dispatch, combine = route(probs, k, capacity)
    inputs = jnp.einsum("bsec,bsd->becd", dispatch.astype(x.dtype), x)
    init = nn.initializers.lecun_normal(batch_axis=(0,))
    w_gate = self.param("gate", init, (n, cfg.d_model, cfg.d_ff), jnp.dtype(cfg.param_dtype))
    w_up = self.param("up", init, (n, cfg.d_model, cfg.d_ff), jnp.dtype(cfg.param_dtype))
    w_down = self.param("down", init, (n, cfg.d_ff, cfg.d_model), jnp.dtype(cfg.param_dtype))
    w_gate, w_up, w_down = (w.astype(x.dtype) for w in (w_gate, w_up, w_down))
    hidden = (nn.silu(jnp.einsum("becd,edf->becf", inputs, w_gate))
              * jnp.einsum("becd,edf->becf", inputs, w_up))
    outputs = jnp.einsum("becf,efd->becd", hidden, w_down)
    y = jnp.einsum("bsec,becd->bsd", combine.astype(x.dtype), outputs)
    # Switch: E * sum over experts of (share of first choices) x (mean router probability).
    share = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, axis=-1), n), axis=(0, 1))
    aux = n * jnp.sum(share * jnp.mean(probs, axis=(0, 1)))
    return y, aux


class Block(nn.Module):
  """One pre-norm layer: Llama's attention, then the experts, each with a residual."""
  cfg: MoEConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    cfg = self.cfg
    norm = lambda name: llama.RMSNorm(cfg.norm_eps, **llama.layer_dtypes(cfg), name=name)
    x = x + llama.Attention(cfg, name="attn")(norm("attn_norm")(x), cos, sin)
    y, aux = Experts(cfg, name="experts")(norm("moe_norm")(x))
    return x + y, aux


class ScanBlock(nn.Module):
  """`Block` in `nn.scan`'s (carry, x) -> (carry, y) form; each layer's aux loss is y."""
  cfg: MoEConfig

  @nn.compact
  def __call__(self, x, cos, sin):
    return Block(self.cfg, name="block")(x, cos, sin)


class MoE(nn.Module):
  """Returns (logits, mean load-balancing loss over the layers). `scan_layers=True` runs
  the layers with `nn.scan`; `remat_policy` as `llama.Llama`'s ("layer": `nn.remat` on
  each layer)."""
  cfg: MoEConfig
  remat_policy: str | None = None
  scan_layers: bool = False

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    dtypes = llama.layer_dtypes(cfg)
    x = nn.Embed(cfg.vocab, cfg.d_model, **dtypes, embedding_init=nn.initializers.normal(0.02),
                 name="embed")(tokens)
    cos, sin = llama.rotary_tables(tokens.shape[1], cfg.d_head, cfg.rope_theta)
    if self.scan_layers:
      layers = nn.scan(llama.remat_block(ScanBlock, self.remat_policy),
                       variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(nn.broadcast, nn.broadcast), length=cfg.n_layers)
      x, aux = layers(cfg, name="layers")(x, cos, sin)
      aux = jnp.mean(aux)
    else:
      block, losses = llama.remat_block(Block, self.remat_policy), []
      for i in range(cfg.n_layers):
        x, layer_aux = block(cfg, name=f"layer_{i}")(x, cos, sin)
        losses.append(layer_aux)
      aux = sum(losses) / cfg.n_layers
    x = llama.RMSNorm(cfg.norm_eps, **dtypes, name="final_norm")(x)
    return nn.Dense(cfg.vocab, use_bias=False, **dtypes, name="lm_head")(x), aux


def init_state(cfg: MoEConfig, seed: int = 0, learning_rate: float = 1e-3,
               scan_layers: bool = False) -> dict:
  """{"params", "opt_state"}: the pytree the step takes and returns."""
  return llama.init_linen_state(MoE(cfg, scan_layers=scan_layers), seed, learning_rate)


def train_step_fn(model: MoE, *, learning_rate: float = 1e-3) -> Callable:
  """The pure `(state, tokens, mask) -> (state, loss)` AdamW step: the masked next-token
  loss plus `aux_loss_weight` times the load-balancing loss."""
  def loss_fn(params, tokens, mask):
    logits, aux = model.apply({"params": params}, tokens)
    return llama.next_token_loss(logits, tokens, mask) + model.cfg.aux_loss_weight * aux
  return llama.adamw_train_step(loss_fn, learning_rate=learning_rate)


def example_batch(cfg: MoEConfig, batch: int, seq: int, seed: int = 0):
  """Random (tokens int32, mask f32) of shape (batch, seq), all positions real."""
  return llama.example_batch(cfg, batch, seq, seed)
