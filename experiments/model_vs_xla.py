"""Where the memory model and XLA part: modeled peak vs XLA's footprint, round by round.

`bench_models` checks round 0 against XLA's `memory_analysis()`; the planner also
relies on the model for its later rounds. For each workload of `bench_models`, at
its three lengths, this compiles rounds 0, the middle one and the last as
`symmem.jit` compiles them under a budget and prints, in MiB:

* the modeled peak (`Analysis.round_peak`) and whether it is within 10 % + 8 MiB
  of XLA's footprint (issue 10's criterion);
* a diagnostic variant of the model in which the step's outputs are live from the
  start: XLA allocates a program's outputs apart from its temporaries, for the
  whole run, where the model allocates each when its producer runs;
* XLA's footprint and its parts (arguments, outputs, temp).

  python -m experiments.model_vs_xla [--workloads llama,gpt2] [--out PATH]

Writes experiments/results/model_vs_xla.json (or --out).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from experiments import _common
from experiments import bench_models
from experiments._common import MiB
from jax_symmem._src import memory

RESULTS = "experiments/results/model_vs_xla.json"


def outputs_reserved_peak(round_, order, dims) -> int:
  """The round's modeled peak with every output buffer it makes live from the first step."""
  graph, program = round_.graph, round_.program
  tables = memory.order_tables(graph, dims, program)
  steps = np.asarray(tables.step_bytes(order), dtype=object)
  buffer = memory.buffers(program)
  outputs = {buffer[o] for o in program.outputs if isinstance(o, int)} - set(program.inputs)
  made = np.asarray([sum(tables.size_of(o) for o in program.nodes[i].outputs if o in outputs)
                     for i in order], dtype=object)
  total = sum(tables.size_of(b) for b in outputs)
  ahead = total - np.cumsum(made)        # output bytes not yet made while each step runs
  return int(max(tables.arguments + total, max(steps + ahead))) if len(order) else tables.arguments


def run_workload(name: str) -> dict:
  w = bench_models.WORKLOADS[name]()
  analysis = bench_models._analysis(w)
  last = len(analysis.rounds) - 1
  rows = []
  for length in w.lengths:
    dims = w.dims(length)
    args = (w.state(), *w.batch(length))
    for k in sorted({0, last // 2, last}):
      round_ = analysis.rounds[k]
      env = round_.graph.constraints.complete(dims)
      model = analysis.round_peak(k, dims)
      reserved = outputs_reserved_peak(round_, analysis.round_order(k, dims), env)
      exe, _ = bench_models._compile_round(analysis, k, dims, args)
      xla = _common.xla_memory(exe)
      row = {"dims": dims, "round": k, "model_mib": model / MiB,
             "outputs_reserved_mib": reserved / MiB, "xla_mib": xla["footprint"] / MiB,
             "xla_parts_mib": {p: v / MiB for p, v in xla.items() if p != "footprint"},
             "model_ok": _common.model_near_xla(model, xla["footprint"]),
             "outputs_reserved_ok": _common.model_near_xla(reserved, xla["footprint"])}
      rows.append(row)
      print(f"{name} {dims} round {k}: model {row['model_mib']:.1f} "
            f"[{'ok' if row['model_ok'] else 'OFF'}], outputs reserved "
            f"{row['outputs_reserved_mib']:.1f} [{'ok' if row['outputs_reserved_ok'] else 'OFF'}], "
            f"XLA {row['xla_mib']:.1f} (" + ", ".join(
                f"{p} {v:.1f}" for p, v in row["xla_parts_mib"].items()) + ")", flush=True)
  return {"workload": name, "rounds": last, "rows": rows, "load": list(os.getloadavg())}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="llama,llama_scan,llama_scan_remat,nnx_scan,gpt2,t5")
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  results = _common.run_workloads(args.workloads, run_workload, args.out)
  for kind in ("model_ok", "outputs_reserved_ok"):
    rows = [r for res in results for r in res["rows"]]
    print(f"{kind.replace('_ok', '')}: within 10 % + 8 MiB of XLA in "
          f"{sum(r[kind] for r in rows)} of {len(rows)} (workload, shape, round)")


if __name__ == "__main__":
  main()
