"""Models as people write them: the memory model against XLA, and the planner's reach.

For each training step (AdamW, masked loss) and a few shapes up to the longest,
this prints and writes to experiments/results/bench_models.json:

* model vs XLA: the modeled peak of round 0 (the step as traced, best order)
  against XLA's `memory_analysis()` footprint of that step compiled with the
  options under which it sees every buffer (DESIGN.md F2); the goal is within
  10 % + 8 MiB;
* reach: XLA's footprint of the planner's last round against that of the same
  model with `jax.checkpoint` (`nn.remat`) on each layer, compiled the same way;
  the goal is <= 1.05.

Compile-only (no step is run): footprints are XLA's static figures. Real peaks
and step times under a budget are measured by bench_remat.py / table1.py.

    python -m experiments.bench_models [--workloads llama,llama_scan] [--quick]
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from typing import Callable

from absl import app
from absl import flags
import jax

import jax_symmem as symmem
from jax_symmem._src import interpret
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import tracing
from jax_symmem.examples import gpt2
from jax_symmem.examples import llama

MiB = 2**20
FLAGS = flags.DEFINE_list("workloads", None, "subset of workloads to run (default: all)")
QUICK = flags.DEFINE_bool("quick", False, "two shapes per workload instead of three")


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  step: Callable          # remat_policy -> (state, *batch) -> (state, loss)
  state: Callable         # () -> state
  batch: Callable         # (b, length) -> batch arrays
  shapes: tuple           # polymorphic shapes of (state, *batch)
  constraints: tuple
  batch_size: int
  lengths: tuple


def _llama(scan: bool) -> Workload:
  cfg = dataclasses.replace(llama.PRESETS["small"], n_layers=4, max_len=512)
  return Workload(
      f"llama{'_scan' if scan else ''}",
      lambda policy: llama.train_step_fn(llama.Llama(cfg, policy, scan)),
      lambda: llama.init_state(cfg, scan_layers=scan),
      lambda b, s: llama.example_batch(cfg, b, s),
      (None, "b, s", "b, s"), llama.step_constraints(512, 4), 4, (128, 256, 512))


def _gpt2() -> Workload:
  cfg = gpt2.PRESETS["small"]
  return Workload(
      "gpt2", lambda policy: llama.train_step_fn(gpt2.GPT2(cfg, policy)),
      lambda: gpt2.init_state(cfg), lambda b, s: gpt2.example_batch(cfg, b, s),
      (None, "b, s", "b, s"), llama.step_constraints(512, 4), 4, (128, 256, 512))


WORKLOADS = {"llama": lambda: _llama(False), "llama_scan": lambda: _llama(True),
             "gpt2": _gpt2}


def _footprint(exe) -> int:
  ma = exe.memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
          - ma.alias_size_in_bytes)


def _compile(fn, args) -> int:
  return _footprint(jax.jit(fn).lower(*args).compile(
      compiler_options=jit_lib.CPU_COMPILER_OPTIONS))


def _round_footprint(analysis, k, dims, flat) -> int:
  env = analysis.graph.constraints.complete(dims)
  program = tracing.specialize_program(analysis.rounds[k].program, env)
  order = analysis.round_order(k, dims)
  return _compile(lambda *a: tuple(interpret.run(program, a, order)), flat)


def run_workload(w: Workload, lengths) -> list[dict]:
  state = w.state()
  t0 = time.perf_counter()
  analysis = symmem.analyze(w.step(None), state, *w.batch(2, 8), polymorphic_shapes=w.shapes,
                            constraints=w.constraints)
  plan_s = time.perf_counter() - t0
  rows = []
  for s in lengths:
    dims = {"b": w.batch_size, "s": s}
    args = (state, *w.batch(w.batch_size, s))
    flat = jax.tree_util.tree_leaves(args)
    last = len(analysis.rounds) - 1
    model0 = analysis.round_peak(0, dims)
    xla0 = _compile(w.step(None), args)
    xla_last = _round_footprint(analysis, last, dims, flat)
    per_layer = _compile(w.step("layer"), args)
    row = {"workload": w.name, "dims": dims, "rounds": last, "plan_s": round(plan_s, 1),
           "model_round0_mib": model0 / MiB, "xla_round0_mib": xla0 / MiB,
           "model_within_10pct_8mib": abs(model0 - xla0) <= 0.1 * xla0 + 8 * MiB,
           "xla_last_round_mib": xla_last / MiB, "xla_per_layer_ckpt_mib": per_layer / MiB,
           "reach_ratio": xla_last / per_layer}
    rows.append(row)
    print(f"{w.name:>11} b={w.batch_size} s={s:>4}: model {model0 / MiB:7.1f} vs XLA "
          f"{xla0 / MiB:7.1f} MiB ({'ok' if row['model_within_10pct_8mib'] else 'OFF'}); "
          f"last round ({last}) {xla_last / MiB:7.1f} vs per-layer checkpoint "
          f"{per_layer / MiB:7.1f} MiB = {row['reach_ratio']:.3f}", flush=True)
  return rows


def main(argv):
  del argv
  names = FLAGS.value or list(WORKLOADS)
  rows = []
  for name in names:
    w = WORKLOADS[name]()
    rows += run_workload(w, w.lengths[-2:] if QUICK.value else w.lengths)
  rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True).stdout.strip()
  out = {"environment": {"jax": jax.__version__, "machine": platform.machine(),
                         "cpus": os.cpu_count(), "git": rev},
         "command": "python -m experiments.bench_models " + " ".join(
             f"--workloads={n}" for n in [",".join(names)]), "rows": rows}
  os.makedirs("experiments/results", exist_ok=True)
  with open("experiments/results/bench_models.json", "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
