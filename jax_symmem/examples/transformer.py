"""A small decoder-only transformer training step in plain JAX.

Token embedding, RMSNorm, causal self-attention with s x s scores, a SwiGLU MLP
and a masked next-token cross-entropy; `train_step` returns the loss and the
SGD-updated parameters. Every shape follows the batch's (b, s), so one trace
with symbolic dims covers every batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_symmem.examples.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Config(ModelConfig):
  n_layers: int = 2


def init_params(key: jax.Array, cfg: Config) -> dict:
  dt = jnp.dtype(cfg.param_dtype)
  keys = iter(jax.random.split(key, 2 + 6 * cfg.n_layers))
  def dense(shape):
    return (jax.random.normal(next(keys), shape) / jnp.sqrt(shape[0])).astype(dt)
  layers = []
  for _ in range(cfg.n_layers):
    layers.append({
        "attn_norm": jnp.ones((cfg.d_model,), dt),
        "wqkv": dense((cfg.d_model, 3 * cfg.d_model)),
        "wo": dense((cfg.d_model, cfg.d_model)),
        "mlp_norm": jnp.ones((cfg.d_model,), dt),
        "w_gate": dense((cfg.d_model, cfg.d_ff)),
        "w_up": dense((cfg.d_model, cfg.d_ff)),
        "w_down": dense((cfg.d_ff, cfg.d_model)),
    })
  return {"embed": dense((cfg.vocab, cfg.d_model)), "layers": layers,
          "final_norm": jnp.ones((cfg.d_model,), dt), "unembed": dense((cfg.d_model, cfg.vocab))}


def rms_norm(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def attention(x, layer, n_heads):
  b, s, d = x.shape
  qkv = x @ layer["wqkv"]
  q, k, v = jnp.split(qkv, 3, axis=-1)
  heads = lambda t: t.reshape(b, s, n_heads, d // n_heads).transpose(0, 2, 1, 3)
  q, k, v = heads(q), heads(k), heads(v)
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(d // n_heads).astype(x.dtype)
  causal = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(causal, scores, jnp.finfo(x.dtype).min)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3).reshape(b, s, d)
  return out @ layer["wo"]


def mlp(x, layer):
  return (jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]


def block(x, layer, cfg: Config):
  """One pre-norm decoder layer: attention and MLP, each with a residual."""
  x = x + attention(rms_norm(x, layer["attn_norm"], cfg.norm_eps), layer, cfg.n_heads)
  return x + mlp(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer)


def _remat(fn, remat_policy):
  """`fn` under `jax.checkpoint` as `remat_policy` asks (None: `fn` itself).

  "layer": plain `jax.checkpoint` (save nothing inside); otherwise the name of a
  `jax.checkpoint_policies` policy such as "dots_saveable". On XLA:CPU, compile
  with `compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"}` or
  XLA merges the recomputation back (DESIGN.md F1).
  """
  if remat_policy is None:
    return fn
  if remat_policy == "layer":
    return jax.checkpoint(fn, static_argnums=(2,))
  policy = getattr(jax.checkpoint_policies, remat_policy, None)
  if policy is None:
    raise ValueError(f"unknown remat_policy {remat_policy!r}: use None, 'layer' or a "
                     "jax.checkpoint_policies name")
  return jax.checkpoint(fn, policy=policy, static_argnums=(2,))


def forward(params, tokens, cfg: Config, remat_policy: str | None = None):
  layer_fn = _remat(block, remat_policy)
  x = params["embed"][tokens]
  for layer in params["layers"]:
    x = layer_fn(x, layer, cfg)
  return rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"]


def loss_fn(params, tokens, mask, cfg: Config, remat_policy: str | None = None):
  """Masked next-token cross-entropy: position t predicts token t+1."""
  logits = forward(params, tokens, cfg, remat_policy)[:, :-1]
  targets, weights = tokens[:, 1:], mask[:, 1:].astype(logits.dtype)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_train_step(cfg: Config, learning_rate: float = 1e-2, remat_policy: str | None = None):
  """A `(params, tokens, mask) -> (loss, new_params)` SGD step.

  remat_policy: None (default, no rematerialization), "layer" (`jax.checkpoint`
  around each decoder layer) or a `jax.checkpoint_policies` name applied per layer
  ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable", ...).
  """
  def train_step(params, tokens, mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, cfg, remat_policy)
    new_params = jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads)
    return loss, new_params
  return train_step


def example_args(cfg: Config, batch: int, seq: int, seed: int = 0):
  """Concrete (params, tokens, mask) for one batch."""
  key = jax.random.PRNGKey(seed)
  params = init_params(key, cfg)
  tokens = jax.random.randint(jax.random.fold_in(key, 1), (batch, seq), 0, cfg.vocab, jnp.int32)
  mask = jnp.ones((batch, seq), jnp.float32)
  return params, tokens, mask
