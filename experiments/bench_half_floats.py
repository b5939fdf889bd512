"""16-bit floats: the predicted XLA footprint (`Analysis.round_footprint`) against XLA's own.

On CPU, XLA computes bfloat16 / float16 ops in float32 and stores the values a step makes in
16 bits as float32 (`_src/xla_buffers.py`, `HALF_AS_FLOAT32`); a GPU runs them as they are.
This compiles rounds of Flax training steps written with bfloat16 compute, as the
budget compiles them, and prints XLA's `memory_analysis()` footprint beside the prediction
with the float32 rule and without it (16 bits, as a GPU stores them):

  mixed_scan / mixed_unrolled   float32 parameters, `dtype=jnp.bfloat16` Dense / LayerNorm /
                                Embed, layers under `nn.scan` or a Python loop
  bf16_scan / bf16_unrolled     the same with bfloat16 parameters (and optimizer state)
  idioms                        tests/test_idioms.py's step: `jax.nn.dot_product_attention`,
                                a `jax.custom_vjp` norm, `nn.remat` with a policy
  lora                          a scanned model with bfloat16 frozen weights passed apart
                                from float32 LoRA adapters, gradients for the adapters only

at b, s = 2, 64 and 4, 256, rounds first, middle and last.

  python -m experiments.bench_half_floats [--workloads=mixed_scan,...]

Writes experiments/results/bench_half_floats[_<platform>].json (cpu: no suffix).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _common
from experiments import bench_models
from experiments._common import MiB
import jax_symmem as symmem
from jax_symmem._src import xla_buffers

D, HEADS, VOCAB, LAYERS, LORA_RANK = 96, 4, 512, 3, 8
SHAPES = ((2, 64), (4, 256))
_TX = optax.adamw(1e-3)


class _Block(nn.Module):
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x, _):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    b, s, d = x.shape
    h = nn.LayerNorm(**kw)(x)
    q, k, v = (nn.Dense(D, **kw)(h).reshape(b, s, HEADS, -1) for _ in range(3))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, s, d)
    x = x + nn.Dense(D, **kw)(attn)
    h = jax.nn.gelu(nn.Dense(4 * D, **kw)(nn.LayerNorm(**kw)(x)))
    return x + nn.Dense(D, **kw)(h), None


class _LM(nn.Module):
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  scan: bool

  @nn.compact
  def __call__(self, tokens):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    x = nn.Embed(VOCAB, D, **kw)(tokens)
    if self.scan:
      x, _ = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=LAYERS)(**kw, name="layers")(x, None)
    else:
      for _ in range(LAYERS):
        x, _ = _Block(**kw)(x, None)
    return nn.Dense(VOCAB, **kw)(x)


def _masked_loss(logits, tokens, mask):
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           tokens[:, 1:])
  return jnp.sum(losses * mask[:, 1:]) / jnp.maximum(jnp.sum(mask[:, 1:]), 1.0)


def _batch(b, s):
  rng = np.random.RandomState(s)
  lengths = s - rng.randint(0, s // 4, (b, 1))
  return (jnp.asarray(rng.randint(0, VOCAB, (b, s)), jnp.int32),
          jnp.asarray(np.arange(s)[None] < lengths, jnp.float32))


def _flax_workload(param_dtype, scan):
  model = _LM(jnp.bfloat16, param_dtype, scan)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))

  def step(state, tokens, mask):
    params, opt_state = state
    loss, grads = jax.value_and_grad(
        lambda p: _masked_loss(model.apply(p, tokens[:, :-1]), tokens, mask))(params)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return loss, (optax.apply_updates(params, updates), opt_state)

  state = (params, _TX.init(params))
  return step, lambda b, s: (state, *_batch(b, s)), (None, "b, s", "b, s"), {}


def _idioms_workload():
  from tests import test_idioms
  state = test_idioms._state()
  return (test_idioms.train_step, lambda b, s: (state, *test_idioms._batch(b, s)),
          (None, *test_idioms.SHAPES), {"k": lambda b, s: s // 8})


def _lora_workload():
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  normal = lambda k, shape: jax.random.normal(k, shape) * 0.05
  base = {name: normal(k, shape).astype(jnp.bfloat16) for k, (name, shape) in zip(keys, (
      ("embed", (VOCAB, D)), ("qkv", (LAYERS, D, 3 * D)), ("out", (LAYERS, D, D)),
      ("up", (LAYERS, D, 4 * D)), ("down", (LAYERS, 4 * D, D))))}
  adapters = {"qkv_a": normal(keys[5], (LAYERS, D, LORA_RANK)),
              "qkv_b": jnp.zeros((LAYERS, LORA_RANK, 3 * D)),
              "up_a": normal(keys[6], (LAYERS, D, LORA_RANK)),
              "up_b": jnp.zeros((LAYERS, LORA_RANK, 4 * D))}

  def loss_fn(adapters, base, tokens, mask):
    def layer(x, w):
      qkv, out, up, down, qa, qb, ua, ub = w
      b, s, _ = x.shape
      h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
      fused = (h.astype(jnp.bfloat16) @ qkv).astype(jnp.float32) + (h @ qa) @ qb
      q, k, v = (t.reshape(b, s, HEADS, -1) for t in jnp.split(fused, 3, -1))
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
      scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
      attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, s, D)
      x = x + (attn.astype(jnp.bfloat16) @ out).astype(jnp.float32)
      h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
      g = jax.nn.gelu((h.astype(jnp.bfloat16) @ up).astype(jnp.float32) + (h @ ua) @ ub)
      return x + (g.astype(jnp.bfloat16) @ down).astype(jnp.float32), None
    x = base["embed"][tokens[:, :-1]].astype(jnp.float32)
    x, _ = jax.lax.scan(layer, x, (base["qkv"], base["out"], base["up"], base["down"],
                                   adapters["qkv_a"], adapters["qkv_b"], adapters["up_a"],
                                   adapters["up_b"]))
    return _masked_loss(x.astype(jnp.bfloat16) @ base["embed"].T, tokens, mask)

  def step(state, base, tokens, mask):
    adapters, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(adapters, base, tokens, mask)
    updates, opt_state = _TX.update(grads, opt_state, adapters)
    return loss, (optax.apply_updates(adapters, updates), opt_state)

  state = (adapters, _TX.init(adapters))
  return (step, lambda b, s: (state, base, *_batch(b, s)), (None, None, "b, s", "b, s"), {})


WORKLOADS = {
    "mixed_scan": lambda: _flax_workload(jnp.float32, True),
    "mixed_unrolled": lambda: _flax_workload(jnp.float32, False),
    "bf16_scan": lambda: _flax_workload(jnp.bfloat16, True),
    "bf16_unrolled": lambda: _flax_workload(jnp.bfloat16, False),
    "idioms": _idioms_workload,
    "lora": _lora_workload,
}


def _predicted(analysis, k, dims, float32: bool) -> int:
  """`round_footprint` with the float32 rule on or off (caches cleared around it)."""
  saved = xla_buffers.HALF_AS_FLOAT32
  xla_buffers.HALF_AS_FLOAT32 = float32
  try:
    analysis._round_footprints.clear()   # noqa: SLF001 (figures of the other setting)
    for r in analysis.rounds:
      r.graph._node_caches.clear()   # noqa: SLF001
    return analysis.round_footprint(k, dims)
  finally:
    xla_buffers.HALF_AS_FLOAT32 = saved
    analysis._round_footprints.clear()   # noqa: SLF001


def run(name: str) -> dict:
  step, args_at, shapes, derived = WORKLOADS[name]()
  constraints = ("s >= 16", "s <= 256", "b <= 8") + (("s == 8*k",) if "k" in derived else ())
  analysis = symmem.analyze(step, *args_at(*SHAPES[0]), polymorphic_shapes=shapes,
                            constraints=constraints)
  last = len(analysis.rounds) - 1
  rows = []
  for b, s in SHAPES:
    dims = {"b": b, "s": s, **{d: f(b, s) for d, f in derived.items()}}
    args = jax.tree_util.tree_leaves(args_at(b, s))
    for k in sorted({0, last // 2, last}):
      exe, _ = bench_models._compile_round(analysis, k, dims, args)   # as under a budget
      xla = _common.xla_memory(exe)["footprint"]
      row = {"dims": dims, "round": k, "xla_mib": xla / MiB,
             "float32_rule_mib": _predicted(analysis, k, dims, True) / MiB,
             "sixteen_bits_mib": _predicted(analysis, k, dims, False) / MiB}
      row["float32_rule_ok"] = _common.model_near_xla(row["float32_rule_mib"] * MiB, xla)
      row["sixteen_bits_ok"] = _common.model_near_xla(row["sixteen_bits_mib"] * MiB, xla)
      rows.append(row)
      print(f"{name} {dims} round {k}/{last}: XLA {row['xla_mib']:.1f} MiB, predicted with "
            f"float32 16-bit values {row['float32_rule_mib']:.1f} "
            f"({row['float32_rule_mib'] / row['xla_mib']:.3f}), with 16 bits "
            f"{row['sixteen_bits_mib']:.1f} ({row['sixteen_bits_mib'] / row['xla_mib']:.3f})",
            flush=True)
  return {"workload": name, "rounds": last, "rows": rows}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  platform = jax.devices()[0].platform
  out = args.out or ("experiments/results/bench_half_floats"
                     + ("" if platform == "cpu" else f"_{platform}") + ".json")
  results = _common.run_workloads(args.workloads, run, out, platform=platform,
                                  rule_on_this_platform=xla_buffers.stores_half_as_float32())
  for key in ("float32_rule", "sixteen_bits"):
    ratios = [r[f"{key}_mib"] / r["xla_mib"] for w in results for r in w["rows"]]
    ok = sum(r[f"{key}_ok"] for w in results for r in w["rows"])
    print(f"{key}: predicted / XLA {min(ratios):.2f}-{max(ratios):.2f}, within 10 % + 8 MiB "
          f"{ok} of {len(ratios)}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
