"""A flat round that recomputes each layer once: what XLA makes of it, against the planner's rounds.

`experiments.round_cost` shows the unrolled decoders' flat rounds dominated by per-layer
checkpointing: each flat region regenerates one value from the nearest kept values
for its own consumer, so a layer's shared work is recomputed once per consumer. This
builds, from round 0 of a bench_models step at its longest shape, the rewrite that
per-layer checkpointing does, with the planner's own parts:

* a layer is a scope of the traced program ending in a layer index (`ir.layer_scope`:
  `layer_3`, `encoder/layer_0`, `h_1`, `block/2`, as Flax and HF name repeated layers);
* every value a layer's forward makes that is live across the peak and read by no
  later layer's forward is evicted (what a later layer reads, the layer's output, is
  its next layer's input and stays, as `jax.checkpoint` on the layer keeps it);
* each evicted value regenerates from arguments and values kept live at its layer's
  first backward use (no cost bound), and all of a layer's regenerations share that
  consumer, so `remat.apply_regions` recomputes the layer once behind one fence.

These are the `remat.RegionGroup`s the planner offers at round 0 (`remat.plan(...,
layer_groups=True)`), all of them applied at once.

It compiles the result as `symmem.jit` compiles a fenced round, prints XLA's FLOPs,
bytes accessed and footprint beside per-layer checkpointing's, and checks the updated
state against `jax.jit` compiled with the same options. The rounds offer such
groups as candidates, in place of their values alone (`remat.LAYER_GROUPS`; `round_cost`
measures the ladder it gives, `--no_layer_groups` the one without).

  python -m experiments.layer_regions [--workloads llama,gpt2,t5] [--out PATH]

Writes experiments/results/layer_regions.json (or --out).
"""

from __future__ import annotations

import argparse

import jax

from experiments import _common
from experiments import bench_models
from experiments import round_cost
from experiments._common import MiB
from jax_symmem._src import interpret
from jax_symmem._src import memory
from jax_symmem._src import remat
from jax_symmem._src import tracing
from jax_symmem._src import variants

RESULTS = "experiments/results/layer_regions.json"


def layer_regions(first, dims) -> tuple[list[remat.Region], dict]:
  """Every layer's residuals evicted as the planner's `remat.RegionGroup`s offer them at
  round 0: one consumer, so one recomputation, per layer."""
  plan = remat.plan(first.graph, first.order, program=first.program, shape_of_interest=dims,
                    loops=first.loops, layer_groups=True)
  groups = [g for g in plan.regions if isinstance(g, remat.RegionGroup)]
  size = memory.order_tables(first.graph, first.graph.constraints.complete(dims),
                             first.program).size_of
  sizes = {g.layer: {"values": len(g.regions), "mib": sum(size(r.value) for r in g.regions) / MiB}
           for g in sorted(groups, key=lambda g: g.layer)}
  return [r for g in groups for r in g.regions], sizes


def run_workload(name: str) -> dict:
  w = bench_models.WORKLOADS[name]()
  length = w.lengths[-1]
  dims, args = w.dims(length), (w.state(), *w.batch(length))
  flat = jax.tree_util.tree_leaves(args)
  analysis = bench_models._analysis(w)
  first = analysis.rounds[0]
  env = first.graph.constraints.complete(dims)
  regions, groups = layer_regions(first, dims)
  program, order, blocks = remat.apply_regions(first.program, first.order, regions)
  graph = first.graph.extended(program, remat._copies(program, blocks))
  specialized = tracing.specialize_program(program, env)
  options = dict(variants.CPU_COMPILER_OPTIONS)
  del options[variants.SCHEDULER_OPTION]   # as a fenced round compiles
  exe = jax.jit(lambda *a: tuple(interpret.run(specialized, a, order))).lower(*flat).compile(
      compiler_options=options)
  want = jax.jit(w.step(None)).lower(*args).compile(compiler_options=options)(*args)
  out = {"workload": name, "dims": dims, "layers": groups, "regions": len(regions),
         "fences": len({b.barrier for b in blocks}),
         "layer_regions": {**round_cost.cost(exe),
                           "model_mib": memory.peak_at(graph, dims, program, order) / MiB},
         "equal_to_jax_jit": _common.trees_close(tuple(exe(*flat)),
                                                 tuple(jax.tree_util.tree_leaves(want)))}
  out["per_layer"] = round_cost.cost(jax.jit(w.step("layer")).lower(*args).compile(
      compiler_options=bench_models._per_layer_options()))
  last = len(analysis.rounds) - 1
  exe_last, _ = bench_models._compile_round(analysis, last, dims, args)
  out["last_round"] = {"round": last, **round_cost.cost(exe_last)}
  for key in ("layer_regions", "per_layer", "last_round"):
    print(f"{name} {dims} {key:>13}: " + round_cost._row(out[key]), flush=True)
  print(f"{name}: {len(groups)} layers, {out['regions']} regions, {out['fences']} fences; "
        f"equal to jax.jit (same options): {out['equal_to_jax_jit']}", flush=True)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="llama,gpt2,t5")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  _common.run_workloads(args.workloads, run_workload, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
