"""The main job: symbolic analysis of a small transformer training step.

Run with `python -m jax_symmem.demo` (flags: --help). It traces the training
step once with symbolic batch and sequence dims, prints the shape report, plans
memory for every allowed shape (schedule and rematerialization rounds), prints
the modeled peak per sequence length under a budget, and runs the step with
`symmem.jit` at a few lengths, checking its results against `jax.jit`.
"""

from absl import app
from absl import flags
from absl import logging

import jax
import jax.numpy as jnp

import jax_symmem as symmem
from jax_symmem.examples import transformer

_LAYERS = flags.DEFINE_integer("layers", 2, "Transformer layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "Largest batch size allowed.")
_MAX_SEQ = flags.DEFINE_integer("max_seq", 1024, "Longest sequence allowed.")
_BUDGET_MIB = flags.DEFINE_integer("budget_mib", 160, "Memory budget for the planned step, MiB.")
_RUN_LENGTHS = flags.DEFINE_list("run_lengths", ["32", "256"], "Sequence lengths to run.")


def main(argv):
  del argv  # No positional arguments.
  cfg = transformer.Config(d_model=_D_MODEL.value, n_heads=4, d_ff=int(_D_MODEL.value * 8 / 3),
                           n_layers=_LAYERS.value, vocab=512)
  args = transformer.example_args(cfg, batch=2, seq=16)
  constraints = ("s >= 2", f"s <= {_MAX_SEQ.value}", f"b <= {_MAX_BATCH.value}")
  logging.info("tracing %s with dims (b, s) under %s", "train_step", constraints)
  traced = symmem.trace(transformer.make_train_step(cfg), *args,
                        polymorphic_shapes=(None, "b, s", "b, s"), constraints=constraints)
  print(symmem.shape_report(symmem.shape_graph(traced)))

  budget = _BUDGET_MIB.value * 2**20
  step = symmem.jit(transformer.make_train_step(cfg), polymorphic_shapes=(None, "b, s", "b, s"),
                    constraints=constraints, memory_budget=budget)
  analysis = step.analyze(*args)
  print("\n" + analysis.plan)
  batch = min(4, _MAX_BATCH.value)
  lengths = sorted({s for s in (16, 64, 256, 512) if s <= _MAX_SEQ.value} | {_MAX_SEQ.value})
  print("\n" + symmem.memory_report(analysis, [{"b": batch, "s": s} for s in lengths], budget))
  print(f"\ndecision counts: {analysis.stats}")

  reference = jax.jit(transformer.make_train_step(cfg))
  print(f"\nrunning symmem.jit (budget {_BUDGET_MIB.value} MiB) against jax.jit:")
  for s in (int(x) for x in _RUN_LENGTHS.value):
    run_args = transformer.example_args(cfg, batch, s)
    loss, params = step(*run_args)
    ref_loss, ref_params = reference(*run_args)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)))
    print(f"  b={batch} s={s}: loss {float(loss):.6f} (jax.jit {float(ref_loss):.6f}), "
          f"max |param difference| {err:.2e}")
  print(f"  cache: {step.cache_info()}")


if __name__ == "__main__":
  app.run(main)
