"""Training steps written with `jax.shard_map`; run by tests/test_shard_map.py.

Two ways people write them: the whole loss under one shard_map (data parallelism with
explicit collectives: each device's loss and token count summed with `psum`), and one
shard_map per layer (a layer with its own per-device code, as ring attention or an
expert-parallel MoE layer is written); each with its layers under `lax.scan`; and the
first with LayerDrop (a `lax.cond` per layer). `python -m tests.shard_map_steps` with
XLA_FLAGS=--xla_force_host_platform_device_count=4 runs the five on 4 host devices under symmem.jit and prints one JSON line each with what
the test asserts.
"""

import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax

import jax_symmem as symmem
from jax_symmem._src import device
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import variants

D = 32


def init(layers: int, seed: int = 0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * layers)
  return [{"w1": jax.random.normal(keys[2 * i], (D, 4 * D)) * 0.05,
           "w2": jax.random.normal(keys[2 * i + 1], (4 * D, D)) * 0.05}
          for i in range(layers)]


def layer(p, x):
  """An MLP and a single-head attention over the sequence, with a residual."""
  h = jax.nn.gelu(x @ p["w1"]) @ p["w2"]
  a = jax.nn.softmax(jnp.einsum("bsd,btd->bst", h, x) / np.sqrt(D), axis=-1)
  return x + jnp.einsum("bst,btd->bsd", a, x)


def _masked_mean(x, mask):
  return jnp.sum(jnp.where(mask[..., None], x ** 2, 0.0)), jnp.sum(mask)


def _step(loss):
  opt = optax.adamw(1e-3)
  def step(params, state, x, mask):
    value, grads = jax.value_and_grad(loss)(params, x, mask)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value
  return step, opt


def _data_parallel(mesh: Mesh, run_layers):
  """(step, optimizer): `run_layers(params, x)` and the loss inside one shard_map over
  "data", each device's loss sum and token count psummed."""
  def per_device(params, x, mask):
    total, count = _masked_mean(run_layers(params, x), mask)
    return jax.lax.psum(total, "data") / jax.lax.psum(count, "data")
  def loss(params, x, mask):
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=P())(params, x, mask)
  return _step(loss)


def data_parallel_step(mesh: Mesh, checkpoint: bool = False):
  """Every layer (under `jax.checkpoint` if `checkpoint`) and the loss in one shard_map."""
  body = jax.checkpoint(layer) if checkpoint else layer
  def run_layers(params, x):
    for p in params:
      x = body(p, x)
    return x
  return _data_parallel(mesh, run_layers)


def scanned_data_parallel_step(mesh: Mesh, checkpoint: bool = False):
  """`data_parallel_step` with the layers' weights stacked and run by `lax.scan` (the
  scanned layer under `jax.checkpoint` if `checkpoint`)."""
  body = jax.checkpoint(layer) if checkpoint else layer
  def run_layers(params, x):
    stacked = jax.tree_util.tree_map(lambda *w: jnp.stack(w), *params)
    return jax.lax.scan(lambda h, p: (body(p, h), None), x, stacked)[0]
  return _data_parallel(mesh, run_layers)


def layerdrop_data_parallel_step(mesh: Mesh, checkpoint: bool = False, rate: float = 0.3,
                                 seed: int = 0):
  """`data_parallel_step` with LayerDrop: each layer (under `jax.checkpoint` if
  `checkpoint`) runs or is skipped by `lax.cond` on a draw from the step's key (the same
  draw on every device)."""
  body = jax.checkpoint(layer) if checkpoint else layer
  def run_layers(params, x):
    keep = jax.random.bernoulli(jax.random.PRNGKey(seed), 1 - rate, (len(params),))
    for p, kept in zip(params, keep):
      x = jax.lax.cond(kept, body, lambda p, x: x, p, x)
    return x
  return _data_parallel(mesh, run_layers)


def one_shard_loss(params, x, mask):
  """`data_parallel_step`'s loss for one device's shard, without shard_map."""
  for p in params:
    x = layer(p, x)
  total, count = _masked_mean(x, mask)
  return total / count


def per_layer_step(mesh: Mesh, checkpoint: bool = False):
  """(step, optimizer): each layer its own shard_map over "data", the loss outside."""
  body = jax.checkpoint(layer) if checkpoint else layer
  def loss(params, x, mask):
    for i, p in enumerate(params):
      with jax.named_scope(f"layer_{i}"):
        x = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))(p, x)
    total, count = _masked_mean(x, mask)
    return total / count
  return _step(loss)


