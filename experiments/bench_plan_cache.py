"""Benchmark: analysis time of a Llama step planned cold vs replayed from the plan cache.

Each measurement runs in a fresh process (a restarted job): it imports jax_symmem,
builds the Llama preset's abstract state, and times `analyze_function` (tracing,
shape graph, schedule, remat rounds; with the cache warm: tracing, shape graph,
the key, checking the stored schedule, round 0), with its split `Analysis.seconds`:
JAX tracing the step (which the cache key needs, and jax.jit pays as well) and all
after it. A replayed plan rebuilds round k only when a shape first needs it, so each
process also times reading every round afterwards ("+ every round"). The first process plans and stores the plan; the
next ones (another PYTHONHASHSEED each) load it. Each warm process checks that
its rounds' modeled peaks equal the cold plan's at a few shapes. With
--first_call each process then times `symmem.jit`'s first call (a fresh
`SymmemFunction` under a budget: analysis again, under another plan key than the
budget-less analysis above, so the cold process plans it from scratch and later
processes load it; plus XLA's compiles, from JAX's persistent compilation cache
once stored). With --restart it also times a restarted job against `jax.jit`'s: fresh
processes that each build the state and time their step's first call (b=2, s=128) from
nothing, `jax.jit` and `symmem.jit` (under the budget; --budget_mib 0: none) in turn, both with JAX's
persistent compilation cache and the plan cache already filled by an untimed process of
each; the difference is what jax_symmem adds to a restart: its symbolic trace (jax.jit
and symmem.jit both trace the step as written at the batch's shape), the plan read back,
its dispatch. With --cold N, N such pairs with no cache at all (empty directories): a
user's first run.

  python -m experiments.bench_plan_cache [--preset small] [--scan] [--narrow] [--warm 2]
                                          [--first_call] [--restart] [--cold 0] [--budget_mib 256]
                                          [--out PATH]

Prints a table and writes experiments/results/bench_plan_cache[_scan]_<preset>.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # also run as `python experiments/bench_plan_cache.py`

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402

DIMS = ({"b": 1, "s": 64}, {"b": 4, "s": 512}, {"b": 16, "s": 1024})

# --narrow: the small preset's widths (a program of the same ops, layers and dtypes,
# whose state fits this machine's memory, so a restart can run it).
NARROW = {"vocab": 4096, "d_model": 256, "n_heads": 4, "d_ff": 688}
_PRELUDE = f"""
import dataclasses

def preset_config(preset):
  # "name" or "name:narrow" (the preset's program at the small preset's widths)
  from jax_symmem.examples import llama
  cfg = llama.PRESETS[preset.partition(":")[0]]
  return dataclasses.replace(cfg, **{NARROW!r}) if preset.endswith(":narrow") else cfg
"""

_CHILD = _PRELUDE + """
import json, sys, time
import jax, jax.numpy as jnp
from jax_symmem._src import analysis as analysis_lib
from jax_symmem.examples import llama
preset, scan = sys.argv[1], sys.argv[2] == "1"
cfg = preset_config(preset)
state = jax.eval_shape(lambda: llama.init_state(cfg, scan_layers=scan))
fn = llama.train_step_fn(llama.Llama(cfg, scan_layers=scan))
tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
mask = jax.ShapeDtypeStruct((2, 16), jnp.float32)
start = time.perf_counter()
a = analysis_lib.analyze_function(fn, state, tokens, mask,
                                  polymorphic_shapes=(None, "b, s", "b, s"),
                                  constraints=llama.step_constraints(cfg.max_len, 16))
seconds = time.perf_counter() - start
# A replayed plan rebuilds its rounds when a shape first needs them: time them all.
start = time.perf_counter()
all_rounds = [a.rounds[k] for k in range(len(a.rounds))]
rounds_s = time.perf_counter() - start
dims = json.loads(sys.argv[3])
first_call = None
if sys.argv[4] != "-":   # a restarted job: symmem.jit with both caches, its first call
  jax.config.update("jax_compilation_cache_dir", sys.argv[4])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  import jax_symmem as symmem
  step = symmem.jit(fn, polymorphic_shapes=(None, "b, s", "b, s"),
                    constraints=llama.step_constraints(cfg.max_len, 16),
                    memory_budget=int(sys.argv[5]) or None)
  real_state = llama.init_state(cfg, scan_layers=scan)
  batch = llama.example_batch(cfg, 2, 128)
  start = time.perf_counter()
  jax.block_until_ready(step(real_state, *batch))
  first_call = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "trace_s": a.seconds["trace"], "plan_s": a.seconds["plan"],
                  "rounds_s": rounds_s,
                  "first_call": first_call, "origin": a.origin, "rounds": len(a.rounds),
                  "loop_evictions": sum(type(r).__name__ == "LoopEviction"
                                        for rnd in a.rounds for r in rnd.regions),
                  "peaks": [[a.round_peak(k, d) for k in range(len(a.rounds))] for d in dims]}))
