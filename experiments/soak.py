"""Soak: a Llama training step under symmem.jit and a memory budget, for thousands of steps.

The batches are the real CodeAlpaca length distribution (2,017 Llama-2 token counts,
experiments/data), bucketed by jax_symmem.examples.batching (batch 2 by default, padded to a
multiple of 64, batches in a seeded random order, cycled over). The budget sits between the modeled
peak without rematerialization and the smallest modeled peak of any eviction round at the
longest bucket (`--budget_frac` of the way up from the latter; default halfway), so the
longest buckets must rematerialize and the short ones must not.

Warm-up runs one step of each shape the soak will see (so every compile happens there),
then the high-water mark is reset (`echo 5 > /proc/self/clear_refs`) and the soak runs.
Reported:
 - steps over budget, judged per dispatch from `step.last_call`: XLA's memory_analysis()
   footprint of the dispatched executable + the bytes other live arrays held > budget;
 - the real high-water mark over the soak (VmHWM - VmRSS at the reset, with
   MALLOC_MMAP_THRESHOLD_=65536 as in the F3 protocol: the script re-executes itself with it),
   plus the step's argument bytes (state, tokens, mask) as bench_remat counts a real peak;
 - compiles, recompiles, cache hits, fallback calls; rounds used per bucket; absl warnings;
   tokens/s (real and padded) and wall time; VmRSS drift over the soak.

  python -m experiments.soak                          # small preset, 2,000 steps
  python -m experiments.soak --preset tiny --steps 200   # quick: writes soak_quick.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import logging as py_logging
import math
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import logging as absl_logging  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402
from jax_symmem._src import jit as jit_lib  # noqa: E402  (reads MAX_RECOMPILES only)
from jax_symmem.measure import MMAP_THRESHOLD, proc_status  # noqa: E402
from jax_symmem.measure import reset_high_water_mark  # noqa: E402
from jax_symmem.examples import batching  # noqa: E402
from jax_symmem.examples import llama  # noqa: E402


# --- data and budget --------------------------------------------------------------------------

def load_batches(batch_size: int = 4, pad_multiple: int = 64, *, vocab: int, seed: int = 0,
                 max_length: int | None = None):
  """CodeAlpaca's lengths, bucketed and padded, in a seeded random batch order.

  `max_length` drops longer examples (the test's short run); None keeps all 2,017.
  """
  lengths = batching.load_codealpaca_lengths()
  if max_length is not None:
    lengths = lengths[lengths <= max_length]
  return batching.bucket_batches(lengths, batch_size, pad_multiple, vocab=vocab, seed=seed)


def abstract_args(cfg, batch):
  """(state, tokens, mask) as ShapeDtypeStructs: what `analyze` needs, and no arrays.

  symmem.jit's trace keeps the arguments it was first given alive for the step's
  lifetime (the traced function closes over them; see the report of issue #6 part 4), so
  analyzing with real arrays would pin the initial state and count it as reserved.
  """
  state = jax.eval_shape(lambda: llama.init_state(cfg))
  return (state,) + tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch)


def pick_budget(cfg, args, *, frac: float, max_len: int, max_batch: int):
  """(budget bytes, facts): `frac` of the way from the smallest modeled round peak to the
  no-remat modeled peak at the longest bucket.

  The rounds are planned without looking at the budget, so a budget-less probe step gives
  the same rounds the budgeted step will have (at the cost of a second trace and plan).
  """
  probe = llama.make_train_step(cfg, use_symmem=True, memory_budget=None, max_len=max_len,
                                max_batch=max_batch)
  analysis = probe.analyze(*args)
  dims = {"b": max_batch, "s": max_len}
  peaks = [analysis.round_peak(k, dims) for k in range(len(analysis.rounds))]
  lo, hi = min(peaks), peaks[0]
  budget = _common.budget_between(lo, hi, frac)
  return budget, {"dims": dims, "round_peaks": peaks, "no_remat_peak": hi, "min_peak": lo,
                  "min_round": peaks.index(lo), "frac": frac}


# --- process memory -----------------------------------------------------------------------

@contextlib.contextmanager
def capture_logs(*names: str):
  """Collects (logger, level, message) of every record the named loggers emit at INFO or above."""
  records = []

  class _Handler(py_logging.Handler):
    def emit(self, record):
      records.append((record.name, record.levelno, record.getMessage()))

  handler = _Handler(py_logging.INFO)
  loggers = [py_logging.getLogger(n) for n in names]
  for lg in loggers:
    lg.addHandler(handler)
  try:
    yield records
  finally:
    for lg in loggers:
      lg.removeHandler(handler)


# --- the loop -----------------------------------------------------------------------------

def soak_loop(step, make_state: Callable[[], Any], batches, steps: int, budget: int, *,
              measure_hwm: bool = False, progress_every: int = 0, rss_every: int = 50):
  """Warm-up (one step per shape the soak will see), then `steps` steps cycling over `batches`.

  `make_state()` builds the initial train state here, so that no caller holds the
  first state: symmem.jit counts every other live array as reserved, and a stale
  reference to the initial state (60 MiB with the small preset) would eat the budget.
  Every dispatch is judged from `step.last_call`: over budget when XLA's footprint of the
  dispatched executable plus the reserved bytes (other live arrays) exceed `budget`. With
  `measure_hwm`, VmHWM is reset after the warm-up and read after the soak.

  Returns (final state, results dict).
  """
  gc.collect()   # garbage arrays from before the soak would count as reserved
  state = make_state()
  plan = [batches[i % len(batches)] for i in range(steps)]
  first = {}
  for tokens, mask in plan:
    first.setdefault(tokens.shape, (tokens, mask))
  records, warm_records = [], []
  info0 = step.cache_info()

  def one(tokens, mask, out):
    nonlocal state
    before = step.cache_info()
    t = time.perf_counter()
    state, loss = step(state, tokens, mask)
    loss = float(loss)   # syncs: one step in flight, and no scalar arrays pile up as live arrays
    dt = time.perf_counter() - t
    after = step.cache_info()
    call = step.last_call
    fell_back = after["fallback_calls"] > before["fallback_calls"]
    rec = {"b": tokens.shape[0], "s": tokens.shape[1], "dt": dt, "loss": loss,
           "real_tokens": int(mask.sum()), "compiles": after["compiles"] - before["compiles"],
           "fallback": fell_back}
    if call is not None and not fell_back:
      rec.update(round=call["round"], xla_bytes=call["xla_bytes"], reserved=call["reserved"],
                 over=call["xla_bytes"] + call["reserved"] > budget)
    else:   # nothing to judge: plain jax.jit ran
      rec.update(round=None, xla_bytes=None, reserved=None, over=None)
    out.append(rec)

  with capture_logs("absl", "jax") as logs:
    t_warm = time.perf_counter()
    for tokens, mask in first.values():
      one(tokens, mask, warm_records)
    t_warm = time.perf_counter() - t_warm
    info_warm = step.cache_info()

    gc.collect()
    hwm_ok = measure_hwm and reset_high_water_mark()
    rss_base = proc_status("VmRSS")
    rss_samples = [(0, rss_base)]
    t0 = time.perf_counter()
    for i, (tokens, mask) in enumerate(plan):
      one(tokens, mask, records)
      if rss_every and (i + 1) % rss_every == 0:
        rss_samples.append((i + 1, proc_status("VmRSS")))
      if progress_every and (i + 1) % progress_every == 0:
        el = time.perf_counter() - t0
        toks = sum(r["real_tokens"] for r in records)
        print(f"  step {i + 1:>5}/{steps}: {el:7.1f} s, {toks / el:8.0f} real tokens/s, "
              f"loss {records[-1]['loss']:.3f}, VmRSS {proc_status('VmRSS') / MiB:.1f} MiB, "
              f"{step.cache_info()}", flush=True)
    wall = time.perf_counter() - t0
    hwm = proc_status("VmHWM") if hwm_ok else None
  info = step.cache_info()

  # The step's arguments are resident before each call: the F3 "real peak" adds them back.
  longest = max(first)
  arg_bytes = _common.tree_bytes((state, first[longest]))
  results = {
      "steps": steps, "warmup_steps": len(warm_records), "budget": budget,
      "cache_info_start": info0, "cache_info_after_warmup": info_warm, "cache_info": info,
      "compiles_after_warmup": info["compiles"] - info_warm["compiles"],
      "warmup_s": t_warm, "wall_s": wall,
      "records": records, "warmup_records": warm_records,
      "over_budget": sum(bool(r["over"]) for r in records + warm_records),
      "unjudged": sum(r["over"] is None for r in records + warm_records),
      "fallback_steps": sum(r["fallback"] for r in records + warm_records),
      "real_tokens": sum(r["real_tokens"] for r in records),
      "padded_tokens": sum(r["b"] * r["s"] for r in records),
      "logs": [{"logger": n, "level": py_logging.getLevelName(lv), "message": m}
               for n, lv, m in logs],
      "warnings": sum(lv >= py_logging.WARNING for _, lv, _ in logs),
      "rss_base": rss_base, "rss_samples": rss_samples, "hwm": hwm,
      "hwm_delta": None if hwm is None else hwm - rss_base,
      "argument_bytes_longest": arg_bytes, "state_bytes": _common.tree_bytes(state),
      "shapes": [list(s) for s in first],
  }
  return state, results


def bucket_table(results, analysis, budget):
  """Per sequence length: steps, rounds used, footprints, times, throughput."""
  rows = []
  by_s = collections.defaultdict(list)
  for r in results["warmup_records"]:
    by_s[r["s"]].append(("warm", r))
  for r in results["records"]:
    by_s[r["s"]].append(("soak", r))
  for s in sorted(by_s):
    soak = [r for kind, r in by_s[s] if kind == "soak"]
    every = [r for _, r in by_s[s]]
    b = every[0]["b"]
    dims = {"b": b, "s": s}
    judged = [r for r in every if r["over"] is not None]
    times = sorted(r["dt"] for r in soak)
    row = {
        "s": s, "b": b, "soak_steps": len(soak),
        "rounds": dict(collections.Counter(r["round"] for r in every)),
        "model_round0": analysis.round_peak(0, dims),
        "model_choice": analysis.choose_round(dims, budget,
                                              min((r["reserved"] or 0) for r in every)),
        "xla_bytes": sorted({r["xla_bytes"] for r in judged}),
        "max_reserved": max((r["reserved"] for r in judged), default=None),
        "max_total": max((r["xla_bytes"] + r["reserved"] for r in judged), default=None),
        "over": sum(bool(r["over"]) for r in every),
        "median_step_s": times[len(times) // 2] if times else None,
        "soak_s": sum(times),
        "real_tokens": sum(r["real_tokens"] for r in soak),
    }
    row["tokens_per_s"] = row["real_tokens"] / row["soak_s"] if row["soak_s"] else None
    rows.append(row)
  return rows


# --- main ---------------------------------------------------------------------------------

def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="small", choices=sorted(llama.PRESETS))
  parser.add_argument("--steps", type=int, default=2000)
  # Batch 2 by default: the small preset at batch 4 ran ~1.0 s/step on this shared 2-core
  # machine (~36 min for 2,000 steps); batch 2 halves that.
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--pad", type=int, default=64, help="padding multiple (bucket width)")
  parser.add_argument("--seed", type=int, default=0, help="batch order and synthetic token ids")
  parser.add_argument("--max_length", type=int, default=None, help="drop longer examples")
  parser.add_argument("--budget_frac", type=float, default=0.5,
                      help="budget = min round peak + frac * (no-remat peak - min round peak), "
                           "modeled at the longest bucket")
  parser.add_argument("--budget_mib", type=float, default=None, help="explicit budget instead")
  parser.add_argument("--progress", type=int, default=100, help="print every N steps (0: never)")
  parser.add_argument("--out", default=None,
                      help="default experiments/results/soak.json (small preset, >= 2000 steps), "
                           "else soak_quick.json")
  a = parser.parse_args(argv)
  if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
    # Freed buffers must go back to the OS or VmHWM measures glibc's recycling (F3):
    # the variable is read when the process starts, so start again with it.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD,
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "experiments.soak", *argv], env)
  if a.out is None:
    full = a.preset == "small" and a.steps >= 2000 and a.max_length is None
    a.out = f"experiments/results/soak{'' if full else '_quick'}.json"
  jax.config.update("jax_cpu_enable_async_dispatch", False)   # as measure.py (F3)
  absl_logging.set_verbosity(absl_logging.INFO)   # symmem.jit logs each compile at INFO
  t_start = time.perf_counter()

  cfg = llama.PRESETS[a.preset]
  batches = load_batches(a.batch, a.pad, vocab=cfg.vocab, seed=a.seed, max_length=a.max_length)
  shapes = collections.Counter(t.shape for t, _ in batches)
  max_len = max(s for _, s in shapes)
  args = abstract_args(cfg, batches[0])

  t = time.perf_counter()
  if a.budget_mib is None:
    budget, budget_info = pick_budget(cfg, args, frac=a.budget_frac, max_len=max_len,
                                      max_batch=a.batch)
  else:
    budget, budget_info = int(a.budget_mib * MiB), {"explicit_mib": a.budget_mib}
  t_probe = time.perf_counter() - t
  step = llama.make_train_step(cfg, use_symmem=True, memory_budget=budget, max_len=max_len,
                               max_batch=a.batch)
  t = time.perf_counter()
  analysis = step.analyze(*args)
  t_analysis = time.perf_counter() - t

  print(f"soak: Llama preset {a.preset!r} ({cfg.num_params() / 1e6:.2f} M params), {a.steps} steps, "
        f"batch {a.batch}, pad multiple {a.pad}, seed {a.seed}; {len(batches)} CodeAlpaca batches "
        f"in {len(shapes)} buckets (s = {', '.join(str(s) for _, s in sorted(shapes))}); "
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cpus", flush=True)
  if "round_peaks" in budget_info:
    print(f"budget {budget / MiB:.1f} MiB = min round peak {budget_info['min_peak'] / MiB:.1f} + "
          f"{a.budget_frac} x (no-remat peak {budget_info['no_remat_peak'] / MiB:.1f} - min), "
          f"modeled at {budget_info['dims']} (round {budget_info['min_round']} is the smallest)",
          flush=True)
  print(f"probe trace+plan {t_probe:.1f} s, budgeted step trace+plan {t_analysis:.1f} s; "
        f"{len(analysis.rounds)} rounds", flush=True)

  state, res = soak_loop(step, lambda: llama.init_state(cfg, seed=a.seed), batches, a.steps,
                         budget, measure_hwm=True, progress_every=a.progress)
  rows = bucket_table(res, analysis, budget)
  info = res["cache_info"]
  runtime = time.perf_counter() - t_start

  # --- checks ---
  checks = []
  def check(name, ok, detail=""):
    checks.append((name, bool(ok), detail))
  n_dispatch = a.steps + res["warmup_steps"]
  check("0 steps over budget (XLA footprint + reserved <= budget, per dispatch)",
        res["over_budget"] == 0 and res["unjudged"] == 0,
        f"{res['over_budget']} over, {res['unjudged']} unjudged of {n_dispatch}")
  check("0 fallback calls", info["fallback_calls"] == 0, f"{info['fallback_calls']}")
  limit = len(shapes) * (1 + jit_lib.MAX_RECOMPILES)
  check(f"compiles <= buckets x (1 + MAX_RECOMPILES) = {len(shapes)} x "
        f"{1 + jit_lib.MAX_RECOMPILES}", info["compiles"] <= limit, f"{info['compiles']}")
  losses = [r["loss"] for r in res["records"]]
  check("every loss finite", all(math.isfinite(x) for x in losses))
  real_peak = None
  if res["hwm_delta"] is not None:
    # bench_remat's criterion for a real peak against the budget
    real_peak = res["hwm_delta"] + res["argument_bytes_longest"]
    tol = _common.budget_limit(budget)
    check("real peak (VmHWM delta + argument bytes) <= budget x 1.05 + 8 MiB",
          real_peak <= tol, f"{real_peak / MiB:.1f} vs {tol / MiB:.1f} MiB")

  # --- print ---
  print()
  print(f"per bucket (b = {a.batch}); MiB. rounds = dispatched round: count (warm-up included); "
        "model r0 = modeled no-remat peak; model = round choose_round picks uncalibrated; "
        "XLA = memory_analysis footprint of the dispatched variant(s); total = max XLA + reserved")
  hdr = (f"{'s':>5} {'steps':>6} {'rounds':>14} {'model r0':>9} {'model':>5} {'XLA':>14} "
         f"{'reserved':>8} {'total':>7} {'over':>4} {'med s/step':>10} {'tok/s':>8}")
  print(hdr)
  for r in rows:
    rounds = ",".join(f"{k}:{v}" for k, v in sorted(r["rounds"].items(), key=lambda kv: str(kv[0])))
    xla = "/".join(f"{x / MiB:.1f}" for x in r["xla_bytes"]) or "-"
    res_mib = "-" if r["max_reserved"] is None else f"{r['max_reserved'] / MiB:.2f}"
    tot = "-" if r["max_total"] is None else f"{r['max_total'] / MiB:.1f}"
    med = "-" if r["median_step_s"] is None else f"{r['median_step_s']:.3f}"
    tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
    print(f"{r['s']:>5} {r['soak_steps']:>6} {rounds:>14} {r['model_round0'] / MiB:9.1f} "
          f"{r['model_choice']:>5} {xla:>14} {res_mib:>8} {tot:>7} {r['over']:>4} {med:>10} {tps:>8}")
  print()
  print(f"budget {budget / MiB:.1f} MiB; dispatches over budget: {res['over_budget']} of {n_dispatch} "
        f"({res['warmup_steps']} warm-up + {a.steps} soak); unjudged (fallback): {res['unjudged']}")
  print(f"cache: {info}; compiles during warm-up {res['cache_info_after_warmup']['compiles']}, "
        f"after warm-up {res['compiles_after_warmup']}")
  warn = [x for x in res["logs"] if x["level"] not in ("INFO", "DEBUG")]
  print(f"log warnings (absl + jax loggers): {res['warnings']}" +
        "".join(f"\n  {x['logger']} {x['level']}: {x['message'][:300]}" for x in warn))
  print(f"soak wall {res['wall_s']:.1f} s ({res['wall_s'] / a.steps * 1e3:.0f} ms/step), warm-up "
        f"{res['warmup_s']:.1f} s; real tokens/s {res['real_tokens'] / res['wall_s']:.0f}, padded "
        f"tokens/s {res['padded_tokens'] / res['wall_s']:.0f} (real/padded "
        f"{res['real_tokens'] / res['padded_tokens']:.2f}); loss first 50 mean "
        f"{np.mean(losses[:50]):.3f}, last 50 mean {np.mean(losses[-50:]):.3f}")
  rss = [x for _, x in res["rss_samples"]]
  print(f"VmRSS after warm-up {res['rss_base'] / MiB:.1f} MiB, end {rss[-1] / MiB:.1f}, sampled max "
        f"{max(rss) / MiB:.1f} (every 50 steps; drift {(rss[-1] - rss[0]) / MiB:+.1f} MiB)")
  if res["hwm_delta"] is not None:
    print(f"real high-water mark over the soak: VmHWM {res['hwm'] / MiB:.1f} - VmRSS at reset "
          f"{res['rss_base'] / MiB:.1f} = {res['hwm_delta'] / MiB:.1f} MiB above resident; + argument "
          f"bytes at the longest bucket {res['argument_bytes_longest'] / MiB:.1f} = {real_peak / MiB:.1f} "
          f"MiB vs budget {budget / MiB:.1f} MiB ({real_peak / budget:.2f}x)")
  else:
    print("real high-water mark: not measured (/proc/self/clear_refs not writable)")
  print()
  failed = [c for c in checks if not c[1]]
  for name, ok, detail in checks:
    print(f"{'PASS' if ok else 'FAIL'}: {name}" + (f" ({detail})" if detail else ""))
  print(f"checks: {len(checks) - len(failed)} of {len(checks)} passed; runtime {runtime:.0f} s")

  summary = {k: v for k, v in res.items() if k not in ("records", "warmup_records")}
  _common.write_results(a.out, {
    "args": vars(a), "config": dataclasses.asdict(cfg),
    "jax": jax.__version__, "budget": budget, "budget_choice": budget_info,
    "buckets": {str(s): n for (_, s), n in sorted(shapes.items())},
    "rows": rows, "summary": summary, "real_peak": real_peak,
    "variants": step.variants(), "max_recompiles": jit_lib.MAX_RECOMPILES,
    "timings_s": {"probe": t_probe, "analysis": t_analysis, "warmup": res["warmup_s"],
                  "soak": res["wall_s"], "total": runtime},
    # per step: s, round, xla_bytes, reserved, dt, loss (compact)
    "steps": [[r["s"], r["round"], r["xla_bytes"], r["reserved"], round(r["dt"], 4),
               round(r["loss"], 4)] for r in res["records"]],
    "checks": [{"name": n, "ok": o, "detail": d} for n, o, d in checks],
  })
  print(f"wrote {a.out}")
  return 0 if not failed else 1


if __name__ == "__main__":
  sys.exit(main())
