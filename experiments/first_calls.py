"""What symmem.jit's first call at each length compiles and runs under bench_models' budgets.

For each step of `experiments.bench_models`, one `symmem.jit` under a budget (MiB, given per
workload; bench_models' budget is 1.25 x per-layer checkpointing's real peak at the longest
length) is called once at each length, shortest first, in one process: the round it ran,
XLA's footprint of that variant and the compiles the call took. Compile counts and rounds
are deterministic (no timing). Run it with JAX_SYMMEM_XLA_BUFFERS=0 as well to compare
the run-time decision by the op-by-op modeled peak with the predicted footprint.

  python -m experiments.first_calls [--workloads llama=279.9,gpt2=270.4] [--out PATH]
"""

from __future__ import annotations

import argparse

import jax

import jax_symmem as symmem
from experiments import _common
from experiments import bench_models
from jax_symmem._src import analysis

# bench_models' budgets of its 2026-12-02 run (experiments/RESULTS.md), MiB.
BUDGETS = ("llama=279.9,gpt2=270.4,t5=297.9,gpt2_layerdrop=248.5,llama_scan=265.1,"
           "llama_accum=179.4")


def run(name: str, budget_mib: float) -> dict:
  w = bench_models.WORKLOADS[name]()
  state = w.state()
  step = symmem.jit(w.step(None), polymorphic_shapes=w.shapes, constraints=w.constraints,
                    memory_budget=int(budget_mib * 2**20))
  rows = []
  for length in w.lengths:
    before = step.cache_info()["compiles"]
    jax.block_until_ready(step(state, *w.batch(length)))
    rows.append({"length": length, "round": step.last_call["round"],
                 "xla_mib": step.last_call["xla_bytes"] / 2**20,
                 "compiles": step.cache_info()["compiles"] - before})
    print(f"{name} s={length}: round {rows[-1]['round']}, XLA {rows[-1]['xla_mib']:.1f} MiB, "
          f"{rows[-1]['compiles']} compile(s)", flush=True)
  return {"workload": name, "budget_mib": budget_mib, "calls": rows}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default=BUDGETS, help="name=budget MiB, comma-separated")
  parser.add_argument("--out", default="experiments/results/first_calls.json")
  args = parser.parse_args(argv)
  budgets = dict(item.split("=") for item in args.workloads.split(","))
  _common.run_workloads(",".join(budgets), lambda name: run(name, float(budgets[name])), args.out,
                        predict_xla_buffers=analysis.PREDICT_XLA_BUFFERS)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
