"""Benchmark: how long planning takes at the paper's scale, and that faster planning plans the same.

Part 1 (`--presets`): each Llama preset is planned in a fresh process, stage by stage as
`analysis.analyze_traced` runs them: tracing with symbolic dims, the shape graph, the
memory-aware schedule, the remat rounds. Wall and CPU seconds per stage, their shares,
the program's size. `llama2_1b` is the paper's workload (1.26 B parameters, 9,330
nodes); `llama2_7b` has Llama-2-7B's shape (32 layers, d_model 4096).

Part 2 (`--workloads`): the modeled peaks of `experiments.decisions`' workloads at
sampled shapes (the schedule as dispatched, every remat round, and the static anchor
`peak_bytes / static_peak_bytes`), each workload in a fresh process. With `--tree` the
planner is imported from another checkout (a `git worktree` of an earlier revision),
which records the reference that `--reference` then compares with: no figure may be more
than 0.5 % above the reference's (a lower one is a better plan).

  python -m experiments.bench_plan_time [--presets llama2_1b,llama2_7b]
      [--workloads llama,llama_scan,gpt2,hf_llama,llama2_1b] [--tree PATH]
      [--reference PATH] [--out PATH]

Writes experiments/results/bench_plan_time.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # also run as `python experiments/bench_plan_time.py`

from experiments import _common  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "bench_plan_time.json"
STAGES = ("trace", "shape_graph", "schedule", "remat")
LENGTHS = (64, 256, 512, 1024)
BATCH = 4
TOLERANCE = 0.005

# One preset planned stage by stage (argv: preset).
_TIMING_CHILD = """
import json, resource, sys, time
import jax, jax.numpy as jnp
import jax_symmem as symmem
from jax_symmem._src import remat, schedule
from jax_symmem.examples import llama
cfg = llama.PRESETS[sys.argv[1]]
state = jax.eval_shape(lambda: llama.init_state(cfg))
fn = llama.train_step_fn(llama.Llama(cfg))
tokens = jax.ShapeDtypeStruct((4, 128), jnp.int32)
mask = jax.ShapeDtypeStruct((4, 128), jnp.float32)
wall, cpu, out = {}, {}, {}
def stage(name, f):
  t, c = time.perf_counter(), time.process_time()
  r = f()
  wall[name], cpu[name] = round(time.perf_counter() - t, 3), round(time.process_time() - c, 3)
  return r
traced = stage("trace", lambda: symmem.trace(fn, state, tokens, mask,
                                             polymorphic_shapes=(None, "b, s", "b, s"),
                                             constraints=llama.step_constraints(cfg.max_len, 16)))
