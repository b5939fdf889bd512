"""Why guards are resolved on the host: a lax.cond guard inside one executable saves nothing.

Compiles, for the benchmark transformer at one shape, (1) round 0 (no eviction),
(2) the last round with every region's recomputation always on (what symmem.jit
dispatches under a tight budget), (3) the guarded rewrite under plain jax.jit
(each region behind lax.cond on an io_callback predicate), and prints XLA's
memory_analysis() temp bytes for each (XNNPACK fusions off so temps are real,
DESIGN.md F2; barriers kept, F1).

  python -m experiments.bench_guard [--batch 4] [--seq 512]
"""

import argparse

import jax

from experiments import _common
from experiments import workloads
from experiments._common import MiB
from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import interpret
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import tracing
from jax_symmem.examples import transformer


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--out", default="experiments/results/bench_guard.json")
  args = parser.parse_args()
  traced, _ = workloads.traced_step()
  analysis = analysis_lib.analyze_traced(traced)
  dims = {"b": args.batch, "s": args.seq}
  env = analysis.graph.constraints.complete(dims)
  flat = jax.tree_util.tree_leaves(transformer.example_args(workloads.CONFIG, args.batch, args.seq))
  options = jit_lib.CPU_COMPILER_OPTIONS

  def temp(fn):
    return jax.jit(fn).lower(*flat).compile(compiler_options=options).memory_analysis().temp_size_in_bytes

  def round_fn(r):
    program = tracing.specialize_program(r.program, env)
    return lambda *a: interpret.run(program, a, r.order)

  results = {
      "round 0 (no eviction)": temp(round_fn(analysis.rounds[0])),
      f"round {len(analysis.rounds) - 1} (all regions, host-decided)": temp(round_fn(analysis.rounds[-1])),
      "guarded rewrite under plain jax.jit": temp(analysis.guarded_function(dims, budget=1)),
  }
  print(f"XLA temp bytes at b={args.batch}, s={args.seq} (memory_analysis, ynn fusions off):")
  for name, t in results.items():
    print(f"  {name:<45} {t / MiB:>9.1f} MiB")
  _common.write_results(args.out, {"dims": dims, "temp_bytes": results})


if __name__ == "__main__":
  main()
