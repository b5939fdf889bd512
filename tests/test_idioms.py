"""Training-step idioms of current JAX code that the example models do not use.

One Flax step combines them: float32 master weights with bfloat16 compute,
`jax.nn.dot_product_attention`, a norm with its own `jax.custom_vjp`, layers under
`nn.scan` and `nn.remat` with a saving policy, `optax.chain(clip_by_global_norm, adamw)`.
The same step also runs with MaxText's kind of policy: values tagged with
`checkpoint_name` and saved by name (`save_only_these_names`) or offloaded to host memory
(`save_and_offload_only_these_names`), and with gradients
accumulated by `optax.MultiSteps` (the update under a `lax.cond` on the step count).
bfloat16 makes rounding differences large (round 0 under a budget against plain jax.jit,
whose XNNPACK fusions differ: AdamW's first moments about 1-2 % of their leaf's largest
apart on this probe's wider sibling), so the references are jax.jit compiled with the
very XLA options each variant ran with, and the comparison is exact.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_symmem as symmem
from tests import budgets

D, HEADS, FF, VOCAB, LAYERS = 64, 2, 160, 256, 2
SHAPES = ("b, s", "b, s")
CONSTRAINTS = ("s >= 8", "s <= 128", "b <= 4", "s == 8*k")


@jax.custom_vjp
def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _rms_norm_fwd(x, scale):
  r = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
  return x * r * scale, (x, r, scale)


def _rms_norm_bwd(res, g):
  x, r, scale = res
  normed = x * r
  g_scale = jnp.sum(g * normed, axis=tuple(range(g.ndim - 1)))
  gn = g * scale
  return r * (gn - normed * jnp.mean(gn * normed, -1, keepdims=True)), g_scale


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = rms_norm(x, self.param("attn_norm", nn.initializers.ones, (D,))).astype(jnp.bfloat16)
    qkv = checkpoint_name(nn.DenseGeneral((3, HEADS, D // HEADS), dtype=jnp.bfloat16)(h), "qkv")
    attn = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    attn = checkpoint_name(attn, "attention")
    x = x + nn.DenseGeneral(D, axis=(-2, -1), dtype=jnp.bfloat16)(attn).astype(jnp.float32)
    h = nn.RMSNorm(dtype=jnp.bfloat16)(x)
    h = jax.nn.gelu(nn.Dense(FF, dtype=jnp.bfloat16)(h))
    return x + nn.Dense(D, dtype=jnp.bfloat16)(h).astype(jnp.float32), None


# What each layer's nn.remat saves: dots without batch dims (the weights' products), or
# MaxText's way, values tagged by name (`checkpoint_name` in `Block`).
DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
NAMED = jax.checkpoint_policies.save_only_these_names("qkv", "attention")


class LM(nn.Module):
  policy: object = DOTS

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    layer = nn.remat(Block, policy=self.policy, prevent_cse=False)
    x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=LAYERS)(name="layers")(x, None)
    return nn.Dense(VOCAB)(nn.RMSNorm()(x))


_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def train_step(state, tokens, mask, policy=DOTS, tx=_TX):
  params, opt_state = state

  def loss_fn(p):
    logits = LM(policy).apply(p, tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(losses * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return loss, (optax.apply_updates(params, updates), opt_state)


# jitted: op by op, initializing took 3 s of this module's fast test
@functools.partial(jax.jit, static_argnames="tx")
def _init(key, tx=_TX):
  params = LM().init(key, jnp.zeros((1, 8), jnp.int32))
  return params, tx.init(params)


def _state():
  return _init(jax.random.PRNGKey(0))


def _batch(b, s):
  rng = np.random.RandomState(s)
  lengths = s - rng.randint(0, s // 4, (b, 1))
  return (jnp.asarray(rng.randint(0, VOCAB, (b, s)), jnp.int32),
          jnp.asarray(np.arange(s)[None] < lengths, jnp.float32))


# Slow: test_xla_buffers' bfloat16 Flax step covers mixed precision in the fast tier.
@pytest.mark.slow
def test_mixed_precision_step_without_a_budget_is_jax_jit():
  state = _state()
  step = symmem.jit(train_step, polymorphic_shapes=(None, *SHAPES), constraints=CONSTRAINTS)
  args = (state, *_batch(4, 64))
  chex.assert_trees_all_equal(step(*args), jax.jit(train_step)(*args))
  # Without a budget the step runs as written, with the user's nn.remat.
  assert step.analyze(*args).rounds[step.last_call["round"]].as_written


def _under_a_tight_budget(fn, longest_args, constraints, dims):
  """(the analysis, the budget, symmem.jit of `fn` under `budgets.tight_budget` at the
  longest batch's `dims`)."""
  analysis = symmem.analyze(fn, *longest_args, polymorphic_shapes=(None, *SHAPES),
                            constraints=constraints)
  budget = budgets.tight_budget(analysis, dims, longest_args)
  return analysis, budget, symmem.jit(fn, polymorphic_shapes=(None, *SHAPES),
                                      constraints=constraints, memory_budget=budget)


@pytest.mark.slow
def test_mixed_precision_step_under_a_budget_matches_jax_jit_with_its_options():
  state = _state()
  analysis, budget, step = _under_a_tight_budget(
      train_step, (state, *_batch(4, 128)), CONSTRAINTS, {"b": 4, "s": 128, "k": 16})
  rounds = budgets.rounds_run_within(step, budget, train_step,
                              [(state, *_batch(b, s)) for b, s in ((2, 16), (4, 128))],
                              chex.assert_trees_all_equal)
  assert rounds[0] == 0 != analysis.as_written_round   # the short batch skips the user's
  assert rounds[1] > 0                                 # recomputation, the long one evicts


# MaxText's offloading policy: "qkv" saved, "attention" copied to host memory (on XLA:CPU
# the host is the same memory, and XLA counts it as before).
OFFLOADED = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=["qkv"], names_which_can_be_offloaded=["attention"],
    offload_src="device", offload_dst="pinned_host")


