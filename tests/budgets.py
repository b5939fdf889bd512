"""Budgets for tests that need a remat round to run and XLA to be able to meet it, and the
checks of calls made under them."""

import re

import jax

from jax_symmem._src import variants


def xla_bytes(analysis, k, dims, args) -> int:
  """XLA's footprint of round k at dims, compiled as symmem.jit compiles under a budget."""
  options = variants.round_options(analysis, k, jax.devices()[0].platform)
  exe = jax.jit(variants.round_function(analysis, k, dims)).lower(
      *jax.tree_util.tree_leaves(args)).compile(compiler_options=options)
  return variants.footprint(exe)


def rounds_compiled(error: Exception) -> list[int]:
  """The rounds a BudgetError says were compiled before it, in its order."""
  return [int(k) for k in re.search(r"rounds compiled: ([\d, ]+)[;)]", str(error))[1].split(", ")]


def rounds_compiled_again(error: Exception) -> list[int]:
  """The rounds a BudgetError says were compiled again with XLA's other scheduler."""
  m = re.search(r"again with the other XLA scheduler: ([\d, ]+)\)", str(error))
  return [] if m is None else [int(k) for k in m[1].split(", ")]


def tight_budget(analysis, dims, args) -> int:
  """Halfway between the modeled peaks without eviction and at the lowest round, but
  never below 1.02 x what XLA reaches with the last round (symmem.jit refuses a budget
  XLA cannot meet)."""
  peaks = [analysis.round_peak(k, dims) for k in range(len(analysis.rounds))]
  last = len(analysis.rounds) - 1
  return max((min(peaks) + peaks[0]) // 2, int(1.02 * xla_bytes(analysis, last, dims, args)))


def same_options_reference(step, fn, args):
  """`fn` on `args` under jax.jit, compiled with the XLA options of the variant `step`
  (a symmem.jit function) ran last: what that call must compute."""
  call = step.last_call
  (variant,) = [v for v in step.variants()
                if v["dims"] == call["dims"] and v["round"] == call["round"]]
  options = variant["compiler_options"]   # exactly what symmem.jit compiled with
  return jax.jit(fn).lower(*args).compile(compiler_options=options)(*args)


def rounds_run_within(step, budget, fn, batches, assert_equal) -> list[int]:
  """Calls `step` on each batch, checking it fits the budget by XLA's figure and equals
  `fn` under jax.jit with the variant's options; returns the rounds that ran."""
  rounds = []
  for args in batches:
    out = step(*args)
    assert step.last_call["xla_bytes"] + step.last_call["reserved"] <= budget
    assert_equal(out, same_options_reference(step, fn, args))
    rounds.append(step.last_call["round"])
    del out   # live arrays count against the budget of the next call
  return rounds
