"""What a call of a budgeted symmem.jit step costs beyond jax.jit's, on the default device.

On the H200 (2026-12-04) round 0 of the scanned Llama at s=512, the same program as
jax.jit's, took 25.1 ms a step against jax.jit's 24.7 (median of 10 passes): this
separates the per-call work (the live-bytes probe, `memory_stats()` on a GPU;
flattening and binding the dims) from step-time noise. A step with next to no work
(40 arrays of 8x8 scaled, one per layer and parameter kind, as a training state has)
is called back to back:

  * the live-bytes probe (`memory_stats()` of the first device; on the CPU `jax.live_arrays()`);
  * jax.jit, the compiled executable called directly, symmem.jit without a budget and
    with one (every call then reads the live bytes).

    python -m experiments.dispatch_overhead [--leaves=40] [--calls=500]

Prints microseconds per call (the fastest of 5 batches of calls) and writes
experiments/results/dispatch_overhead.json.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments import _common
import jax_symmem as symmem
from jax_symmem._src import device

LEAVES = flags.DEFINE_integer("leaves", 40, "arrays in the step's state")
CALLS = flags.DEFINE_integer("calls", 500, "calls per timed batch")
OUT = flags.DEFINE_string("out", "experiments/results/dispatch_overhead.json", "results file")


def _per_call_us(fn, calls: int) -> float:
  """Fastest of 5 batches of `calls` back-to-back calls, in microseconds per call."""
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t) / calls * 1e6)
  return best


def main(argv):
  del argv
  state = [jnp.full((8, 8), float(i)) for i in range(LEAVES.value)]
  x = jnp.ones((8, 8))

  def step(state, x):   # next to no work: the time is the call's
    return [w * 0.999 for w in state], jnp.sum(x)

  fns = {
      "jax.jit": jax.jit(step),
      "compiled": jax.jit(step).lower(state, x).compile(),
      "symmem.jit": symmem.jit(step, polymorphic_shapes=(None, "b, _"),
                               constraints=("b <= 64",)),
      "symmem.jit with a budget": symmem.jit(step, polymorphic_shapes=(None, "b, _"),
                                             constraints=("b <= 64",), memory_budget=1 << 32),
  }
  results = {"live_bytes_us": _per_call_us(device.live_bytes, LEAVES.value * 10),
             "platform": jax.devices()[0].platform, "leaves": LEAVES.value}
  for name, fn in fns.items():
    jax.block_until_ready(fn(state, x))
    results[name] = _per_call_us(lambda fn=fn: fn(state, x), CALLS.value)
  print(f"{results['platform']}: live-bytes probe {results['live_bytes_us']:.1f} us; per call: "
        + ", ".join(f"{k} {results[k]:.1f} us" for k in fns), flush=True)
  _common.write_results(OUT.value, results)


if __name__ == "__main__":
  app.run(main)
