"""What each round costs in XLA's own accounting, against per-layer checkpointing.

Step time on a shared 2-core machine is noisy, and on CPU the budget's options cost
time of their own (no XNNPACK fusions, experiments/RESULTS.md, "Models as people write them"). XLA's
`cost_analysis()` of a compiled executable is neither: for each workload of
bench_models at its longest shape this compiles `jax.jit`, per-layer checkpointing
(`nn.remat` on each layer, bench_models' options) and rounds of the plan (each with
the options `symmem.jit` gives it) and records XLA's FLOPs, bytes accessed and
`memory_analysis()` footprint, with the modeled peak beside it.

Then, per workload, the question behind issue 10's step-time row: at a budget of
1.25 x per-layer checkpointing's footprint (bench_models' budget is 1.25 x its real
peak), which is the first round that XLA fits, and how many FLOPs and bytes does it
move compared with per-layer checkpointing? A round that fits with fewer FLOPs can
be faster on any machine; one that needs more cannot, whatever the options.

XLA counts a `while` loop's body once (not times its trip count), so the scanned
steps' FLOPs are comparable with each other (the recomputation is in the body for
both per-layer checkpointing and the loop rounds), not with the unrolled steps'.

  python -m experiments.round_cost [--workloads llama,gpt2] [--max_rounds 24] [--out PATH]
      [--no_layer_groups]   # plan with each value offered alone (remat.LAYER_GROUPS off)
  python -m experiments.round_cost --replay experiments/results/round_cost.json --out PATH
      # no compiles: a results file's XLA figures beside today's modeled peaks and
      # predicted footprints of the same rounds (valid while the plans are the same)

Each round's row has the op-by-op modeled peak (`model_mib`) and the footprint the
run-time decision predicts (`predicted_mib`: the model's live ranges laid out as XLA's
buffer assigner lays them out, `Analysis.round_footprint`).

Writes experiments/results/round_cost.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax

from experiments import _common
from experiments import bench_models
from experiments._common import MiB
from jax_symmem._src import remat

RESULTS = "experiments/results/round_cost.json"
BUDGET_FACTOR = 1.25   # bench_models' budget, over per-layer checkpointing's peak


def cost(exe) -> dict:
  """XLA's FLOPs, bytes accessed and footprint of a compiled executable."""
  analysis = exe.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return {"gflops": float(analysis.get("flops", 0.0)) / 1e9,
          "gib_accessed": float(analysis.get("bytes accessed", 0.0)) / 2**30,
          "xla_mib": _common.xla_memory(exe)["footprint"] / MiB}


def sampled(last: int, most: int) -> list[int]:
  """Round 0, the last, and evenly spaced ones between: at most `most` in all."""
  if last + 1 <= most:
    return list(range(last + 1))
  return sorted({round(i * last / (most - 1)) for i in range(most)})


def run_workload(name: str, max_rounds: int) -> dict:
  w = bench_models.WORKLOADS[name]()
  length = w.lengths[-1]
  dims, args = w.dims(length), (w.state(), *w.batch(length))
  out = {"workload": name, "dims": dims}
  for variant, policy, options in (("jit", None, {}),
                                   ("per_layer", "layer", bench_models._per_layer_options())):
    out[variant] = cost(jax.jit(w.step(policy)).lower(*args).compile(compiler_options=options))
    print(f"{name} {dims} {variant:>9}: " + _row(out[variant]), flush=True)
  analysis = bench_models._analysis(w)
  out["rounds"] = len(analysis.rounds) - 1
  out["by_round"] = []
  for k in sampled(out["rounds"], max_rounds):
    exe, _ = bench_models._compile_round(analysis, k, dims, args)
    row = {"round": k, **cost(exe), **modeled(analysis, k, dims)}
    out["by_round"].append(row)
    print(f"{name} {dims} round {k:>3}: " + _row(row) + f", modeled {row['model_mib']:.1f} MiB",
          flush=True)
  out["summary"] = summarize(out)
  out["error"] = errors(out["by_round"])
  print(f"{name}: {out['summary']}", flush=True)
  return out


def modeled(analysis, k: int, dims: dict) -> dict:
  return {"model_mib": analysis.round_peak(k, dims) / MiB,
          "predicted_mib": analysis.round_footprint(k, dims) / MiB}


