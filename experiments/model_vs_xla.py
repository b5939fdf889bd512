"""Where the memory model and XLA part: modeled peak vs XLA's footprint, round by round.

`bench_models` checks round 0 against XLA's `memory_analysis()`; the planner also
relies on the model for its later rounds. For each workload of `bench_models`, at
its three lengths, this compiles rounds 0, the middle one and the last as
`symmem.jit` compiles them under a budget and prints, in MiB:

* the modeled peak (`Analysis.round_peak`) and whether it is within 10 % + 8 MiB
  of XLA's footprint (issue 10's criterion);
* the footprint `symmem.jit` decides by (`Analysis.round_footprint`, the model's live
  ranges laid out as XLA's buffer assigner lays them out, fusion and loops included)
  and whether it is within 10 % + 8 MiB;
* XLA's footprint and its parts (arguments, outputs, temp).

  python -m experiments.model_vs_xla [--workloads llama,gpt2] [--out PATH]

Writes experiments/results/model_vs_xla.json (or --out).
"""

from __future__ import annotations

import argparse
import os

from experiments import _common
from experiments import bench_models
from experiments._common import MiB

RESULTS = "experiments/results/model_vs_xla.json"


def run_workload(name: str) -> dict:
  w = bench_models.WORKLOADS[name]()
  state = w.state()
  analysis = bench_models._analysis(w, state)
  last = len(analysis.rounds) - 1
  rows = []
  for length in w.lengths:
    dims = w.dims(length)
    args = (state, *w.batch(length))
    for k in sorted({0, last // 2, last}):
      model = analysis.round_peak(k, dims)
      predicted = analysis.round_footprint(k, dims)
      exe, _ = bench_models._compile_round(analysis, k, dims, args)
      xla = _common.xla_memory(exe)
      row = {"dims": dims, "round": k, "model_mib": model / MiB,
             "predicted_mib": predicted / MiB, "xla_mib": xla["footprint"] / MiB,
             "xla_parts_mib": {p: v / MiB for p, v in xla.items() if p != "footprint"},
             "model_ok": _common.model_near_xla(model, xla["footprint"]),
             "predicted_ok": _common.model_near_xla(predicted, xla["footprint"])}
      rows.append(row)
      print(f"{name} {dims} round {k}: model {row['model_mib']:.1f} "
            f"[{'ok' if row['model_ok'] else 'OFF'}], predicted "
            f"{row['predicted_mib']:.1f} [{'ok' if row['predicted_ok'] else 'OFF'}], "
            f"XLA {row['xla_mib']:.1f} (" + ", ".join(
                f"{p} {v:.1f}" for p, v in row["xla_parts_mib"].items()) + ")", flush=True)
  return {"workload": name, "rounds": last, "rows": rows, "load": list(os.getloadavg())}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default=",".join(bench_models.WORKLOADS))
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args(argv)
  results = _common.run_workloads(args.workloads, run_workload, args.out)
  for kind in ("model_ok", "predicted_ok"):
    rows = [r for res in results for r in res["rows"]]
    print(f"{kind.replace('_ok', '')}: within 10 % + 8 MiB of XLA in "
          f"{sum(r[kind] for r in rows)} of {len(rows)} (workload, shape, round)")


if __name__ == "__main__":
  main()
