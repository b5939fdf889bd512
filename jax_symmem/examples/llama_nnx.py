"""The Llama-style model of `llama.py` in flax.nnx, with the same one-flag switch to symmem.jit.

NNX modules are mutable Python objects; `symmem.jit` (like `jax.jit`) needs a
pure function of arrays. `make_nnx_train_step` splits (model, optimizer) once
into a static graph definition and a state pytree, jits a pure
`(state, tokens, mask) -> (state, loss)` that merges, steps and splits again,
and writes the new state back into the objects after each call: the loop reads
as an ordinary NNX loop.

    model, optimizer = init_state(cfg, seed=0)     # scan_layers=True: nnx.vmap / nnx.scan layers
    step = make_nnx_train_step(model, optimizer, use_symmem=True)   # or use_symmem=False
    for tokens, mask in batches:
      loss = step(model, optimizer, tokens, mask)                   # updates both in place
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from jax_symmem.examples import llama
from jax_symmem.examples.llama import LlamaConfig, PRESETS  # noqa: F401  (re-exported)


def _linear(cfg: LlamaConfig, rngs: nnx.Rngs, n_in: int, n_out: int) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs, **llama.layer_dtypes(cfg))


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, cfg: LlamaConfig):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.dtype(cfg.param_dtype)))
    self.eps, self.dtype = cfg.norm_eps, jnp.dtype(cfg.dtype)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    # In this order: the rngs hand out keys in turn.
    self.q, self.k, self.v, self.o = (_linear(cfg, rngs, cfg.d_model, cfg.d_model)
                                      for _ in range(4))
    self.n_heads, self.d_head, self.dtype = cfg.n_heads, cfg.d_head, jnp.dtype(cfg.dtype)

  def __call__(self, x, cos, sin):
    # Reshape with the input's own (possibly symbolic) leading dims.
    heads = lambda t: t.reshape(x.shape[:-1] + (self.n_heads, self.d_head))
    q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
    q, k = llama.apply_rotary(q, cos, sin), llama.apply_rotary(k, cos, sin)
    out = llama.causal_attention(q, k, v, self.dtype)
    return self.o(out.reshape(x.shape))


class SwiGLU(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.gate, self.up = (_linear(cfg, rngs, cfg.d_model, cfg.d_ff) for _ in range(2))
    self.down = _linear(cfg, rngs, cfg.d_ff, cfg.d_model)

  def __call__(self, x):
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """One pre-norm decoder layer: attention and MLP, each with a residual."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg)
    self.mlp = SwiGLU(cfg, rngs)

  def __call__(self, x, cos, sin):
    x = x + self.attn(self.attn_norm(x), cos, sin)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """`scan_layers=True` creates the layers with `nnx.vmap` over split rngs (each
  weight stacked on a leading (n_layers,) axis) and runs them with `nnx.scan`.
  `remat_policy` (None, "layer" or a `jax.checkpoint_policies` name, as in
  `llama.make_train_step`) wraps each layer's call in `nnx.remat`."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, *, scan_layers: bool = False,
               remat_policy: str | None = None):
    self.cfg, self.scan_layers, self.remat_policy = cfg, scan_layers, remat_policy
    if remat_policy is not None:
      llama.checkpoint_policy(remat_policy)   # an unknown name fails here, not at the first call
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs, **llama.layer_dtypes(cfg),
                           embedding_init=nnx.initializers.normal(0.02))
    if scan_layers:
      @nnx.split_rngs(splits=cfg.n_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def create_blocks(rngs: nnx.Rngs):
        return Block(cfg, rngs)
      self.layers = create_blocks(rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg)
    self.lm_head = _linear(cfg, rngs, cfg.d_model, cfg.vocab)

  def __call__(self, tokens):
    cfg = self.cfg
    x = self.embed(tokens)
    cos, sin = llama.rotary_tables(tokens.shape[1], cfg.d_head, cfg.rope_theta)

    def apply_block(block, x, cos, sin):
      return block(x, cos, sin)
    if self.remat_policy is not None:
      apply_block = nnx.remat(apply_block, policy=llama.checkpoint_policy(self.remat_policy))

    if self.scan_layers:
      @nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=nnx.Carry)
      def run_layers(x, block, cos, sin):
        return apply_block(block, x, cos, sin)
      x = run_layers(x, self.layers, cos, sin)
    else:
      for block in self.layers:
        x = apply_block(block, x, cos, sin)
    return self.lm_head(self.final_norm(x))


def init_state(cfg: LlamaConfig, seed: int = 0, learning_rate: float = 1e-3, *,
               scan_layers: bool = False, remat_policy: str | None = None):
  """(model, optimizer): a fresh model (options as in `Llama`) and its AdamW optimizer."""
  model = Llama(cfg, nnx.Rngs(seed), scan_layers=scan_layers, remat_policy=remat_policy)
  return model, nnx.Optimizer(model, llama.make_optimizer(learning_rate), wrt=nnx.Param)


def pure_train_step(model: Llama, optimizer: nnx.Optimizer):
  """The pure `(state, tokens, mask) -> (state, loss)` step over `nnx.state((model,
  optimizer))`: what `make_nnx_train_step` jits (and what a benchmark compiles)."""
  graphdef, _ = nnx.split((model, optimizer))

  def pure_step(state, tokens, mask):
    model, optimizer = nnx.merge(graphdef, state)
    def loss_fn(model):
      return llama.next_token_loss(model(tokens), tokens, mask)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return pure_step


def make_nnx_train_step(model: Llama, optimizer: nnx.Optimizer, *, use_symmem: bool = False,
                        memory_budget=None, max_len: int | None = None, max_batch: int = 16):
  """`step(model, optimizer, tokens, mask) -> loss`, updating both in place.

  The jitted function is pure, `(state, tokens, mask) -> (state, loss)` over
  `nnx.state((model, optimizer))`, and is `step.jitted` (for `cache_info()`).
  `use_symmem=True` compiles it with `symmem.jit` (symbolic (b, s)) instead of
  `jax.jit`; `memory_budget`, `max_len` (default the model's `cfg.max_len`) and
  `max_batch` are as in `llama.make_train_step`.
  """
  pure_step = pure_train_step(model, optimizer)
  jitted = llama.jit_step(pure_step, use_symmem=use_symmem, memory_budget=memory_budget,
                          max_len=model.cfg.max_len if max_len is None else max_len,
                          max_batch=max_batch)

  def step(model, optimizer, tokens, mask):
    state, loss = jitted(nnx.state((model, optimizer)), tokens, mask)
    nnx.update((model, optimizer), state)
    return loss

  step.jitted = jitted
  return step
