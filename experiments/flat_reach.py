"""Flat rounds vs per-layer checkpointing as XLA compiles them, per XLA option set.

For an unrolled step of bench_models (GPT-2, T5, Llama) at one length, prints XLA's
`memory_analysis()` footprint (arguments + outputs + temps) of

* per-layer checkpointing (`nn.remat` on each layer), and
* the planner's rounds (the last, or every `--every`-th),

each compiled with the fence option (`cse_barrier_expander` disabled, DESIGN.md F1)
and with or without the memory-optimized scheduler, with or without XNNPACK
fusions (whose temps memory_analysis() does not see, F2), and the options
`symmem.jit` uses for that round (`variants.round_options`). With `--real`, also
the real peak (F3) of per-layer checkpointing as bench_models compiles it (fence
option only) and of the last round as symmem.jit compiles it.

This is how the flat planner's rewrite was checked against what XLA does with it
(experiments/RESULTS.md, "Models as people write them"): each figure is one compile (seconds);
`--real` adds two fresh processes. `--numerics=n` compares round n's outputs (the
updated state and loss) with those of `jax.jit` compiled with the same options.

    python -m experiments.flat_reach --workload=gpt2 --length=512
    python -m experiments.flat_reach --workload=t5 --length=512 --every=4 --real
    python -m experiments.flat_reach --workload=gpt2 --length=512 --numerics=14
"""

from __future__ import annotations

from absl import app
from absl import flags

from experiments import _common
from experiments._common import MiB

WORKLOAD = flags.DEFINE_string("workload", "gpt2", "a workload of bench_models")
LENGTH = flags.DEFINE_integer("length", 512, "sequence length (T5: source; target is half)")
EVERY = flags.DEFINE_integer("every", 0, "also compile every n-th round (0: the last only)")
REAL = flags.DEFINE_bool("real", False, "also measure real peaks (F3, fresh processes)")
NUMERICS = flags.DEFINE_integer("numerics", -1, "compare round n's outputs with jax.jit's, leaf by leaf")

FENCE = {"xla_disable_hlo_passes": "cse_barrier_expander"}
MEMOPT = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
OPTION_SETS = {
    "fence": FENCE, "fence+no-ynn": {**FENCE, **NO_YNN},
    "fence+memopt": {**FENCE, **MEMOPT}, "fence+memopt+no-ynn": {**FENCE, **MEMOPT, **NO_YNN},
}


def main(argv):
  del argv
  import jax
  from experiments import bench_models
  from jax_symmem._src import variants
  w = bench_models.WORKLOADS[WORKLOAD.value]()
  length = LENGTH.value
  args = (w.state(), *w.batch(length))
  flat = jax.tree_util.tree_leaves(args)
  dims = w.dims(length)
  mib = lambda exe: f"{_common.xla_memory(exe)['footprint'] / MiB:7.1f}"
  print(f"{w.name} at {dims}: XLA footprint, MiB")
  print(f"{'':>22}" + "".join(f"{k:>22}" for k in OPTION_SETS) + f"{'symmem.jit':>14}{'model':>8}")
  per_layer = jax.jit(w.step("layer"))
  row = [mib(per_layer.lower(*args).compile(compiler_options=o)) for o in OPTION_SETS.values()]
  print(f"{'per-layer checkpoint':>22}" + "".join(f"{x:>22}" for x in row), flush=True)
  analysis = bench_models._analysis(w)
  last = len(analysis.rounds) - 1
  ks = sorted({last} | (set(range(0, last, EVERY.value)) if EVERY.value else set()))
  for k in ks:
    fn = jax.jit(variants.round_function(analysis, k, dims))
    row = [mib(fn.lower(*flat).compile(compiler_options=o)) for o in OPTION_SETS.values()]
    own = mib(fn.lower(*flat).compile(compiler_options=variants.round_options(analysis, k)))
    model = f"{analysis.round_peak(k, dims) / MiB:.1f}"
    print(f"{f'round {k}':>22}" + "".join(f"{x:>22}" for x in row) + f"{own:>14}{model:>8}",
          flush=True)
  if REAL.value:
    real = {v: bench_models._real(w.name, v, length)["real"] / MiB
            for v in ("per_layer", "last_round")}
    print(f"real peak (F3): per-layer checkpoint {real['per_layer']:.1f} MiB, last round "
          f"{real['last_round']:.1f} MiB: reach {real['last_round'] / real['per_layer']:.2f}")


  if NUMERICS.value >= 0:
    _numerics(w, analysis, NUMERICS.value, args, dims)


def _numerics(w, analysis, k, args, dims):
  """Leaves of round k's outputs not within rtol 1e-5, atol 1e-6 of jax.jit's (same options)."""
  import jax
  import numpy as np
  from jax_symmem._src import variants
  options = variants.round_options(analysis, k)
  want = jax.jit(w.step(None)).lower(*args).compile(compiler_options=options)(*args)
  flat = jax.tree_util.tree_leaves(args)
  got = jax.jit(variants.round_function(analysis, k, dims)).lower(*flat).compile(
      compiler_options=options)(*flat)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]
  differ = 0
  for path, g, x in zip(paths, got, jax.tree_util.tree_leaves(want)):
    g, x = np.asarray(g), np.asarray(x)
    if not np.allclose(g, x, rtol=1e-5, atol=1e-6):
      differ += 1
      far = ~np.isclose(g, x, rtol=1e-5, atol=1e-6)
      print(f"round {k} vs jax.jit: {path} {x.shape}: {int(far.sum())} entries apart, max "
            f"|diff| {np.abs(g - x).max():.3g} (max |jax.jit| {np.abs(x).max():.3g})")
  print(f"round {k} vs jax.jit (same options): {differ} of {len(paths)} leaves apart")


if __name__ == "__main__":
  app.run(main)
