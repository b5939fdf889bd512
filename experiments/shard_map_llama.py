"""Our Llama, data parallel with `jax.shard_map`, under symmem.jit on 4 host devices.

The step as a user writes data parallelism with explicit collectives: the model and the
masked next-token loss under one `jax.shard_map` over "data" (the batch split 4 ways,
weights replicated), each device's loss sum and token count `psum`med. For each length:
`symmem.jit` without a budget against `jax.jit`; XLA's figure (`memory_analysis()`, per
device) for the step as traced, for each round `symmem.jit` may run, and for the same step
with `nn.remat` on each layer (per-layer checkpointing, compiled with the options of the
planner's last round); and a budgeted call at 1.25 x per-layer checkpointing's figure at
the longest length: the round it ran, XLA's figure, and its results against `jax.jit`
compiled with the round's options.

  python -m experiments.shard_map_llama [--preset small] [--lengths 128,256,512] [--b 8]
                                        [--scan]

--scan runs the layers with `nn.scan` over stacked weights (inside the shard_map, the
forward and backward scans AD makes are a pair `symmem.jit` plans in the shard_map's
body). Sets --xla_force_host_platform_device_count=4 itself (before JAX starts). Writes
experiments/results/shard_map_llama[_scan].json (or --out).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import time  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402
import jax_symmem as symmem  # noqa: E402
from jax_symmem._src import device  # noqa: E402
from jax_symmem._src import variants  # noqa: E402
from jax_symmem.examples import llama  # noqa: E402

PRESET = flags.DEFINE_string("preset", "small", "llama.PRESETS entry")
LENGTHS = flags.DEFINE_string("lengths", "128,256,512", "sequence lengths, comma-separated")
BATCH = flags.DEFINE_integer("b", 8, "global batch (split 4 ways)")
SCAN = flags.DEFINE_bool("scan", False, "layers under nn.scan (stacked weights)")
OUT = flags.DEFINE_string("out", None, "JSON output (default experiments/results/"
                          "shard_map_llama[_scan].json)")

SHAPES = (None, "4*k, s", "4*k, s")


def data_parallel_step(cfg, mesh: Mesh, remat_policy=None, scan_layers: bool = False):
  """`llama.adamw_train_step` of the masked next-token loss, averaged over every device's
  counted tokens, with the model and loss under one shard_map."""
  model = llama.Llama(cfg, scan_layers=scan_layers, remat_policy=remat_policy)
  def per_device(params, tokens, mask):
    logits = model.apply({"params": params}, tokens)
    weights = (mask[:, :-1] * mask[:, 1:]).astype(jnp.float32)
    local = llama.masked_cross_entropy(logits[:, :-1], tokens[:, 1:], weights)
    count = jnp.sum(weights)
    total = jax.lax.psum(local * count, "data")
    return total / jnp.maximum(jax.lax.psum(count, "data"), 1.0)
  def loss_fn(params, tokens, mask):
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                         out_specs=P())(params, tokens, mask)
  return llama.adamw_train_step(loss_fn)


def _xla(compiled) -> int:
  ma = compiled.memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
          - ma.alias_size_in_bytes)


def main(argv):
  del argv
  assert jax.device_count() == 4, jax.devices()
  cfg = llama.PRESETS[PRESET.value]
  mesh = Mesh(np.array(jax.devices()), ("data",))
  step = data_parallel_step(cfg, mesh, scan_layers=SCAN.value)
  per_layer = data_parallel_step(cfg, mesh, remat_policy="layer", scan_layers=SCAN.value)
  state = llama.init_state(cfg, scan_layers=SCAN.value)
  lengths = [int(x) for x in LENGTHS.value.split(",")]
  constraints = (f"k <= {BATCH.value // 4}", f"s <= {max(lengths)}", "s >= 2")
  t0 = time.perf_counter()
  analysis = symmem.analyze(step, state, *llama.example_batch(cfg, BATCH.value, lengths[0]),
                            polymorphic_shapes=SHAPES, constraints=constraints)
  plan_s = time.perf_counter() - t0
  sym = symmem.jit(step, polymorphic_shapes=SHAPES, constraints=constraints)
  rows = []
  print(f"{PRESET.value} Llama{' (nn.scan)' if SCAN.value else ''}, b={BATCH.value} over 4 devices: planned in {plan_s:.1f} s, "
        f"{len(analysis.rounds)} rounds; "
        f"{[n.name for n in analysis.traced.program.nodes].count('shard_map')} shard_map(s)")
  for s in lengths:
    batch = llama.example_batch(cfg, BATCH.value, s, seed=s)
    leaves = jax.tree_util.tree_leaves((state, *batch))
    dims = {"k": BATCH.value // 4, "s": s}
    ref = jax.jit(step)(state, *batch)
    row = {"s": s, "unbudgeted_equal": _common.trees_close(sym(state, *batch), ref),
           "as_traced_xla": _xla(jax.jit(step).lower(state, *batch).compile(
               compiler_options=variants.round_options(analysis, 0, "cpu"))),
           "per_layer_xla": _xla(jax.jit(per_layer).lower(state, *batch).compile(
               compiler_options=variants.round_options(analysis, len(analysis.rounds) - 1,
                                                       "cpu"))),
           "rounds": []}
    # Each round against jax.jit compiled with the round's XLA options (the memory-saving
    # ones change reduction order, which AdamW amplifies on near-zero gradients).
    refs: dict = {}
    for k in range(len(analysis.rounds)):
      options = variants.round_options(analysis, k, "cpu")
      key = tuple(sorted(options.items()))
      if key not in refs:
        refs[key] = jax.jit(step).lower(state, *batch).compile(
            compiler_options=options)(state, *batch)
      exe = jax.jit(variants.round_function(analysis, k, dims)).lower(*leaves).compile(
          compiler_options=options)
      out = exe(*leaves)
      row["rounds"].append({"round": k, "xla": _xla(exe),
                            "prediction": analysis.dispatch_figure(k, dims),
                            "equal": _common.trees_close(out, refs[key]),
                            "deviation_vs_jit": _common.deviation(out, refs[key])})
      del exe, out
    del refs
    least = min(r["xla"] for r in row["rounds"])
    print(f"  s={s}: XLA MiB as traced {row['as_traced_xla'] / MiB:.1f}, round 0 "
          f"{row['rounds'][0]['xla'] / MiB:.1f}, least round {least / MiB:.1f}, per-layer "
          f"checkpointing {row['per_layer_xla'] / MiB:.1f} (reach {least / row['per_layer_xla']:.2f}); "
          f"unbudgeted equal {row['unbudgeted_equal']}, every round equal "
          f"{all(r['equal'] for r in row['rounds'])}, prediction / XLA "
          f"{min(r['prediction'] / r['xla'] for r in row['rounds']):.3f}.."
          f"{max(r['prediction'] / r['xla'] for r in row['rounds']):.3f}")
    rows.append(row)
    del ref
  # A budget at 1.25 x per-layer checkpointing's figure at the longest length, beside
  # what is live now.
  budget = device.live_bytes() + int(1.25 * rows[-1]["per_layer_xla"])
  budgeted = symmem.jit(step, polymorphic_shapes=SHAPES, constraints=constraints,
                        memory_budget=budget)
  calls = []
  for s in lengths:
    batch = llama.example_batch(cfg, BATCH.value, s, seed=s)
    out = budgeted(state, *batch)
    call = dict(budgeted.last_call)
    (variant,) = [v for v in budgeted.variants() if v["dims"] == {"k": BATCH.value // 4, "s": s}
                  and v["round"] == call["round"]]
    expected = jax.jit(step).lower(state, *batch).compile(
        compiler_options=variant["compiler_options"])(state, *batch)
    calls.append({"s": s, "round": call["round"], "xla_bytes": call["xla_bytes"],
                  "reserved": call["reserved"], "within": call["xla_bytes"] + call["reserved"]
                  <= budget, "deviation_vs_jit": _common.deviation(out, expected),
                  "compiles": budgeted.cache_info()["compiles"]})
    print(f"  under {budget / MiB:.1f} MiB, s={s}: round {call['round']}, XLA "
          f"{call['xla_bytes'] / MiB:.1f} MiB + {call['reserved'] / MiB:.1f} held, within "
          f"{calls[-1]['within']}, vs jax.jit with its options {calls[-1]['deviation_vs_jit']}")
    del out, expected
  out = OUT.value or (f"experiments/results/shard_map_llama{'_scan' if SCAN.value else ''}"
                      ".json")
  _common.write_results(out, {"preset": PRESET.value, "scan": SCAN.value, "batch": BATCH.value,
                              "plan_seconds": plan_s, "rounds": len(analysis.rounds),
                              "lengths": rows, "budget": budget, "budgeted": calls})


if __name__ == "__main__":
  app.run(main)