"""


# A restarted job: build the state, time the step's first call from nothing (tracing,
# jax_symmem's plan from its cache, XLA's executables from JAX's compilation cache).
_RESTART_CHILD = _PRELUDE + """
import json, sys, time
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[4])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from jax_symmem.examples import llama
preset, scan, which, budget = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[5])
cfg = preset_config(preset)
fn = llama.train_step_fn(llama.Llama(cfg, scan_layers=scan))
state = llama.init_state(cfg, scan_layers=scan)
batch = llama.example_batch(cfg, 2, 128)
jax.block_until_ready((state, batch))
start = time.perf_counter()
if which == "jax.jit":
  step = jax.jit(fn)
else:
  import jax_symmem as symmem
  step = symmem.jit(fn, polymorphic_shapes=(None, "b, s", "b, s"),
                    constraints=llama.step_constraints(cfg.max_len, 16),
                    memory_budget=budget or None)
jax.block_until_ready(step(state, *batch))
print(json.dumps({"first_call": time.perf_counter() - start}))
"""


def _restart(cache_dir: str, preset: str, scan: bool, which: str, seed: int, budget: int) -> float:
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=str(seed),
             JAX_SYMMEM_PLAN_CACHE=cache_dir, JAX_PLATFORMS="cpu")
  return _common.run_python(_RESTART_CHILD, [preset, "1" if scan else "0", which,
                                              os.path.join(cache_dir, "xla_restart"),
                                              str(budget)], env)["first_call"]


def _run(cache_dir: str, preset: str, scan: bool, seed: int, xla_cache: str | None,
         budget: int) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED=str(seed),
             JAX_SYMMEM_PLAN_CACHE=cache_dir, JAX_PLATFORMS="cpu")
  return _common.run_python(_CHILD, [preset, "1" if scan else "0", json.dumps(DIMS),
                                      xla_cache or "-", str(budget)], env)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--scan", action="store_true", help="nn.scan over the layers")
  parser.add_argument("--narrow", action="store_true",
                      help=f"the preset at the small preset's widths {NARROW} (same program and "
                           "layers: a 1B step's restart can run on this machine)")
  parser.add_argument("--warm", type=int, default=2, help="warm processes after the cold one")
  parser.add_argument("--first_call", action="store_true",
                      help="also time symmem.jit's first call (b=2, s=128) with JAX's persistent "
                           "compilation cache in the same directory")
  parser.add_argument("--restart", action="store_true",
                      help="also time restarted jobs' first calls, jax.jit vs symmem.jit, both "
                           "caches filled (--warm pairs)")
  parser.add_argument("--cold", type=int, default=0,
                      help="also time this many fresh jobs' first calls each, jax.jit vs "
                           "symmem.jit in turn, with no cache at all (a first run)")
  parser.add_argument("--budget_mib", type=int, default=256,
                      help="symmem.jit's budget for --first_call and --restart (0: none; each "
                           "shape then runs as written and symmem.jit plans nothing)")
  parser.add_argument("--out", default=None,
                      help="default experiments/results/bench_plan_cache[_scan]_<preset>.json")
  args = parser.parse_args()
  budget = args.budget_mib * MiB
  with tempfile.TemporaryDirectory() as cache_dir:
    xla = os.path.join(cache_dir, "xla") if args.first_call else None
    preset = args.preset + (":narrow" if args.narrow else "")
    cold = _run(cache_dir, preset, args.scan, 1, xla, budget)
    warm = [_run(cache_dir, preset, args.scan, 2 + k, xla, budget) for k in range(args.warm)]
    stored = sum(f.stat().st_size for f in pathlib.Path(cache_dir).glob("*.json"))
    restart = None
    if args.restart:   # untimed: fill both caches; then the pairs, in turn
      whos = ("jax.jit", "symmem.jit")
      fill = {w: _restart(cache_dir, preset, args.scan, w, 1, budget) for w in whos}
      restart = {"filling": fill, **{w: [] for w in whos}}
      for k in range(args.warm):
        for w in (whos if k % 2 == 0 else whos[::-1]):
          restart[w].append(_restart(cache_dir, preset, args.scan, w, 2 + k, budget))
    first_runs = None
    if args.cold:   # each in empty cache directories of its own
      whos = ("jax.jit", "symmem.jit")
      first_runs = {w: [] for w in whos}
      for k in range(args.cold):
        for w in (whos if k % 2 == 0 else whos[::-1]):
          with tempfile.TemporaryDirectory() as empty:
            first_runs[w].append(_restart(empty, preset, args.scan, w, 10 + k, budget))
  assert cold["origin"] == "planned", cold["origin"]
  for w in warm:
    assert w["origin"] != "planned", "the warm process planned again"
    assert w["peaks"] == cold["peaks"], "replayed rounds model other peaks"
  name = f"llama {args.preset}" + (" (narrow)" if args.narrow else "") + (
      " (scan)" if args.scan else "")
  print(f"{name}: {cold['rounds'] - 1} remat rounds, {cold['loop_evictions']} loop evictions, "
        f"plan files {stored / 1024:.0f} KiB")
  first = lambda r: f"{r['first_call']:>16.2f}" if r["first_call"] is not None else ""
  print(f"{'process':<10}{'analysis s':>12}{'trace s':>10}{'after it s':>12}"
        f"{'+ every round s':>17}" + (f"{'first call s':>16}" if args.first_call else ""))
  for label, r in [("cold", cold)] + [(f"warm {k + 1}", w) for k, w in enumerate(warm)]:
    print(f"{label:<10}{r['seconds']:>12.2f}{r['trace_s']:>10.2f}{r['plan_s']:>12.2f}"
          f"{r['rounds_s']:>17.2f}{first(r)}")
  if restart is not None:
    print("restarted job's first call (b=2, s=128; both caches filled): jax.jit "
          + ", ".join(f"{t:.2f}" for t in restart["jax.jit"]) + " s; symmem.jit "
          + ", ".join(f"{t:.2f}" for t in restart["symmem.jit"]) + " s (filling: "
          + ", ".join(f"{w} {t:.2f}" for w, t in restart["filling"].items()) + " s)")
    gap = min(restart["symmem.jit"]) - min(restart["jax.jit"])
    print(f"symmem.jit adds {gap:.2f} s to a restart (best of each)")
  if first_runs is not None:
    print("a first run's first call (b=2, s=128; no cache): jax.jit "
          + ", ".join(f"{t:.2f}" for t in first_runs["jax.jit"]) + " s; symmem.jit "
          + ", ".join(f"{t:.2f}" for t in first_runs["symmem.jit"]) + " s; symmem.jit adds "
          f"{min(first_runs['symmem.jit']) - min(first_runs['jax.jit']):.2f} s (best of each)")
  best, worst = min(w["seconds"] for w in warm), max(w["seconds"] for w in warm)
  worst_plan = max(w["plan_s"] for w in warm)
  print(f"speedup {cold['seconds'] / best:.1f}x (best warm process); warm <= 1 s: best "
        f"{best <= 1.0}, every process {worst <= 1.0}; after tracing <= 1 s: every process "
        f"{worst_plan <= 1.0}")
  result = {"preset": args.preset, "scan": args.scan,
            "narrow": NARROW if args.narrow else None, "cold_s": cold["seconds"],
            "warm_s": [w["seconds"] for w in warm],
            "trace_s": {"cold": cold["trace_s"], "warm": [w["trace_s"] for w in warm]},
            "after_trace_s": {"cold": cold["plan_s"], "warm": [w["plan_s"] for w in warm]},
            # Rebuilding every round afterwards (a replay does it per round on demand).
            "every_round_s": {"cold": cold["rounds_s"], "warm": [w["rounds_s"] for w in warm]},
            "first_call_s": {"cold": cold["first_call"], "warm": [w["first_call"] for w in warm],
                             "budget_bytes": budget or None} if args.first_call else None,
            # Fresh processes' first calls, jax.jit and symmem.jit, both caches filled.
            "restart_first_call_s": restart and {**restart, "budget_bytes": budget or None},
            # Fresh processes' first calls with no cache at all (--cold).
            "first_run_first_call_s": first_runs and {**first_runs,
                                                      "budget_bytes": budget or None},
            "rounds": cold["rounds"] - 1,
            "loop_evictions": cold["loop_evictions"], "plan_file_bytes": stored,
            "dims": DIMS, "peaks": cold["peaks"], "platform": platform.platform(),
            "python": platform.python_version()}
  out = args.out or ROOT / "experiments" / "results" / (
      f"bench_plan_cache{'_scan' if args.scan else ''}_{args.preset}"
      f"{'_narrow' if args.narrow else ''}.json")
  print(f"wrote {_common.write_results(out, result)}")


if __name__ == "__main__":
  main()
