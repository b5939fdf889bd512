"""symmem.jit under a memory budget vs jax.jit and per-layer jax.checkpoint, on a Llama-style step.

For the transformer training step of jax_symmem/examples/transformer.py (f32):
 1. real peaks (DESIGN.md F3 protocol, jax_symmem.measure, a fresh process each) of jax.jit
    without remat and with per-layer jax.checkpoint at every length, the latter compiled
    with compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"} ("fenced"; without
    it XLA:CPU merges the recomputation back, F1) and, at the longest length, also unfenced;
    the budget is halfway between the no-remat and the fenced per-layer peaks at the longest length;
 2. per length, the real peak of symmem.jit's step under that budget, the round it dispatched
    and XLA's memory_analysis() footprint of that executable;
    check real <= budget * 1.05 + 8 MiB, and round 0 at the shortest length;
 3. numerics: loss and updated params of symmem.jit's step vs jax.jit, rtol 1e-5;
 4. the memory model: Analysis.peak_bytes / static_peak_bytes (<= 1.01), baseline_peak_bytes,
    and the modeled peak of the dispatched round vs the real peak;
 5. step-time ratios in this one process (warm, median of several calls): symmem.jit vs jax.jit
    without remat, vs per-layer checkpoint (fenced), vs the fastest single per-layer checkpoint
    policy whose real peak fits the budget at the longest length (applied at every length);
    and symmem.jit's dispatch overhead on a cache hit for a tiny model;
 6. the analysis' decision counts and the rematerialization plan.

Real peak = peak_delta (VmHWM - VmRSS around the measured call) + the bytes of the step's
arguments (params, tokens, mask), which are resident before the call.

  python -m experiments.bench_remat            # the full run (~10-15 min on 2 cores)
  python -m experiments.bench_remat --quick    # smoke run: 2 small layers, short lengths
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_symmem as symmem  # noqa: E402
from jax_symmem._src import jit as jit_lib  # noqa: E402  (reads CPU_COMPILER_OPTIONS only)
from jax_symmem.examples import transformer  # noqa: E402
from experiments import _common  # noqa: E402
from experiments import workloads  # noqa: E402
from experiments._common import MiB  # noqa: E402

POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")
FENCE = _common.REMAT_FENCE_OPTIONS


def _mib(x):
  return None if x is None else x / MiB


def _fmt(x, width=8, prec=1):
  return f"{'-':>{width}}" if x is None else f"{x:>{width}.{prec}f}"


# --- measurements in fresh processes ------------------------------------------------------

def _measure_baseline(batch, seq, cfg, policy, fenced):
  t = time.perf_counter()
  m = _common.real_peak("experiments.workloads:remat_baseline_step", batch=batch, seq=seq,
                        cfg=cfg, policy=policy, fenced=fenced)
  return {"policy": policy, "fenced": fenced, "seq": seq, "peak_delta": m["peak_delta"],
          "argument_bytes": m["argument_bytes"], "real": m["real"], "xla": m["xla"],
          "compiler_options": m["compiler_options"],
          "seconds": round(time.perf_counter() - t, 1)}


def _measure_symmem(batch, seq, cfg, budget, constraints):
  t = time.perf_counter()
  e = _common.real_peak("experiments.workloads:remat_symmem_step", batch=batch, seq=seq,
                        cfg=cfg, budget=budget, constraints=list(constraints))
  info = e["cache_info"]
  return {"seq": seq, "peak_delta": e["peak_delta"], "argument_bytes": e["argument_bytes"],
          "real": e["real"], "round": e["round"],
          "model_round": e["model_round"], "n_rounds": e["n_rounds"],
          "model_peak_dispatched": e["model_peak_dispatched"], "xla": e["xla"],
          "first_call_s": e["first_call_s"], "cache_info": info, "executables": e["executables"],
          "compiled_log": e.get("compiled_log", []),
          # the measured (last) call reused the executable compiled before it
          "measured_call_was_hit": info[-1]["compiles"] == info[0]["compiles"],
          "seconds": round(time.perf_counter() - t, 1)}


def _run_parallel(jobs, fns):
  if jobs <= 1:
    return [f() for f in fns]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    return list(pool.map(lambda f: f(), fns))


# --- numerics and timing in this process ---------------------------------------------------

def _tree_errors(got, want):
  """max |d|, max |d|/|ref|, max |d|/|ref| over |ref| >= 1e-3, elements with |d| > 1e-5|ref|,
  and the check |d| <= 1e-6 + 1e-5 |ref| (the tests' tolerance) everywhere."""
  max_abs = max_rel = max_rel_big = 0.0
  n_rel = 0
  ok = True
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    d = np.abs(g - w)
    rel = d / np.maximum(np.abs(w), 1e-30)
    max_abs = max(max_abs, float(d.max()))
    max_rel = max(max_rel, float(rel.max()))
    big = np.abs(w) >= 1e-3
    if big.any():
      max_rel_big = max(max_rel_big, float(rel[big].max()))
    n_rel += int(np.sum(d > 1e-5 * np.abs(w)))
    ok = ok and bool(np.all(d <= 1e-6 + 1e-5 * np.abs(w)))
  return {"max_abs": max_abs, "max_rel": max_rel, "max_rel_ref_ge_1e-3": max_rel_big,
          "n_over_pure_rtol": n_rel, "ok": ok}


def _time_calls(fns: dict, args, reps: int) -> dict:
  """Median seconds per call of each fn(*args), interleaved; each warmed up first."""
  for f in fns.values():
    out = jax.block_until_ready(f(*args))
    del out
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, f in fns.items():
      gc.collect()
      t = time.perf_counter()
      out = jax.block_until_ready(f(*args))
      times[k].append(time.perf_counter() - t)
      del out
  return {k: statistics.median(v) for k, v in times.items()}


def _baseline_compiled(cfg, args, policy, fenced=True):
  opts = dict(FENCE) if (policy is not None and fenced) else {}
  return jax.jit(transformer.make_train_step(cfg, remat_policy=policy)).lower(*args).compile(
      compiler_options=opts)


def _dispatch_overhead(reps: int, budget: int) -> dict:
  """symmem.jit's call minus its compiled executable's call, same args, tiny model, cache hit."""
  cfg = transformer.Config(vocab=61, d_model=32, n_heads=2, d_ff=64, n_layers=2)
  args = transformer.example_args(cfg, 2, 16)
  out = {}
  for label, b in (("with_budget", budget), ("no_budget", None)):
    step = symmem.jit(transformer.make_train_step(cfg), polymorphic_shapes=workloads.REMAT_SHAPES,
                      constraints=("s >= 2", "s <= 64", "b <= 4"), memory_budget=b)
    jax.block_until_ready(step(*args))
    (exe,) = [v.executable for v in step.compiled()]
    flat = jax.tree_util.tree_leaves(tuple(args))
    fns = {"symmem": lambda *a: step(*args), "executable": lambda *a: exe(*flat)}
    # blocks of calls, interleaved; per-call median within each block, then median of blocks
    per = {k: [] for k in fns}
    for f in fns.values():
      for _ in range(50):
        jax.block_until_ready(f())
    block = 100
    for _ in range(max(1, reps // block)):
      for k, f in fns.items():
        ts = []
        for _ in range(block):
          t = time.perf_counter()
          jax.block_until_ready(f())
          ts.append(time.perf_counter() - t)
        per[k].append(statistics.median(ts))
    # where the overhead goes: the per-call pieces of SymmemFunction.__call__, timed alone
    traced = step.analyze(*args).traced
    def alone(f, n=500):
      t = time.perf_counter()
      for _ in range(n):
        f()
      return (time.perf_counter() - t) / n * 1e6
    parts = {"bind_dims_us": alone(lambda: traced.bind_dims(*args)),
             "live_bytes_us": alone(jit_lib._live_bytes),
             "tree_flatten_us": alone(lambda: jax.tree_util.tree_flatten(tuple(args)))}
    sym, exe_t = statistics.median(per["symmem"]), statistics.median(per["executable"])
    out[label] = {"symmem_us": sym * 1e6, "executable_us": exe_t * 1e6,
                  "overhead_us": (sym - exe_t) * 1e6, "calls": block * max(1, reps // block),
                  "cache_info": step.cache_info(), "live_arrays": len(jax.live_arrays()), **parts}
    del step, exe, fns
  return out


# --- main -----------------------------------------------------------------------------------

def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", default=None, help="default 64,128,256,512,1024 (quick: 16..256)")
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--n_heads", type=int, default=4)
  parser.add_argument("--d_ff", type=int, default=688)
  parser.add_argument("--n_layers", type=int, default=4)
  parser.add_argument("--max_batch", type=int, default=4, help="constraint b <= this")
  parser.add_argument("--repeats", type=int, default=7, help="timed calls per variant and length")
  parser.add_argument("--dispatch_repeats", type=int, default=2000,
                      help="symmem.jit calls timed for the dispatch overhead")
  parser.add_argument("--jobs", type=int, default=2,
                      help="measurement subprocesses at once (memory only; timing runs alone)")
  parser.add_argument("--quick", action="store_true", help="smoke run: small model, short lengths")
  parser.add_argument("--out", default="experiments/results/bench_remat.json")
  a = parser.parse_args(argv)
  if a.quick:
    a.lengths = a.lengths or "16,32,64,128,256"
    a.vocab, a.d_model, a.n_heads, a.d_ff, a.n_layers = 128, 64, 2, 172, 2
    a.repeats, a.dispatch_repeats = 2, 400
    if a.out == parser.get_default("out"):
      a.out = "experiments/results/bench_remat_quick.json"
  lengths = sorted(int(x) for x in (a.lengths or "64,128,256,512,1024").split(",") if x.strip())
  longest, shortest, batch = lengths[-1], lengths[0], a.batch
  cfg = transformer.Config(vocab=a.vocab, d_model=a.d_model, n_heads=a.n_heads, d_ff=a.d_ff,
                           n_layers=a.n_layers)
  cfg_kw = dataclasses.asdict(cfg)
  constraints = ("s >= 2", f"s <= {longest}", f"b <= {a.max_batch}")
  t_start = time.perf_counter()
  checks: list[tuple[str, bool, str]] = []

  def check(name, ok, detail=""):
    checks.append((name, bool(ok), detail))

  # --- 1. baselines' real peaks (fresh processes) ---------------------------------------
  t = time.perf_counter()
  jobs = []
  for s in lengths:
    jobs.append((s, None, True))
    jobs.append((s, "layer", True))
  jobs.append((longest, "layer", False))
  jobs += [(longest, p, True) for p in POLICIES]
  results = _run_parallel(a.jobs, [lambda j=j: _measure_baseline(batch, j[0], cfg_kw, j[1], j[2])
                                   for j in jobs])
  base = {(r["seq"], r["policy"], r["fenced"]): r for r in results}
  t_baselines = time.perf_counter() - t
  nope_long = base[(longest, None, True)]["real"]
  layer_long = base[(longest, "layer", True)]["real"]
  budget = _common.budget_between(layer_long, nope_long)
  if not a.quick:
    check(f"no-remat real peak at s={longest} >= 200 MiB", nope_long >= 200 * MiB,
          f"{nope_long / MiB:.1f} MiB")
  check("per-layer checkpoint (fenced) below no remat at the longest length", layer_long < nope_long,
        f"{layer_long / MiB:.1f} vs {nope_long / MiB:.1f} MiB")
  fitting = [p for p in ("layer",) + POLICIES if base[(longest, p, True)]["real"] <= budget]

  # --- 2. symmem.jit's real peaks under the budget (fresh processes) ------------------------
  t = time.perf_counter()
  sym = _run_parallel(a.jobs, [lambda s=s: _measure_symmem(batch, s, cfg_kw, budget, constraints)
                               for s in lengths])
  sym = {r["seq"]: r for r in sym}
  t_symmem_measure = time.perf_counter() - t

  # --- dispatch overhead (this process, before anything else is live) -----------------
  overhead = _dispatch_overhead(a.dispatch_repeats, budget)

  # --- 3./4. analysis, numerics and timing (this process) -----------------------------
  step_fn = transformer.make_train_step(cfg)
  step = symmem.jit(step_fn, polymorphic_shapes=workloads.REMAT_SHAPES, constraints=constraints,
                    memory_budget=budget)
  t = time.perf_counter()
  analysis = step.analyze(*transformer.example_args(cfg, batch, 8))
  t_analysis = time.perf_counter() - t
  ref = jax.jit(step_fn)
  n_param_elems = sum(x.size for x in jax.tree_util.tree_leaves(transformer.example_args(cfg, 1, 2)[0]))
  rows = []
  t_static = 0.0
  for s in lengths:
    dims = {"b": batch, "s": s}
    row = {"seq": s, "batch": batch}
    try:
      row["model_peak"] = analysis.peak_bytes(**dims)
      row["model_round"] = analysis.choose_round(dims, budget)
    except symmem.BudgetError as e:
      row["model_peak"], row["model_round"], row["model_error"] = None, None, str(e)
    t = time.perf_counter()
    row["static_peak"] = analysis.static_peak_bytes(**dims)
    t_static += time.perf_counter() - t
    row["baseline_model_peak"] = analysis.baseline_peak_bytes(**dims)
    row["round_peaks"] = [r.peak_at(dims) for r in analysis.rounds]
    rows.append(row)

  t = time.perf_counter()
  for row in rows:
    s = row["seq"]
    args = transformer.example_args(cfg, batch, s)
    # what symmem.jit will see as held by other live arrays (it adds this to the modeled peak)
    row["reserved_here"] = max(0, jit_lib._live_bytes() - _common.tree_bytes(args))
    got = jax.block_until_ready(step(*args))
    row["round_here"] = [v.round for v in step.compiled(b=batch, s=s)]
    want = jax.block_until_ready(ref(*args))
    # noise floor: plain jax.jit compiled with symmem.jit's CPU options vs jax.jit's defaults
    floor = jax.block_until_ready(jax.jit(step_fn).lower(*args).compile(
        compiler_options=jit_lib.CPU_COMPILER_OPTIONS)(*args))
    p, l = _tree_errors(got[1], want[1]), _tree_errors(got[0], want[0])
    f = _tree_errors(floor[1], want[1])
    row["numerics"] = {"loss_symmem": float(got[0]), "loss_jax": float(want[0]),
                       "loss_abs": l["max_abs"], "loss_rel": l["max_rel"], "params": p,
                       "floor_params": f, "ok": p["ok"] and l["ok"]}
    del got, want, floor, args
  t_numerics = time.perf_counter() - t

  # --- 5. step times: longest first (it picks the policy), then every length ---------------
  t = time.perf_counter()
  best_policy = None
  for row in sorted(rows, key=lambda r: -r["seq"]):
    s = row["seq"]
    args = transformer.example_args(cfg, batch, s)
    fns = {"symmem": step, "jax_jit": _baseline_compiled(cfg, args, None),
           # jax.jit compiled with the options symmem.jit uses under a budget: their cost alone
           "jax_jit_symmem_options": jax.jit(step_fn).lower(*args).compile(
               compiler_options=jit_lib.CPU_COMPILER_OPTIONS),
           "layer": _baseline_compiled(cfg, args, "layer")}
    if s == longest:
      for p in fitting:
        if p != "layer":
          fns[p] = _baseline_compiled(cfg, args, p)
    elif best_policy not in (None, "layer"):
      fns[best_policy] = _baseline_compiled(cfg, args, best_policy)
    compiles_before = step.cache_info()["compiles"]
    times = _time_calls(fns, args, a.repeats)
    row["times"] = times
    row["timing_compiles"] = step.cache_info()["compiles"] - compiles_before
    row["round_timed"] = [v.round for v in step.compiled(b=batch, s=s)]
    if s == longest and fitting:
      best_policy = min(fitting, key=lambda p: times[p])
    if best_policy is not None:
      row["times"]["best_policy"] = times[best_policy]
    del fns, args
    gc.collect()
  t_timing = time.perf_counter() - t

  # --- checks ---------------------------------------------------------------------------
  for row in rows:
    s = row["seq"]
    m = sym[s]
    row["symmem_real"] = m["real"]
    row["nope_real"] = base[(s, None, True)]["real"]
    row["layer_real"] = base[(s, "layer", True)]["real"]
    limit = _common.budget_limit(budget)
    check(f"s={s}: symmem real <= budget*1.05 + 8 MiB", m["real"] <= limit,
          f"{m['real'] / MiB:.1f} vs {limit / MiB:.1f} MiB (round {m['round']})")
    check(f"s={s}: measured call was a cache hit", m["measured_call_was_hit"], str(m["cache_info"][-1]))
    check(f"s={s}: loss and params match jax.jit (|d| <= 1e-6 + 1e-5|ref|)", row["numerics"]["ok"],
          f"max rel {row['numerics']['params']['max_rel']:.2e}, max abs {row['numerics']['params']['max_abs']:.2e}")
    if row["model_peak"] is not None:
      ratio = row["model_peak"] / row["static_peak"]
      row["peak_over_static"] = ratio
      check(f"s={s}: Analysis.peak_bytes / static_peak_bytes <= 1.01", ratio <= 1.01, f"{ratio:.3f}")
    else:
      check(f"s={s}: Analysis.peak_bytes defined under the budget", False, row["model_error"])
    check(f"s={s}: this process dispatched the measured round", row["round_here"] == [m["round"]],
          f"{row['round_here']} vs {m['round']}; live bytes besides the arguments here: "
          f"{row['reserved_here'] / MiB:.2f} MiB")
  check(f"s={shortest}: dispatched round is 0", sym[shortest]["round"] == 0,
        f"round {sym[shortest]['round']}")
  for label, o in overhead.items():
    check(f"dispatch overhead on a cache hit ({label}) <= 200 us", o["overhead_us"] <= 200,
          f"{o['overhead_us']:.0f} us")

  # --- print ----------------------------------------------------------------------------
  runtime = time.perf_counter() - t_start
  print(f"transformer step {cfg}, f32, batch {batch}, constraints {constraints}; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} cpus")
  print(f"real peak = peak_delta (VmHWM - VmRSS around the measured call, F3 protocol, fresh process) "
        f"+ argument bytes (params, tokens, mask: {sym[longest]['argument_bytes'] / MiB:.1f} MiB at s={longest})")
  print(f"per-layer jax.checkpoint baselines compiled with compiler_options={FENCE} ('fenced', F1) "
        f"unless marked unfenced; jax.jit without remat with default options; symmem.jit compiles its "
        f"budgeted variants with {jit_lib.CPU_COMPILER_OPTIONS}")
  print()
  print(f"1. real peaks at s={longest}, MiB (XLA memory_analysis footprint = args + outputs + temp - alias):")
  for key in [(longest, None, True), (longest, "layer", True), (longest, "layer", False)] + \
             [(longest, p, True) for p in POLICIES]:
    r = base[key]
    name = "jax.jit, no remat" if key[1] is None else \
        f"per-layer checkpoint {key[1]}" + ("" if key[2] else " (UNFENCED)")
    print(f"   {name:<52} real {r['real'] / MiB:8.1f}   XLA {r['xla'].get('footprint', 0) / MiB:8.1f}"
          f"   {'fits' if r['real'] <= budget else 'over'} budget")
  print(f"   budget = (no remat + per-layer fenced) / 2 = ({nope_long / MiB:.1f} + {layer_long / MiB:.1f}) / 2"
        f" = {budget / MiB:.1f} MiB ({budget} B)")
  print(f"   policies that fit the budget at s={longest}: {fitting}; fastest of them: {best_policy}")
  print()
  print("2./4. per length, MiB. real = measured; round = dispatched (model's choice before XLA's check);")
  print("      XLA = memory_analysis footprint of the dispatched executable; model = modeled peak of the")
  print("      dispatched round; peak = Analysis.peak_bytes, static = static_peak_bytes, base = baseline_peak_bytes")
  hdr = (f"{'seq':>5} {'nope':>7} {'layer':>7} {'symmem':>7} {'<=lim':>5} {'round':>7} {'XLA':>7} "
         f"{'model':>7} {'mod/real':>8} {'peak':>7} {'static':>7} {'pk/st':>6} {'base':>7} {'base/nope':>9}")
  print(hdr)
  for row in rows:
    s, m = row["seq"], sym[row["seq"]]
    limit_ok = m["real"] <= _common.budget_limit(budget)
    print(f"{s:>5} {row['nope_real'] / MiB:7.1f} {row['layer_real'] / MiB:7.1f} {m['real'] / MiB:7.1f} "
          f"{'ok' if limit_ok else 'FAIL':>5} {m['round']:>3}({m['model_round']:>2}) "
          f"{m['xla'].get('footprint', 0) / MiB:7.1f} {m['model_peak_dispatched'] / MiB:7.1f} "
          f"{m['model_peak_dispatched'] / m['real']:8.2f} {_fmt(_mib(row['model_peak']), 7)} "
          f"{row['static_peak'] / MiB:7.1f} {_fmt(row.get('peak_over_static'), 6, 3)} "
          f"{row['baseline_model_peak'] / MiB:7.1f} {row['baseline_model_peak'] / row['nope_real']:9.2f}")
  print("   XLA footprints of every (dims, round) symmem.jit compiled in the measured process:")
  for row in rows:
    for msg in sym[row["seq"]].get("compiled_log", []):
      print("   " + msg.split("jax_symmem: ", 1)[-1])
  print(f"   modeled peak per round at each length (MiB), rounds 0..{len(analysis.rounds) - 1}:")
  for row in rows:
    print(f"   s={row['seq']:>5}: " + " ".join(f"{p / MiB:.0f}" for p in row["round_peaks"]))
  print()
  print(f"3. numerics, symmem.jit vs jax.jit (loss, SGD-updated params, {n_param_elems} elements); check: "
        f"|d| <= 1e-6 + 1e-5|ref| everywhere. rel>=1e-3: max rel over |ref| >= 1e-3; n>rtol: elements")
  print("   with |d| > 1e-5|ref|; floor: jax.jit compiled with symmem.jit's CPU options vs jax.jit defaults")
  for row in rows:
    n = row["numerics"]
    p, f = n["params"], n["floor_params"]
    print(f"   s={row['seq']:>5}: loss {n['loss_symmem']:.6f} vs {n['loss_jax']:.6f} (abs {n['loss_abs']:.1e}); "
          f"params max abs {p['max_abs']:.2e}, max rel {p['max_rel']:.2e}, rel>=1e-3 "
          f"{p['max_rel_ref_ge_1e-3']:.2e}, n>rtol {p['n_over_pure_rtol']}; {'ok' if n['ok'] else 'FAIL'}"
          f"  | floor: max abs {f['max_abs']:.2e}, max rel {f['max_rel']:.2e}, n>rtol {f['n_over_pure_rtol']}")
  print()
  print(f"5. step time, median of {a.repeats} warm calls in this process (seconds; ratio = symmem / other);")
  print(f"   'best' = {best_policy} (fastest policy fitting the budget at s={longest}), used at every length")
  print("   'fits?' = jax.jit's measured real peak <= budget at that length; 'jit+opt' = jax.jit compiled with")
  print("   symmem.jit's CPU options, no remat (what those options alone cost); round = dispatched here")
  print(f"{'seq':>5} {'symmem':>8} {'jax.jit':>8} {'ratio':>6} {'fits?':>5} {'jit+opt':>8} {'ratio':>6} "
        f"{'layer':>8} {'ratio':>6} {'best':>8} {'ratio':>6}  round")
  for row in rows:
    tm = row["times"]
    fits = row["nope_real"] <= budget
    bp = tm.get("best_policy")
    jo = tm["jax_jit_symmem_options"]
    print(f"{row['seq']:>5} {tm['symmem']:8.4f} {tm['jax_jit']:8.4f} {tm['symmem'] / tm['jax_jit']:6.2f} "
          f"{'yes' if fits else 'no':>5} {jo:8.4f} {tm['symmem'] / jo:6.2f} "
          f"{tm['layer']:8.4f} {tm['symmem'] / tm['layer']:6.2f} "
          f"{_fmt(bp, 8, 4)} {_fmt(None if bp is None else tm['symmem'] / bp, 6, 2)}  {row['round_timed']}")
  long_times = next(r["times"] for r in rows if r["seq"] == longest)
  print(f"   at s={longest}, every policy timed: " + ", ".join(
      f"{k} {v:.4f}s" for k, v in long_times.items() if k != "best_policy"))
  print("   dispatch overhead, tiny model (b=2, s=16), cache hit: " + "; ".join(
      f"{label}: symmem {o['symmem_us']:.0f} us - executable {o['executable_us']:.0f} us = "
      f"{o['overhead_us']:.0f} us ({o['calls']} calls, {o['live_arrays']} live arrays)"
      for label, o in overhead.items()))
  o = overhead["with_budget"]
  print(f"   pieces of the call timed alone: traced.bind_dims {o['bind_dims_us']:.0f} us, live_bytes "
        f"{o['live_bytes_us']:.0f} us, tree_flatten {o['tree_flatten_us']:.0f} us")
  print()
  print("6. analysis stats (decision counts):", dict(analysis.stats))
  print(analysis.plan)
  print()
  failed = [c for c in checks if not c[1]]
  print(f"checks: {len(checks) - len(failed)} of {len(checks)} passed")
  for name, ok, detail in checks:
    if not ok:
      print(f"  FAILED: {name}: {detail}")
  timings = {"baselines_s": t_baselines, "symmem_measure_s": t_symmem_measure,
             "analysis_s": t_analysis, "static_peaks_s": t_static, "numerics_s": t_numerics,
             "timing_s": t_timing, "total_s": runtime}
  print("runtime: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))

  _common.write_results(a.out, {
    "config": cfg_kw, "batch": batch, "lengths": lengths, "constraints": constraints,
    "quick": a.quick, "jax": jax.__version__, "budget": budget,
    "fence_options": FENCE, "symmem_options": jit_lib.CPU_COMPILER_OPTIONS,
    "real_peak_definition": "peak_delta + argument bytes (params, tokens, mask)",
    "baselines": [dict(v, key=list(k)) for k, v in base.items()],
    "symmem": list(sym.values()), "rows": rows, "fitting_policies": fitting,
    "best_policy": best_policy, "dispatch_overhead": overhead,
    "analysis_stats": dict(analysis.stats), "plan": analysis.plan,
    "checks": [{"name": n, "ok": o, "detail": d} for n, o, d in checks],
    "timings_s": timings,
  })
  print(f"wrote {a.out}")
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