def scanned_per_layer_step(mesh: Mesh, checkpoint: bool = False):
  """`per_layer_step` with the layers' weights stacked and each layer's shard_map run by
  `lax.scan` (a scanned model whose layer has its own per-device code)."""
  body = jax.checkpoint(layer) if checkpoint else layer
  per_device = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
  def loss(params, x, mask):
    stacked = jax.tree_util.tree_map(lambda *w: jnp.stack(w), *params)
    x = jax.lax.scan(lambda h, p: (per_device(p, h), None), x, stacked)[0]
    total, count = _masked_mean(x, mask)
    return total / count
  return _step(loss)


STEPS = {"per_layer": per_layer_step, "scanned": scanned_data_parallel_step,
         "scanned_per_layer": scanned_per_layer_step, "layerdrop": layerdrop_data_parallel_step}


def batch(b: int, s: int, seed: int = 1):
  x = jax.random.normal(jax.random.PRNGKey(seed), (b, s, D)) * 0.5
  mask = jnp.arange(s)[None, :] < (s - jnp.arange(b)[:, None] % 3)   # some padding
  return x, mask


SHAPES = "4*k, s, _", "4*k, s"
CONSTRAINTS = ("k <= 8", "s <= 512")


def _xla_bytes(compiled) -> int:
  ma = compiled.memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
          - ma.alias_size_in_bytes)


