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
  first backward use (`remat._walk_back`, no cost bound), and all of a layer's
  regenerations share that consumer, so `remat.apply_regions` recomputes the layer
  once behind one fence.

It compiles the result as `symmem.jit` compiles a fenced round, prints XLA's FLOPs,
bytes accessed and footprint beside per-layer checkpointing's, and checks the updated
state against `jax.jit` compiled with the same options. The rounds can offer such
regions as candidates (`remat.LAYER_GROUPS`, experimental and off; `round_cost
--layer_groups` measures the ladder it gives).

  python -m experiments.layer_regions [--workloads llama,gpt2,t5] [--out PATH]

Writes experiments/results/layer_regions.json (or --out).
"""

from __future__ import annotations

import argparse
import collections

import jax
import numpy as np

from experiments import _common
from experiments import bench_models
from experiments import round_cost
from experiments._common import MiB
from jax_symmem._src import interpret
from jax_symmem._src import memory
from jax_symmem._src import remat
from jax_symmem._src import tracing
from jax_symmem._src import variants
from jax_symmem._src.ir import Const, layer_scope

RESULTS = "experiments/results/layer_regions.json"


def layer_regions(graph, program, order, env) -> tuple[list[remat.Region], dict]:
  """Regions evicting every layer's residuals, one consumer (so one recomputation) per layer."""
  peak_pos, _ = memory.peak_step(graph, env, program, order)
  pos = {n: i for i, n in enumerate(order)}
  producer = {o: n.index for n in program.nodes for o in n.outputs}
  first_after, last_use = {}, collections.defaultdict(lambda: -1)
  forward_readers = collections.defaultdict(set)
  for node in program.nodes:
    p = pos[node.index]
    for v in node.operands:
      last_use[v] = max(last_use[v], p)
      if p > peak_pos:
        first_after[v] = min(first_after.get(v, len(order)), p)
      else:
        forward_readers[v].add(node.index)
  layer = {i: layer_scope(n.source) for i, n in enumerate(program.nodes)}
  outputs = {x for x in program.outputs if not isinstance(x, Const)}
  at_peak = set(program.nodes[order[peak_pos]].operands)
  groups = collections.defaultdict(list)
  for v in first_after:
    made = producer.get(v)
    if (made is None or pos[made] >= peak_pos or v in outputs or v in at_peak
        or layer[made] is None):
      continue
    if all(layer[i] == layer[made] for i in forward_readers[v]):   # not a later layer's input
      groups[layer[made]].append(v)
  evicted = {v for vs in groups.values() for v in vs}
  inputs = set(program.inputs)
  size = memory.order_tables(graph, env, program).size_of
  regions = []
  for name, values in groups.items():
    u = min(first_after[v] for v in values)

    def anchor(a, prefer_recompute):
      del prefer_recompute
      if a in inputs:
        return True
      return a in producer and a not in evicted and pos[producer[a]] < u and last_use[a] >= u

    for v in values:
      nodes, anchors = remat._walk_back(program, producer, v, anchor, lambda i: 0, 1 << 62)
      regions.append(remat.Region(v, order[u], tuple(sorted(nodes, key=pos.__getitem__)),
                                  anchors, graph.bytes(v), graph.bytes(v),
                                  program.nodes[producer[v]].source))
  sizes = {name: {"values": len(vs), "mib": sum(size(v) for v in vs) / MiB}
           for name, vs in sorted(groups.items())}
  return regions, sizes


def run_workload(name: str) -> dict:
  w = bench_models.WORKLOADS[name]()
  length = w.lengths[-1]
  dims, args = w.dims(length), (w.state(), *w.batch(length))
  flat = jax.tree_util.tree_leaves(args)
  analysis = bench_models._analysis(w)
  first = analysis.rounds[0]
  env = first.graph.constraints.complete(dims)
  regions, groups = layer_regions(first.graph, first.program, tuple(first.order), env)
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