graph = stage("shape_graph", lambda: symmem.shape_graph(traced))
sched = stage("schedule", lambda: schedule.schedule(graph))
rounds, stats = stage("remat", lambda: remat.plan_rounds(graph, sched.order))
print(json.dumps({"wall": wall, "cpu": cpu, "nodes": len(traced.program.nodes),
                  "rounds": len(rounds) - 1, "schedule_comparisons": sched.stats["comparisons"],
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""

# One decisions workload's modeled peaks (argv: workload, lengths JSON, batch).
_PEAKS_CHILD = """
import json, sys
import jax, jax.numpy as jnp
import jax_symmem as symmem
from jax_symmem._src import analysis as analysis_lib
from experiments import decisions
name, lengths, batch = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
fn, state, info = decisions.build(name, False)
max_len = min(1024, info["config"].get("max_len", info["config"].get("max_position_embeddings", 1024)))
lengths = [L for L in lengths if L <= max_len]
spec = jax.ShapeDtypeStruct((batch, lengths[0]), jnp.int32)
mask = jax.ShapeDtypeStruct((batch, lengths[0]), jnp.float32)
traced = symmem.trace(fn, state, spec, mask, polymorphic_shapes=decisions.SHAPES,
                      constraints=("s >= 2", f"s <= {max_len}", "b <= 16"))
a = analysis_lib.analyze_traced(traced)
rows = []
for L in lengths:
  dims = {"b": batch, "s": L}
  rows.append({"s": L, "peak": a.peak_bytes(**dims), "static": a.static_peak_bytes(**dims),
               "rounds": [a.round_peak(k, dims) for k in range(len(a.rounds))]})
print(json.dumps({"nodes": len(traced.program.nodes), "rows": rows}))
"""


def _child(code: str, args: list[str], tree: str | None) -> dict:
  """Runs `code` in a fresh Python with the planner from `tree` (default: this checkout)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([tree or str(ROOT), str(ROOT)] +
                                      ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return _common.run_python(code, args, env, cwd=tree or ROOT)   # cwd: the tree comes first


def time_presets(presets: list[str], tree: str | None) -> dict:
  results = {}
  for preset in presets:
    r = _child(_TIMING_CHILD, [preset], tree)
    total = sum(r["wall"].values())
    r["total_wall"], r["total_cpu"] = round(total, 3), round(sum(r["cpu"].values()), 3)
    r["share"] = {k: round(v / total, 3) for k, v in r["wall"].items()}
    results[preset] = r
    print(f"{preset:>10}  {r['nodes']:>6} nodes  {total:7.2f} s wall  {r['total_cpu']:7.2f} s CPU  "
          + "  ".join(f"{k} {r['wall'][k]:.2f} s ({100 * r['share'][k]:.0f} %)" for k in STAGES),
          flush=True)
  return results


def peaks(workloads: list[str], tree: str | None) -> dict:
  out = {}
  for name in workloads:
    out[name] = _child(_PEAKS_CHILD, [name, json.dumps(LENGTHS), str(BATCH)], tree)
    worst = max(row["peak"] / row["static"] for row in out[name]["rows"])
    print(f"{name:>10}  {out[name]['nodes']:>6} nodes  peak/static <= {worst:.4f}", flush=True)
  return out


def compare(now: dict, reference: dict) -> dict:
  """Per workload, how much worse (drop) and better (gain) than the reference the plan's
  quality figures are: the peak as dispatched without a budget (round 0 at its best
  order), the static anchor, and the remat floor (the lowest round)."""
  out = {}
  for name, r in now.items():
    if name not in reference:
      continue
    ratios = []
    for row, ref in zip(r["rows"], reference[name]["rows"]):
      assert row["s"] == ref["s"], (row["s"], ref["s"])
      ratios += [row["peak"] / ref["peak"], row["static"] / ref["static"],
                 min(row["rounds"]) / min(ref["rounds"])]
    out[name] = {"drop": max(ratios) - 1, "gain": 1 - min(ratios)}
    print(f"{name:>10}  vs reference: worst {100 * out[name]['drop']:+.3f} %, best "
          f"{-100 * out[name]['gain']:+.3f} %  [{'ok' if out[name]['drop'] <= TOLERANCE else 'DROP'}]")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--presets", default="llama2_1b,llama2_7b",
                      help="Llama presets to time, comma-separated ('' for none)")
  parser.add_argument("--workloads", default="llama,llama_scan,gpt2,hf_llama,llama2_1b",
                      help="experiments.decisions workloads whose peaks to record ('' for none)")
  parser.add_argument("--tree", help="import the planner from this checkout instead")
  parser.add_argument("--reference", help="a results file of this script to compare peaks with")
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args(argv)
  split = lambda s: [x for x in s.split(",") if x]
  speed = _common.python_speed_us()   # timings move with the machine's speed
  if args.presets:
    print(f"this machine's Python speed: {speed:.0f} us for the reference loop", flush=True)
  result = {"environment": {"python_loop_us": speed},
            "tree": args.tree or str(ROOT), "tree_revision": _common.git_revision(args.tree),
            "lengths": list(LENGTHS), "batch": BATCH,
            "timing": time_presets(split(args.presets), args.tree),
            "peaks": peaks(split(args.workloads), args.tree)}
  if args.reference:
    ref = json.loads(pathlib.Path(args.reference).read_text())
    result["reference"] = {"path": args.reference, "tree_revision": ref.get("tree_revision"), "timing": ref.get("timing"),
                           "quality_vs_reference": compare(result["peaks"], ref["peaks"])}
  print("wrote", _common.write_results(args.out, result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
