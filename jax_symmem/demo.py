"""The main job: symbolic analysis of a small transformer training step.

Run with `python -m jax_symmem.demo` (flags: --help). It traces the training
step once with symbolic batch and sequence dims and prints the shape report.
"""

from absl import app
from absl import flags
from absl import logging

import jax_symmem as symmem
from jax_symmem.examples import transformer

_LAYERS = flags.DEFINE_integer("layers", 2, "Transformer layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "Largest batch size allowed.")
_MAX_SEQ = flags.DEFINE_integer("max_seq", 1024, "Longest sequence allowed.")


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


if __name__ == "__main__":
  app.run(main)