def replay(result: dict) -> dict:
  """`result` (one workload of a results file) with today's modeled and predicted figures."""
  w = bench_models.WORKLOADS[result["workload"]]()
  analysis, dims = bench_models._analysis(w), result["dims"]
  if len(analysis.rounds) - 1 != result["rounds"]:
    raise SystemExit(f"{result['workload']}: {len(analysis.rounds) - 1} rounds planned today, "
                     f"{result['rounds']} in the file: the plans differ, compile again")
  rows = [{**row, **modeled(analysis, row["round"], dims)} for row in result["by_round"]]
  for row in rows:
    print(f"{result['workload']} round {row['round']:>3}: XLA {row['xla_mib']:6.1f}, modeled "
          f"{row['model_mib']:6.1f}, predicted {row['predicted_mib']:6.1f} MiB", flush=True)
  return {**result, "by_round": rows, "error": errors(rows)}


def errors(rows: list[dict]) -> dict:
  """The modeled peak's and the prediction's error against XLA's footprint, over the rounds."""
  rel = lambda key: [r[key] / r["xla_mib"] - 1 for r in rows]
  within = lambda key: sum(abs(r[key] - r["xla_mib"]) <= 0.1 * r["xla_mib"] + 8 for r in rows)
  return {key: {"min": min(rel(key)), "max": max(rel(key)),
                "median_abs": sorted(map(abs, rel(key)))[len(rows) // 2],
                "within_10pct_8mib": within(key), "rounds": len(rows)}
          for key in ("model_mib", "predicted_mib")}


def _row(c: dict) -> str:
  return (f"{c['gflops']:8.2f} GFLOP, {c['gib_accessed']:6.2f} GiB accessed, "
          f"XLA {c['xla_mib']:6.1f} MiB")


def summarize(out: dict) -> dict:
  """The first sampled round within 1.25 x per-layer checkpointing's footprint, against it;
  and the smallest footprint among rounds recomputing no more than per-layer checkpointing."""
  jit, per_layer, rounds = out["jit"], out["per_layer"], out["by_round"]
  recompute = lambda c: c["gflops"] - jit["gflops"]
  budget = BUDGET_FACTOR * per_layer["xla_mib"]
  summary = {"budget_mib": budget, "per_layer_recompute_gflops": recompute(per_layer)}
  fitting = [r for r in rounds if r["xla_mib"] <= budget]
  if fitting:
    first = fitting[0]
    summary.update(first_fitting_round=first["round"],
                   recompute_vs_per_layer=recompute(first) / max(recompute(per_layer), 1e-9),
                   accessed_vs_per_layer=first["gib_accessed"] / per_layer["gib_accessed"])
  cheap = [r for r in rounds if r["gflops"] <= per_layer["gflops"]]
  summary["smallest_mib_at_per_layer_flops_vs_per_layer"] = (
      min(r["xla_mib"] for r in cheap) / per_layer["xla_mib"])
  return summary


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="llama,llama_scan,nnx_scan,gpt2,t5")
  parser.add_argument("--max_rounds", type=int, default=24,
                      help="rounds compiled per workload (24: every round of a plan)")
  parser.add_argument("--out", default=RESULTS)
  parser.add_argument("--no_layer_groups", action="store_true",
                      help="plan with each value offered alone, not a layer's as one "
                           "candidate (remat.LAYER_GROUPS off; or JAX_SYMMEM_LAYER_GROUPS=0)")
  parser.add_argument("--replay", help="a results file of this script: its XLA figures, no compiles")
  args = parser.parse_args(argv)
  if args.replay:
    recorded = json.loads(pathlib.Path(args.replay).read_text())
    _common.run_workloads(",".join(r["workload"] for r in recorded["results"]),
                          lambda name: replay(next(r for r in recorded["results"]
                                                   if r["workload"] == name)),
                          args.out, budget_factor=BUDGET_FACTOR,
                          xla_figures_from={k: recorded[k] for k in ("git_revision", "date", "command")})
    return 0
  remat.LAYER_GROUPS = remat.LAYER_GROUPS and not args.no_layer_groups
  _common.run_workloads(args.workloads, lambda name: run_workload(name, args.max_rounds),
                        args.out, budget_factor=BUDGET_FACTOR)   # environment says layer_groups
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
