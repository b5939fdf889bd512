"""Sharded Llama steps under symmem.jit on 8 host devices; run by tests/test_sharding.py.

Data parallel and 2-way data x 4-way tensor parallel, each with the layers unrolled and
under `nn.scan`. Runs in its own process because the device count is fixed when JAX starts:
`python -m tests.sharded_llama` with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Prints one JSON line per
layout with what the test asserts.
"""

import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

import jax_symmem as symmem
from jax_symmem._src import jit as jit_lib
from jax_symmem.examples import llama


def _tensor_parallel_spec(path, leaf) -> P:
  """Megatron-style: q/k/v/gate/up split on their output dim, o/down on their input dim
  (`nn.scan`'s stacked kernels: the same under their whole leading layer dim)."""
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  stacked = int("layers" in names)
  if "kernel" not in names or leaf.ndim - stacked < 2:
    return P()
  if any(n in ("q", "k", "v") for n in names):
    spec = (None, "model", None)
  elif "o" in names:
    spec = ("model", None, None)
  elif any(n in ("gate", "up") for n in names):
    spec = (None, "model")
  elif "down" in names:
    spec = ("model", None)
  else:
    return P()
  return P(*(None,) * stacked, *spec)


def run(layout: str) -> dict:
  """`layout`: "data" or "tensor", with "_scan" for the layers under `nn.scan`."""
  cfg = llama.PRESETS["tiny"]
  devices = np.array(jax.devices())
  layout, scan = layout.removesuffix("_scan"), layout.endswith("_scan")
  if layout == "data":
    mesh = Mesh(devices.reshape(8), ("data",))
    batch_spec = P("data", None)
  else:   # 2-way data x 4-way tensor parallel
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
    batch_spec = P("data", None)
  state = llama.init_state(cfg, scan_layers=scan)
  if layout == "data":
    state_sharding = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
  else:
    state_sharding = jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, _tensor_parallel_spec(p, x)), state)
  batch_sharding = NamedSharding(mesh, batch_spec)
  shardings = dict(in_shardings=(state_sharding, batch_sharding, batch_sharding),
                   out_shardings=(state_sharding, NamedSharding(mesh, P())))
  step = llama.train_step_fn(llama.Llama(cfg, scan_layers=scan), learning_rate=1e-3)
  ref = jax.jit(step, **shardings)
  sym = symmem.jit(step, polymorphic_shapes=(None, "b, s", "b, s"),
                   constraints=("s >= 2", "s <= 64", "b <= 16"), **shardings)
  unsharded = symmem.analyze(step, state, *llama.example_batch(cfg, 8, 16),
                             polymorphic_shapes=(None, "b, s", "b, s"),
                             constraints=("s >= 2", "s <= 64", "b <= 16"))
  state = jax.device_put(state, state_sharding)
  out = {"layout": layout + "_scan" * scan, "shapes": [], "max_rel_err": 0.0}
  s_ref = s_sym = state
  for b, s in ((8, 16), (16, 48)):
    tokens, mask = llama.example_batch(cfg, b, s, seed=b + s)
    tokens, mask = jax.device_put((tokens, mask), batch_sharding)
    s_ref, loss_ref = ref(s_ref, tokens, mask)
    s_sym, loss_sym = sym(s_sym, tokens, mask)
    errs = [float(jnp.max(jnp.abs(a - r) / (1e-6 + 1e-5 * jnp.abs(r))))
            for a, r in zip(jax.tree_util.tree_leaves((s_sym, loss_sym)),
                            jax.tree_util.tree_leaves((s_ref, loss_ref)))]
    out["max_rel_err"] = max(out["max_rel_err"], max(errs))   # <= 1: within 1e-6 + 1e-5|ref|
    # Per-device: the model's peak (trace order, no remat) vs XLA's memory_analysis of
    # the same step compiled for these shardings with every buffer visible (F2).
    analysis = sym.analyze(s_sym, tokens, mask)
    compiled = ref.lower(s_sym, tokens, mask).compile(
        compiler_options=jit_lib.CPU_COMPILER_OPTIONS)
    ma = compiled.memory_analysis()
    xla = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
           - ma.alias_size_in_bytes)
    out["shapes"].append({
        "b": b, "s": s, "loss": float(loss_sym), "loss_ref": float(loss_ref),
        "model_per_device": analysis.baseline_peak_bytes(b=b, s=s),
        "model_scheduled_per_device": analysis.peak_bytes(b=b, s=s),
        "xla_per_device": xla,
        "model_unsharded": unsharded.baseline_peak_bytes(b=b, s=s),
        "out_sharding_ok": all(x.sharding.is_equivalent_to(w.sharding, x.ndim) for x, w in zip(
            jax.tree_util.tree_leaves(s_sym), jax.tree_util.tree_leaves(s_ref))),
    })
  out["cache_info"] = sym.cache_info()
  return out


if __name__ == "__main__":
  assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
  for layout in sys.argv[1:] or ("data", "tensor", "data_scan", "tensor_scan"):
    print(json.dumps(run(layout)), flush=True)