def _named_step(state, tokens, mask):
  return train_step(state, tokens, mask, policy=NAMED)


def _offloading_step(state, tokens, mask):
  return train_step(state, tokens, mask, policy=OFFLOADED)


@pytest.mark.slow
@pytest.mark.parametrize("fn", [_named_step, _offloading_step], ids=["saved", "offloaded"])
def test_layers_saving_named_values_run_as_written_or_under_a_budget_like_jax_jit(fn):
  state = _state()
  plain = symmem.jit(fn, polymorphic_shapes=(None, *SHAPES), constraints=CONSTRAINTS)
  args = (state, *_batch(4, 64))
  chex.assert_trees_all_equal(plain(*args), jax.jit(fn)(*args))
  assert plain.last_call["round"] == plain.analyze(*args).as_written_round > 0
  analysis, budget, step = _under_a_tight_budget(
      fn, (state, *_batch(4, 128)), CONSTRAINTS, {"b": 4, "s": 128, "k": 16})
  rounds = budgets.rounds_run_within(step, budget, fn,
                              [(state, *_batch(b, s)) for b, s in ((2, 16), (4, 128))],
                              chex.assert_trees_all_equal)
  assert rounds[0] == 0 != analysis.as_written_round   # the user's recomputation skipped
  assert rounds[1] > 0


# optax.MultiSteps: the gradient added into an accumulator every step, the inner update applied
# (and the accumulator reset) every second one, under a lax.cond.
_EVERY_SECOND = optax.MultiSteps(_TX, every_k_schedule=2)


def _accumulating_step(state, tokens, mask):
  return train_step(state, tokens, mask, tx=_EVERY_SECOND)