def _close(a, b) -> bool:
  return all(np.allclose(x, y, rtol=1e-5, atol=1e-6)
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def run_data_parallel(mesh: Mesh) -> dict:
  """Unbudgeted calls at two shapes against jax.jit, and per device the prediction
  `symmem.jit` decides by and the model's arguments against XLA's figures."""
  step, opt = data_parallel_step(mesh)
  one_shard, _ = _step(one_shard_loss)
  params = init(2)
  state = opt.init(params)
  sym = symmem.jit(step, polymorphic_shapes=(None, None, *SHAPES), constraints=CONSTRAINTS)
  local = symmem.jit(one_shard, polymorphic_shapes=(None, None, "k, s, _", "k, s"),
                     constraints=CONSTRAINTS)
  out = {"step": "data_parallel", "shapes": []}
  for b, s in ((8, 64), (16, 256)):
    shard = batch(b // 4, s)
    one_xla = _xla_bytes(jax.jit(one_shard).lower(params, state, *shard).compile(
        compiler_options=jit_lib.CPU_COMPILER_OPTIONS))
    x, mask = batch(b, s)
    ref = jax.jit(step)(params, state, x, mask)
    got = sym(params, state, x, mask)
    analysis = sym.analyze(params, state, x, mask)
    dims = {"k": b // 4, "s": s}
    compiled = jax.jit(step).lower(params, state, x, mask).compile(
        compiler_options=jit_lib.CPU_COMPILER_OPTIONS)
    graph = analysis.graph
    out["shapes"].append({
        "b": b, "s": s, "equal": _close(got, ref), "round": sym.last_call["round"],
        "prediction": analysis.dispatch_figure(0, dims), "xla": _xla_bytes(compiled),
        "model_arguments": sum(graph.bytes(v).evaluate(graph.constraints.complete(dims))
                               for v in graph.traced.program.inputs),
        "xla_arguments": compiled.memory_analysis().argument_size_in_bytes,
        "one_shard_prediction": local.analyze(params, state, *shard).dispatch_figure(0, dims),
        "one_shard_xla": one_xla,
    })
  # At the longer shape: every round (the merged pair's body planned as a flat step)
  # against jax.jit, and XLA's figure for each and for jax.checkpoint on each layer.
  leaves = jax.tree_util.tree_leaves((params, state, x, mask))
  out["rounds"] = []
  for k in range(len(analysis.rounds)):
    exe = jax.jit(variants.round_function(analysis, k, dims)).lower(*leaves).compile(
        compiler_options=variants.round_options(analysis, k, "cpu"))
    out["rounds"].append({"round": k, "equal": _close(exe(*leaves), ref), "xla": _xla_bytes(exe),
                          "prediction": analysis.dispatch_figure(k, dims)})
  ckpt_step, _ = data_parallel_step(mesh, checkpoint=True)
  out["per_layer_checkpoint_xla"] = _xla_bytes(jax.jit(ckpt_step).lower(params, state, x, mask).compile(
      compiler_options=variants.round_options(analysis, len(analysis.rounds) - 1, "cpu")))
  out.update(_budgeted(step, params, state, x, mask, analysis, dims,
                       device.live_bytes() + out["per_layer_checkpoint_xla"]))
  return out


def _budgeted(step, params, state, x, mask, analysis, dims, budget) -> dict:
  """A call under `budget`: what it dispatched, and its results against the round it ran
  compiled on its own."""
  sym = symmem.jit(step, polymorphic_shapes=(None, None, *SHAPES), constraints=CONSTRAINTS,
                   memory_budget=budget)
  got = sym(params, state, x, mask)
  call = dict(sym.last_call)
  leaves = jax.tree_util.tree_leaves((params, state, x, mask))
  chosen = jax.jit(variants.round_function(analysis, call["round"], dims)).lower(
      *leaves).compile(compiler_options=variants.round_options(analysis, call["round"], "cpu"))
  return {"budget": budget, "call": {k: call[k] for k in ("round", "xla_bytes", "reserved")},
          "budgeted_equal": _close(got, chosen(*leaves))}


def run_rounds(mesh: Mesh, which: str) -> dict:
  """For a step of `STEPS`: every round at the longest shape against jax.jit, XLA's
  figure for each and for the step with `jax.checkpoint` on each layer, and a budgeted
  call between the two."""
  make_step = STEPS[which]
  step, opt = make_step(mesh)
  params = init(3)
  state = opt.init(params)
  b, s = 16, 256
  x, mask = batch(b, s)
  leaves = jax.tree_util.tree_leaves((params, state, x, mask))
  dims = {"k": b // 4, "s": s}
  ref = jax.jit(step)(params, state, x, mask)
  analysis = symmem.analyze(step, params, state, x, mask,
                            polymorphic_shapes=(None, None, *SHAPES), constraints=CONSTRAINTS)
  rounds = []
  for k in range(len(analysis.rounds)):
    exe = jax.jit(variants.round_function(analysis, k, dims)).lower(*leaves).compile(
        compiler_options=variants.round_options(analysis, k, "cpu"))
    rounds.append({"round": k, "equal": _close(exe(*leaves), ref), "xla": _xla_bytes(exe),
                   "prediction": analysis.dispatch_figure(k, dims)})
  ckpt_step, _ = make_step(mesh, checkpoint=True)
  per_layer = _xla_bytes(jax.jit(ckpt_step).lower(params, state, x, mask).compile(
      compiler_options=variants.round_options(analysis, len(analysis.rounds) - 1, "cpu")))
  # What other live arrays hold counts against a budget: room for 1.1 x per-layer
  # checkpointing beside them (the arguments are counted in both: a little slack).
  del exe
  return {"step": which, "rounds": rounds, "per_layer_checkpoint_xla": per_layer,
          **_budgeted(step, params, state, x, mask, analysis, dims,
                      device.live_bytes() + int(1.1 * per_layer))}


def run_symbolic_batch(mesh: Mesh) -> dict:
  """The data-parallel step traced with "b, s" (not "4*k, s"): shard_map cannot split b
  over the devices, and the message says what to declare."""
  step, opt = data_parallel_step(mesh)
  params = init(2)
  try:
    symmem.trace(step, params, opt.init(params), *batch(8, 16), polymorphic_shapes=(
        None, None, "b, s, _", "b, s"), constraints=("b <= 32", "s <= 512"))
  except symmem.TracingError as e:
    return {"step": "symbolic_batch", "message": str(e)}
  return {"step": "symbolic_batch", "message": None}


def run_live_bytes(mesh: Mesh) -> dict:
  """`device.live_bytes()` before and after views of sharded arrays' shards: what
  `jax.device_get`, `np.asarray` and printing leave (live arrays over the same buffers)."""
  x = jax.device_put(jnp.ones((512, 512)), jax.sharding.NamedSharding(mesh, P("data")))
  y = jax.device_put(jnp.ones((512, 512)), jax.sharding.NamedSharding(mesh, P()))
  before = device.live_bytes()
  jax.device_get(x), np.asarray(y), str(x), np.array(x, copy=True)
  return {"step": "live_bytes", "before": before, "after": device.live_bytes(),
          "live_arrays": len(jax.live_arrays())}


if __name__ == "__main__":
  assert jax.device_count() == 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"
  mesh = Mesh(np.array(jax.devices()), ("data",))
  runs = {"data_parallel": run_data_parallel, "live_bytes": run_live_bytes,
          "symbolic_batch": run_symbolic_batch}
  for which in sys.argv[1:] or ("data_parallel", *STEPS, "live_bytes", "symbolic_batch"):
    result = runs[which](mesh) if which in runs else run_rounds(mesh, which)
    print(json.dumps(result), flush=True)
