"""Small programs with symbolic dims shared by the memory, executor and schedule tests."""

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_symmem._src import executor
from jax_symmem._src import memory
from jax_symmem._src import tracing
from jax_symmem.examples import transformer


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  fun: Callable
  make_args: Callable[..., tuple]      # (**dims) -> concrete args
  polymorphic_shapes: Any
  constraints: tuple[str, ...]
  shapes: tuple[dict, ...]            # >= 5 concrete dims each


def _rand(*shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randn(*shape).astype(np.float32))


def _mlp(x, w1, w2, w3):
  h = jnp.tanh(x @ w1)
  h = jax.nn.gelu(h @ w2)
  return jnp.sum((h @ w3) ** 2)


def _attention(x, wq, wk, wv):
  q, k, v = x @ wq, x @ wk, x @ wv
  s = x.shape[1]
  scores = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
  return jnp.mean(jax.nn.softmax(scores, axis=-1) @ v)


def _scan(xs, w):
  def body(c, x):
    h = jnp.tanh(x @ w + c)
    return h, jnp.sum(h * h, axis=-1)
  c, ys = jax.lax.scan(body, jnp.zeros((xs.shape[1], w.shape[1])), xs)
  return jnp.sum(c) + jnp.sum(ys)


def _cond(x, w):
  big = lambda x: jnp.sum(jnp.tanh(x @ w) @ w.T)
  small = lambda x: jnp.sum(x) * 2.0
  return jax.lax.cond(jnp.sum(x) > 0, big, small, x)


_TCFG = transformer.Config(vocab=61, d_model=16, n_heads=2, d_ff=40, n_layers=2)


def _transformer_args(b, s):
  return transformer.example_args(_TCFG, b, s)


def transformer_args(cfg, b, s, seed=0):
  """(params, tokens, mask) as transformer.example_args(cfg, b, s) makes them (the same
  tree, shapes, dtypes and scales: unit norms, N(0, 1/fan_in) weights, every position
  real), drawn with NumPy and put on the device as they are: jax.random compiles its
  normal per parameter shape and its randint per batch shape (~0.5 s each on XLA:CPU),
  which tests that only need some values paid at every new shape."""
  rng = np.random.RandomState(seed)
  def fill(x):
    if len(x.shape) == 1:
      return jnp.asarray(np.ones(x.shape, x.dtype))
    return jnp.asarray((rng.randn(*x.shape) / np.sqrt(x.shape[0])).astype(x.dtype))
  params = jax.tree_util.tree_map(fill, _param_shapes(cfg))
  tokens = jnp.asarray(rng.randint(0, cfg.vocab, (b, s)).astype(np.int32))
  return params, tokens, jnp.asarray(np.ones((b, s), np.float32))


@functools.lru_cache(maxsize=None)
def _param_shapes(cfg):
  return jax.eval_shape(lambda: transformer.init_params(jax.random.PRNGKey(0), cfg))


D = 24
CASES = (
    Case("mlp_grad", jax.grad(_mlp, argnums=(1, 2, 3)),
         lambda b: (_rand(b, D), _rand(D, 4 * D, seed=1), _rand(4 * D, D, seed=2), _rand(D, D, seed=3)),
         ("b, _", None, None, None), ("b <= 512",),
         ({"b": 1}, {"b": 3}, {"b": 16}, {"b": 100}, {"b": 512})),
    Case("attention_grad", jax.grad(_attention, argnums=(0, 1)),
         lambda b, s: (_rand(b, s, 8), _rand(8, 8, seed=1), _rand(8, 8, seed=2), _rand(8, 8, seed=3)),
         ("b, s, _", None, None, None), ("b <= 8", "s <= 128"),
         ({"b": 1, "s": 1}, {"b": 2, "s": 5}, {"b": 3, "s": 17}, {"b": 8, "s": 64},
          {"b": 5, "s": 128})),
    Case("transformer_step", transformer.make_train_step(_TCFG), _transformer_args,
         (None, "b, s", "b, s"), ("s >= 2", "b <= 8", "s <= 64"),
         ({"b": 1, "s": 2}, {"b": 2, "s": 7}, {"b": 3, "s": 16}, {"b": 8, "s": 9},
          {"b": 4, "s": 64})),
    Case("scan", jax.value_and_grad(_scan, argnums=1),
         lambda t, b: (_rand(t, b, D), _rand(D, D, seed=1)),
         ("t, b, _", None), ("t <= 64", "b <= 64"),
         ({"t": 1, "b": 1}, {"t": 3, "b": 2}, {"t": 10, "b": 7}, {"t": 64, "b": 3},
          {"t": 5, "b": 64})),
    Case("cond", jax.grad(_cond, argnums=1),
         lambda b: (jnp.abs(_rand(b, D)), _rand(D, 2 * D, seed=1)),
         ("b, _", None), ("b <= 256",),
         ({"b": 1}, {"b": 2}, {"b": 9}, {"b": 77}, {"b": 256})),
)


def assert_rounds_model_the_executor(analysis, dims, args, rounds=None):
  """Rounds `rounds` of `analysis` (default: the first and the last) at `dims`, run on
  `args` by the reference executor with loop bodies op by op: the model's live bytes equal
  the executor's tracked bytes at every step."""
  env = analysis.graph.constraints.complete(dims)
  flat = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(args)]
  for k in (0, len(analysis.rounds) - 1) if rounds is None else rounds:
    r = analysis.rounds[k]
    order = analysis.round_order(k, dims)
    program = tracing.specialize_program(r.program, env)
    _, live, _ = executor.run_tracked(program, flat, order, loops_op_by_op=True)
    assert memory.profile(r.graph, r.program, order).live_bytes(**dims) == live, (k, dims)