@pytest.mark.slow
def test_multisteps_accumulation_runs_under_a_budget_like_jax_jit():
  state = _init(jax.random.PRNGKey(0), tx=_EVERY_SECOND)
  analysis, budget, step = _under_a_tight_budget(
      _accumulating_step, (state, *_batch(4, 128)), CONSTRAINTS, {"b": 4, "s": 128, "k": 16})
  rounds = []
  for b, s in ((2, 16), (4, 128)):   # the first call accumulates, the second updates
    args = (state, *_batch(b, s))
    loss, state = step(*args)
    assert step.last_call["xla_bytes"] + step.last_call["reserved"] <= budget
    chex.assert_trees_all_equal((loss, state),
                                budgets.same_options_reference(step, _accumulating_step, args))
    rounds.append(step.last_call["round"])
    del args, loss   # the state before the call counts against the next call's budget
  assert int(state[1].gradient_step) == 1   # the inner AdamW stepped once, at the second call
  assert rounds[0] == 0 != analysis.as_written_round and rounds[1] > 0


# --- Memory-efficient attention inside scanned layers -------------------------------------------
# Attention as a scan over key chunks with an online softmax and its body under
# jax.checkpoint (Rabe & Staats), in layers scanned over stacked weights: a forward/backward
# scan pair whose bodies hold another, with a trip count that is a dim (s // CHUNK).

CHUNK = 16


def _chunked_attention(q, k, v):
  b, s, h, d = q.shape
  chunks = lambda x: x.reshape(b, s // CHUNK, CHUNK, h, d).swapaxes(0, 1)

  def body(carry, inp):
    top, total, acc = carry
    kb, vb, j = inp
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, kb) / np.sqrt(d)
    causal = jnp.arange(s)[:, None] >= j * CHUNK + jnp.arange(CHUNK)[None, :]
    scores = jnp.where(causal, scores, -1e30)
    new_top = jnp.maximum(top, scores.max(-1))
    p = jnp.exp(scores - new_top[..., None])
    scale = jnp.exp(top - new_top)
    return (new_top, total * scale + p.sum(-1),
            acc * scale[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, vb)), None

  init = (jnp.full((b, h, s), -1e30), jnp.zeros((b, h, s)), jnp.zeros((b, h, s, d)))
  (_, total, acc), _ = jax.lax.scan(jax.checkpoint(body), init,
                                    (chunks(k), chunks(v), jnp.arange(s // CHUNK)))
  return (acc / total[..., None]).transpose(0, 2, 1, 3)


def _chunked_step(state, tokens, mask):
  params, opt_state = state

  def layer(x, w):
    wqkv, wo, w1, w2 = w
    b, s, _ = x.shape
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    q, k, v = (t.reshape(b, s, HEADS, D // HEADS) for t in jnp.split(h @ wqkv, 3, -1))
    x = x + _chunked_attention(q, k, v).reshape(b, s, D) @ wo
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jax.nn.gelu(h @ w1) @ w2, None

  def loss_fn(p):
    x, _ = jax.lax.scan(layer, p["embed"][tokens[:, :-1]], p["layers"])
    losses = optax.softmax_cross_entropy_with_integer_labels(x @ p["embed"].T, tokens[:, 1:])
    return jnp.sum(losses * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = _TX.update(grads, opt_state, params)
  return loss, (optax.apply_updates(params, updates), opt_state)


def _chunked_state():
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  shapes = ((D, 3 * D), (D, D), (D, FF), (FF, D))
  params = {"embed": jax.random.normal(keys[0], (VOCAB, D)) * 0.05,
            "layers": tuple(jax.random.normal(k, (LAYERS, *s)) * 0.05
                            for k, s in zip(keys[1:], shapes))}
  return params, _TX.init(params)


@pytest.mark.slow
def test_chunked_attention_in_scanned_layers_runs_under_a_budget_like_jax_jit():
  state = _chunked_state()
  _, budget, step = _under_a_tight_budget(
      _chunked_step, (state, *_batch(4, 129)),
      ("s >= 17", "s <= 129", "b <= 4", "s == 16*k + 1"), {"b": 4, "s": 129, "k": 8})
  close = lambda a, b: chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
  rounds = budgets.rounds_run_within(step, budget, _chunked_step,
                              [(state, *_batch(b, s)) for b, s in ((2, 33), (4, 129))], close)
  assert rounds[1] != 0   # the long batch recomputes
