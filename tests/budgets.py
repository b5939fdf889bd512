"""Budgets for tests that need a remat round to run and XLA to be able to meet it."""

import jax

from jax_symmem._src import variants


def xla_bytes(analysis, k, dims, args) -> int:
  """XLA's footprint of round k at dims, compiled as symmem.jit compiles under a budget."""
  options = variants.round_options(analysis, k, jax.devices()[0].platform)
  exe = jax.jit(variants.round_function(analysis, k, dims)).lower(
      *jax.tree_util.tree_leaves(args)).compile(compiler_options=options)
  ma = exe.memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
          - ma.alias_size_in_bytes)


def tight_budget(analysis, dims, args) -> int:
  """Halfway between the modeled peaks without eviction and at the lowest round, but
  never below 1.02 x what XLA reaches with the last round (symmem.jit refuses a budget
  XLA cannot meet)."""
  peaks = [analysis.round_peak(k, dims) for k in range(len(analysis.rounds))]
  last = len(analysis.rounds) - 1
  return max((min(peaks) + peaks[0]) // 2, int(1.02 * xla_bytes(analysis, last, dims, args)))
