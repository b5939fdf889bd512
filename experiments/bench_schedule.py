"""Benchmark: symbolic memory-aware scheduling of a transformer training step.

One trace of the step in experiments/workloads.py with symbolic dims (b, s),
one symbolic schedule for every shape, and at each sequence length:

* the modeled peak (MiB) in trace order, in the symbolic schedule's order, in
  the order of the scheduler run on that exact shape (the static anchor: one
  schedule per shape), and in the ablation's order (`symbolic=False`: every
  choice by the size-blind fallback);
* the list-scheduler candidates before the local sink pass (forward / backward,
  symbolic vs fallback comparisons), to show where the symbolic decisions matter;
* with --real (default), the real peak of the reference executor (DESIGN.md F7)
  measured with the F3 protocol in a fresh process (`jax_symmem.measure`), in
  trace order and in the symbolic order: real = peak_delta + argument bytes
  (the arguments are resident before the call), against the op-level modeled
  peak; ok when |real - model| <= 5 % of model + 8 MiB;
* a check: the symbolic schedule's modeled peak <= trace order's, per length.

It also times scheduling: the symbolic schedule once vs the static one per shape.

  python -m experiments.bench_schedule [--lengths 64,128,256,512,1024] [--batch 4]
                                       [--real | --noreal] [--repeats 2] [--cached] [--quick]

Prints a table and writes experiments/results/bench_schedule.json.

Known offset (jax 0.10.2): `executor.execute` re-specializes the program on every
call and the re-traced scatter-add `update_jaxpr` param defeats JAX's executable
cache, so the measured call recompiles the 4 scatter-adds and keeps ~6 MiB of
compiler memory: real reads ~6-7 MiB above the model. `--cached` also measures
`reference_executor_cached` (one specialized program for both calls), which
does not recompile.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from experiments import _common  # noqa: E402
from experiments import workloads  # noqa: E402
from experiments._common import MiB  # noqa: E402
from jax_symmem import measure as measure_lib  # noqa: E402
from jax_symmem._src import compare as compare_lib  # noqa: E402
from jax_symmem._src import memory  # noqa: E402
from jax_symmem._src import schedule as schedule_lib  # noqa: E402
from jax_symmem.examples import transformer  # noqa: E402

WORKLOAD = "experiments.workloads:reference_executor"
CACHED_WORKLOAD = "experiments.workloads:reference_executor_cached"
REL_TOL, ABS_TOL = 0.05, 8 * MiB
RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "bench_schedule.json"


def _within(real: int, model: int) -> bool:
  return abs(real - model) <= REL_TOL * model + ABS_TOL


def _candidates(sym, abl):
  """Forward/backward list-scheduler orders before the sink pass, symbolic and fallback:
  each schedule's "forward" / "backward" candidates (at the main shape of interest)."""
  return {f"{label}_{name}": s.candidates[name]
          for label, s in (("sym", sym), ("abl", abl)) for name in ("forward", "backward")}


def _measure(workload: str, batch: int, seq: int, order: str, repeats: int):
  runs = []
  for _ in range(repeats):
    t = time.perf_counter()
    m = measure_lib.measure(workload, batch=batch, seq=seq, order=order)
    runs.append({"peak_delta": m.peak_delta, "rss_before": m.rss_before, "hwm": m.hwm,
                 "extra": dict(m.extra), "seconds": round(time.perf_counter() - t, 2)})
  return runs


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", default="64,128,256,512,1024",
                      help="comma-separated sequence lengths (the trace allows 2 <= s <= 1024)")
  parser.add_argument("--batch", type=int, default=4, help="batch size (the trace allows b <= 16)")
  _common.add_bool_flag(parser, "real", True,
                        "measure the reference executor's real peak (fresh process per figure)")
  parser.add_argument("--repeats", type=int, default=2, help="real measurements per length and order")
  parser.add_argument("--cached", action="store_true",
                      help="also measure reference_executor_cached (one specialized program for "
                           "every call: no scatter-add recompiles in the measured call)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: short lengths, batch 2, one real measurement at the longest")
  parser.add_argument("--out", default=str(RESULTS))
  args = parser.parse_args(argv)
  if args.quick:
    args.lengths, args.batch, args.repeats = "16,32,64,128,256", 2, 1
  lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
  real_lengths = ([lengths[-1]] if args.quick else lengths) if args.real else []
  batch = args.batch
  t_start = time.perf_counter()

  # --- trace and the two shape-independent schedules -----------------------------
  t = time.perf_counter()
  traced, graph = workloads.traced_step()
  program = graph.traced.program
  t_trace = time.perf_counter() - t
  tight = graph.constraints.complete(dict(graph.max_dims()))

  compare_lib.compare_polys.cache_clear()   # cold: every comparison decided from scratch
  t = time.perf_counter()
  sym = schedule_lib.schedule(graph)
  t_sym = time.perf_counter() - t
  t = time.perf_counter()
  abl = schedule_lib.schedule(graph, symbolic=False)
  t_abl = time.perf_counter() - t
  for s in (sym, abl):
    assert schedule_lib.is_valid_order(program, s.order), s.mode
  trace_order = tuple(range(len(program.nodes)))
  cands = _candidates(sym, abl)

  # --- modeled peaks per length ------------------------------------------------------
  rows = []
  static_times = []
  for L in lengths:
    dims = {"b": batch, "s": L}
    t = time.perf_counter()
    st = schedule_lib.schedule(graph, dims=dims)
    static_times.append(time.perf_counter() - t)
    assert schedule_lib.is_valid_order(program, st.order)
    peak = lambda order: memory.peak_at(graph, dims, order=order)
    row = {
        "seq": L, "batch": batch,
        "model_trace": peak(trace_order), "model_symbolic": peak(sym.order),
        "model_static": peak(st.order), "model_ablation": peak(abl.order),
        "static_source": st.source, "static_seconds": round(static_times[-1], 3),
        "static_stats": dict(st.stats),
        # op-level figures (no control-flow working sets): what the reference executor tracks
        "model_op_trace": memory.profile(graph, order=trace_order).peak_bytes(
            include_transients=False, **dims),
        "model_op_symbolic": memory.profile(graph, order=sym.order).peak_bytes(
            include_transients=False, **dims),
        "model_arguments": memory.profile(graph).arguments.evaluate(graph.constraints.complete(dims)),
    }
    row["check_symbolic_le_trace"] = row["model_symbolic"] <= row["model_trace"]
    if cands is not None:
      row["candidates"] = {k: peak(o) for k, o in cands.items()}
    rows.append(row)

  # --- real peaks ---------------------------------------------------------------------
  t_real = time.perf_counter()
  for row in rows:
    L = row["seq"]
    if L not in real_lengths:
      continue
    arg_bytes = _common.tree_bytes(transformer.example_args(workloads.CONFIG, batch, L))
    row["real_argument_bytes"] = arg_bytes
    variants = [("", WORKLOAD)] + ([("cached_", CACHED_WORKLOAD)] if args.cached else [])
    for (prefix, workload), key in itertools.product(variants, ("trace", "symbolic")):
      runs = _measure(workload, batch, L, key, args.repeats)
      reals = [r["peak_delta"] + arg_bytes for r in runs]
      model = row[f"model_op_{key}"]
      real = int(statistics.median(reals))
      row[f"{prefix}real_{key}"] = {
          "runs": runs, "real": real, "real_min": min(reals), "real_max": max(reals),
          "model": model, "diff": real - model, "ok": _within(real, model),
          # the child recomputes the order and its model; they must match ours
          "child_model_matches": all(r["extra"].get("model_peak") == row[f"model_{key}"]
                                     for r in runs),
      }
  t_real = time.perf_counter() - t_real

  # --- print --------------------------------------------------------------------------
  print(f"transformer step {workloads.CONFIG}, {len(program.nodes)} top-level ops, "
        f"constraints {workloads.CONSTRAINTS}; batch {batch}; jax {jax.__version__}")
  print(f"symbolic schedule: winner '{sym.source}'; ablation: winner '{abl.source}'; "
        f"same final order: {sym.order == abl.order}")
  print()
  hdr = (f"{'seq':>5} | {'modeled peak MiB':^39} | {'sym<=':^5} | {'real vs model, trace order':^28} | "
         f"{'real vs model, symbolic order':^28}")
  sub = (f"{'':>5} | {'trace':>9}{'symbolic':>10}{'static':>10}{'ablation':>10} | {'trace':^5} | "
         f"{'real':>8}{'model':>8}{'diff':>8} {'ok':>3} | {'real':>8}{'model':>8}{'diff':>8} {'ok':>3}")
  print(hdr)
  print(sub)
  print("-" * len(sub))
  for row in rows:
    line = (f"{row['seq']:>5} | {row['model_trace'] / MiB:>9.1f}{row['model_symbolic'] / MiB:>10.1f}"
            f"{row['model_static'] / MiB:>10.1f}{row['model_ablation'] / MiB:>10.1f} | "
            f"{'PASS' if row['check_symbolic_le_trace'] else 'FAIL':^5} |")
    for key in ("trace", "symbolic"):
      r = row.get(f"real_{key}")
      if r is None:
        line += f" {'-':>8}{'-':>8}{'-':>8} {'-':>3} |"
      else:
        line += (f" {r['real'] / MiB:>8.1f}{r['model'] / MiB:>8.1f}{r['diff'] / MiB:>+8.1f} "
                 f"{'yes' if r['ok'] else 'NO':>3} |")
    print(line.rstrip("|").rstrip())
  print()
  print("real = peak_delta (VmHWM - VmRSS, F3 protocol, median of "
        f"{args.repeats}) + argument bytes; model = op-level modeled peak of that order; "
        f"ok: |real - model| <= {REL_TOL:.0%} of model + {ABS_TOL // MiB} MiB")
  spreads = [(row["seq"], k, (row[f"real_{k}"]["real_max"] - row[f"real_{k}"]["real_min"]) / MiB)
             for row in rows for k in ("trace", "symbolic") if f"real_{k}" in row]
  if spreads and args.repeats > 1:
    print("repeat spread (max - min) MiB: " + ", ".join(f"s={L} {k[:3]} {v:.2f}" for L, k, v in spreads))
  mism = [(row["seq"], p + k) for row in rows for p in ("", "cached_") for k in ("trace", "symbolic")
          if f"{p}real_{k}" in row and not row[f"{p}real_{k}"]["child_model_matches"]]
  if mism:
    print(f"WARNING: the measuring process modeled a different peak (order differs?) at {mism}")
  if args.cached:
    print(f"same, with {CACHED_WORKLOAD.split(':')[1]} (program specialized once):")
    for row in rows:
      parts = [f"{k} real {row[f'cached_real_{k}']['real'] / MiB:.1f} model "
               f"{row[f'cached_real_{k}']['model'] / MiB:.1f} diff "
               f"{row[f'cached_real_{k}']['diff'] / MiB:+.1f} "
               f"{'yes' if row[f'cached_real_{k}']['ok'] else 'NO'}"
               for k in ("trace", "symbolic") if f"cached_real_{k}" in row]
      if parts:
        print(f"  s={row['seq']:>5}: " + "; ".join(parts))
  transient_rows = [row["seq"] for row in rows
                    if row["model_op_trace"] != row["model_trace"]
                    or row["model_op_symbolic"] != row["model_symbolic"]]
  if transient_rows:
    print(f"note: control-flow working sets change the modeled peak at {transient_rows}")
  print()

  print("check: symbolic schedule's modeled peak <= trace order's at every length")
  for row in rows:
    print(f"  s={row['seq']:>5}: {row['model_symbolic'] / MiB:9.1f} <= {row['model_trace'] / MiB:9.1f}  "
          f"{'PASS' if row['check_symbolic_le_trace'] else 'FAIL'}")
  print()

  keys = ("choices", "comparisons", "decided", "depends", "fallback", "sink_moves")
  print("decision counts (per schedule, over the forward and backward list passes):")
  print(f"  {'':<10}" + "".join(f"{k:>12}" for k in keys) + f"{'winner':>10}")
  for name, s in (("symbolic", sym), ("ablation", abl)):
    print(f"  {name:<10}" + "".join(f"{s.stats.get(k, 0):>12}" for k in keys) + f"{s.source:>10}")
  c = sym.stats.get("comparisons", 0) or 1
  print(f"  symbolic comparisons: {sym.stats['decided'] / c:.1%} decided for every shape, "
        f"{sym.stats['depends'] / c:.1%} DEPENDS (resolved at b={tight['b']}, s={tight['s']}), "
        f"{sym.stats['fallback'] / c:.1%} fallback")
  print(f"  candidates' modeled peaks at b={tight['b']}, s={tight['s']} (MiB, before the sink pass): "
        + "; ".join(f"{name}: " + ", ".join(f"{k[5:]} {s.stats[k] / MiB:.0f}"
                                            for k in ("peak_forward", "peak_backward", "peak_trace"))
                    for name, s in (("symbolic", sym), ("ablation", abl))))
  print()

  if cands is not None:
    print("list-scheduler candidates before the sink pass, modeled peak MiB "
          "(symbolic comparisons vs fallback only):")
    ck = ("sym_forward", "abl_forward", "sym_backward", "abl_backward")
    print(f"  {'seq':>5}{'trace':>10}" + "".join(f"{k:>14}" for k in ck))
    for row in rows:
      print(f"  {row['seq']:>5}{row['model_trace'] / MiB:>10.1f}"
            + "".join(f"{row['candidates'][k] / MiB:>14.1f}" for k in ck))
    print()

  total_static = sum(static_times)
  print("scheduling time:")
  print(f"  trace + shape graph: {t_trace:.2f} s")
  print(f"  symbolic schedule (once, cold comparison cache): {t_sym:.2f} s; ablation: {t_abl:.2f} s")
  print("  static schedule per shape: " + ", ".join(f"s={r['seq']} {r['static_seconds']:.2f} s"
                                                    for r in rows)
        + f"; total {total_static:.2f} s for {len(rows)} shapes "
        f"(mean {total_static / len(rows):.2f} s; symbolic / mean static = "
        f"{t_sym / (total_static / len(rows)):.2f})")
  if real_lengths:
    print(f"  real measurements: {t_real:.1f} s")
  runtime = time.perf_counter() - t_start
  print(f"total runtime: {runtime:.1f} s")

  out = {
      "benchmark": "bench_schedule",
      "config": {"model": str(workloads.CONFIG), "constraints": list(workloads.CONSTRAINTS),
                 "batch": batch, "lengths": lengths, "real_lengths": real_lengths,
                 "repeats": args.repeats, "quick": args.quick, "cached": args.cached,
                 "workloads": [WORKLOAD] + ([CACHED_WORKLOAD] if args.cached else []),
                 "tolerance": {"relative": REL_TOL, "absolute_bytes": ABS_TOL}},
      "environment": {"backend": jax.default_backend()},
      "ops": len(program.nodes),
      "tight_dims": {k: tight[k] for k in ("b", "s")},
      "schedules": {
          name: {"stats": dict(s.stats), "source": s.source, "seconds": round(t_s, 3)}
          for name, s, t_s in (("symbolic", sym, t_sym), ("ablation", abl, t_abl))},
      "same_order_symbolic_ablation": sym.order == abl.order,
      "timing": {"trace_seconds": round(t_trace, 3), "symbolic_seconds": round(t_sym, 3),
                 "ablation_seconds": round(t_abl, 3),
                 "static_seconds": [round(x, 3) for x in static_times],
                 "static_total_seconds": round(total_static, 3),
                 "real_seconds": round(t_real, 1), "total_seconds": round(runtime, 1)},
      "rows": rows,
      "all_symbolic_le_trace": all(r["check_symbolic_le_trace"] for r in rows),
  }
  print(f"wrote {_common.write_results(args.out, out)}")
  return 0 if out["all_symbolic_le_trace"] else 1


if __name__ == "__main__":
  sys.exit(main())
