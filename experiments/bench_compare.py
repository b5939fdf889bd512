"""Benchmark: exact symbolic comparison on realistic size polynomials, checked by brute force.

Draws seeded random pairs of byte-size polynomials over b, s and h (or k with
s == 128*k) and times two entry points, each with every cache cleared before
every timed call (a fresh decision):

* the public string API end to end: `symbolic.compare(str(lhs), str(rhs),
  constraints=<the constraint strings>)`, parsing and constraint normalization
  included (targets: mean <= 100 us, p99 <= 1 ms);
* the pre-parsed core `compare_polys(lhs, rhs, constraints)`.

Both must give the same answer. Every answer is checked against exhaustive
exact evaluation over the whole box (1 <= b <= 64, 1 <= s <= 4096, 1 <= h <= 64, ...):

* GE / LE / EQ must hold at every point (and EQ must not hide behind GE/LE);
* DEPENDS witnesses must satisfy the constraints and have the claimed signs;
* sign pieces must match the sign at every value of their dimension.

The brute force evaluates the original expressions with numpy int64 when a
magnitude bound shows no overflow (< 2^62), else with Python ints (object
arrays), one slice of the grid at a time. As a baseline it also asks JAX's own
`>=` on the same pair (DESIGN.md F9).

  python -m experiments.bench_compare [--pairs 1000] [--seed 0] [--repeats 3] [--inequalities]

With --inequalities the pairs are drawn under general inequality constraints
(`INEQUALITY_SETTINGS`: b*s <= 16384, t <= s, s + t <= 768) and checked over the points
they allow.

Prints a summary and writes experiments/results/bench_compare.json.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import pathlib
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jax import export  # noqa: E402

from experiments import _common  # noqa: E402
from jax_symmem import symbolic  # noqa: E402
from jax_symmem._src import compare as compare_lib  # noqa: E402
from jax_symmem._src import poly as poly_lib  # noqa: E402
from jax_symmem._src.constraints import parse_constraints  # noqa: E402
from jax_symmem._src.poly import Poly, Var  # noqa: E402

BYTE_COEFFS = [1, 2, 4, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192, 11008, 22016, 44032, 12, 24]

# name, dims used in the expressions, constraints, brute-force ranges of the free dims
SETTINGS = [
    ("b,s,h", "bsh", ("b <= 64", "s <= 4096", "h <= 64"), {"b": 64, "s": 4096, "h": 64}),
    ("b,s", "bs", ("b <= 64", "s <= 4096"), {"b": 64, "s": 4096}),
    ("b,s,k: s == 128*k", "bsk", ("s == 128*k", "b <= 64", "s <= 4096"), {"b": 64, "k": 32}),
    ("b,s small", "bs", ("b <= 16", "s <= 2048"), {"b": 16, "s": 2048}),
]
ATOM_SHARE = 0.1   # pairs with a floordiv/max term (pooling, padding)
# --inequalities: general inequality constraints (tokens per batch, a target no longer
# than its source), plain polynomials; the brute force counts only the points they allow.
INEQUALITY_SETTINGS = [
    ("b,s: b*s <= 16384", "bs", ("b <= 64", "s <= 2048", "b*s <= 16384"), {"b": 64, "s": 2048}),
    ("b,s,t: t <= s", "bst", ("b <= 16", "s <= 512", "t <= 512", "t <= s"),
     {"b": 16, "s": 512, "t": 512}),
    ("b,s,t: s + t <= 768", "bst", ("b <= 16", "s <= 512", "t <= 512", "s + t <= 768"),
     {"b": 16, "s": 512, "t": 512}),
]


# --------------------------------------------------------------------------
# Pairs
# --------------------------------------------------------------------------
def _monomial(rng, dims):
  t = Poly.const(rng.choice(BYTE_COEFFS))
  for _ in range(rng.randint(1, 3)):
    t = t * Poly.var(rng.choice(dims))
  return t


def _side(rng, dims, atoms):
  p = poly_lib.ZERO
  for _ in range(rng.randint(1, 3)):
    p = p + _monomial(rng, dims)
  if atoms and rng.random() < 0.5:
    p = p + rng.choice(BYTE_COEFFS) * Poly.var(rng.choice(dims)) * rng.choice(atoms)
  if rng.random() < 0.15:
    p = p + rng.choice([4096, 11008 * 4096, 65536])
  return p


def make_pairs(n: int, seed: int, settings=SETTINGS):
  rng = random.Random(seed)
  s_ = Poly.var("s")
  atoms = [s_.floordiv(2), s_.floordiv(4), s_.max(Poly.const(128)), (Poly.var("b") * s_).floordiv(2)]
  cons = {name: parse_constraints(c, variables=sorted(set(dims) | {"s"}))
          for name, dims, c, _ in settings}
  pairs = []
  for i in range(n):
    name, dims, _, ranges = settings[i % len(settings)]
    dims = list(dims)
    extra = atoms if rng.random() < ATOM_SHARE and settings is SETTINGS else []
    lhs, rhs = _side(rng, dims, extra), _side(rng, dims, extra)
    pairs.append((name, lhs, rhs, cons[name], ranges))
  return pairs


# --------------------------------------------------------------------------
# Brute force
# --------------------------------------------------------------------------
def _magnitude(p: Poly, maxabs) -> int:
  """An upper bound on |p| and on every partial product while evaluating it."""
  total = 0
  for mono, c in p.terms:
    v = abs(c)
    for a, e in mono:
      v *= _atom_magnitude(a, maxabs) ** e
    total += v
  return total


def _atom_magnitude(a, maxabs) -> int:
  if isinstance(a, Var):
    return maxabs[a.name]
  x, y = (_magnitude(o, maxabs) for o in a.operands)
  return max(x, y) if a.op in (poly_lib.MAX, poly_lib.MIN) else x + y


def _np_eval(p: Poly, env):
  total = 0
  for mono, c in p.terms:
    v = c
    for a, e in mono:
      v = v * _np_atom(a, env) ** e
    total = total + v
  return total


def _np_atom(a, env):
  if isinstance(a, Var):
    return env[a.name]
  x, y = (_np_eval(o, env) for o in a.operands)
  return {poly_lib.FLOORDIV: np.floor_divide, poly_lib.MOD: np.mod,
          poly_lib.MAX: np.maximum, poly_lib.MIN: np.minimum}[a.op](x, y)


def brute_force_signs(lhs: Poly, rhs: Poly, cons, ranges, dim: str | None):
  """(set of signs over the box, {value of dim: set of signs}) by exact evaluation."""
  names = sorted(ranges)
  maxabs = {v: ranges[v] for v in names}
  for v, q in cons.substitutions:
    maxabs[v] = _magnitude(q, maxabs)
  d = lhs - rhs
  dtype = np.int64 if _magnitude(d, maxabs) < 2 ** 62 else object
  first, rest = names[0], names[1:]
  grids = np.meshgrid(*(np.arange(1, ranges[v] + 1, dtype=np.int64).astype(dtype) for v in rest),
                      indexing="ij")
  signs, by_dim = set(), collections.defaultdict(set)
  for x0 in range(1, ranges[first] + 1):
    env = dict(zip(rest, grids))
    env[first] = np.full_like(grids[0], x0)
    for v, q in cons.substitutions:
      env[v] = _np_eval(q, env)
    sg = np.sign(_np_eval(d, env)).astype(np.int8)
    if cons.inequalities:   # only the points the constraints allow
      allowed = np.ones(sg.shape, bool)
      for g in cons.inequalities:
        allowed &= _np_eval(g, env) >= 0
      here = set(np.unique(sg[allowed]).tolist())
      signs |= here
      if dim == first:
        by_dim[x0] |= here
      elif dim is not None:   # each value's smallest and largest allowed sign
        axis = rest.index(dim)
        other = tuple(i for i in range(sg.ndim) if i != axis)
        lo = np.where(allowed, sg, 2).min(axis=other) if other else np.where(allowed, sg, 2)
        hi = np.where(allowed, sg, -2).max(axis=other) if other else np.where(allowed, sg, -2)
        for value, (a, b) in enumerate(zip(lo.tolist(), hi.tolist()), start=1):
          if a != 2:
            by_dim[value] |= {a, b}
      continue
    signs |= set(np.unique(sg).tolist())
    if dim == first:
      by_dim[x0] |= set(np.unique(sg).tolist())
    elif dim is not None:
      axis = rest.index(dim)
      other = tuple(i for i in range(sg.ndim) if i != axis)
      lo, hi = (sg.min(axis=other), sg.max(axis=other)) if other else (sg, sg)
      for value, (a, b) in enumerate(zip(lo.tolist(), hi.tolist()), start=1):
        by_dim[value] |= {a, b}
  return signs, by_dim


def check(o, lhs, rhs, cons, ranges) -> str | None:
  """None if the answer agrees with brute force, else what is wrong."""
  if o.method == "inconsistent":
    return "internal inconsistency"
  signs, by_dim = brute_force_signs(lhs, rhs, cons, ranges, o.dim if o.pieces else None)
  if o.kind == "GE" and (-1 in signs or signs == {0}):
    return f"GE but signs {signs}"
  if o.kind == "LE" and (1 in signs or signs == {0}):
    return f"LE but signs {signs}"
  if o.kind == "EQ" and signs != {0}:
    return f"EQ but signs {signs}"
  if o.kind == "DEPENDS":
    if not {1, -1} <= signs:
      return f"DEPENDS but signs {signs}"
    for w, want in ((o.witness_gt, 1), (o.witness_lt, -1)):
      if w is None or cons.violation(w) is not None or any(v < 1 for v in w.values()):
        return f"bad witness {w}"
      if any(w.get(v) is None or not 1 <= w[v] <= r for v, r in ranges.items()):
        return f"witness {w} outside the box"
      val = lhs.evaluate(w) - rhs.evaluate(w)
      if (val > 0) - (val < 0) != want:
        return f"witness {w} has value {val}"
  if o.pieces:
    for value, sg in by_dim.items():
      if sg != {o.sign_at(value)}:
        return f"at {o.dim} = {value}: pieces say {o.sign_at(value)}, brute force {sg}"
  return None


def jax_baseline(lhs: Poly, rhs: Poly, constraints) -> str:
  """What JAX's own `lhs >= rhs` says: 'True', 'False', 'inconclusive' or 'error'."""
  try:
    l, r = export.symbolic_shape(f"{lhs}, {rhs}", constraints=constraints)
    return str(bool(l >= r))
  except Exception as e:  # noqa: BLE001 - JAX raises several kinds here
    return "inconclusive" if "nconclusive" in type(e).__name__ else "error"


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------
def time_calls(calls, repeat: int):
  """(answers, wall seconds, thread CPU seconds): per call the best of `repeat` runs, caches cleared."""
  answers, times, cpu_times = [], [], []
  for call in calls:
    best = best_cpu = math.inf
    for _ in range(repeat):   # the best of a few fresh runs: robust to a busy machine
      compare_lib.clear_caches()
      t0, c0 = time.perf_counter(), time.thread_time()
      o = call()
      best = min(best, time.perf_counter() - t0)
      best_cpu = min(best_cpu, time.thread_time() - c0)
    times.append(best)
    cpu_times.append(best_cpu)
    answers.append(o)
  return answers, times, cpu_times


def time_summary(times, cpu_times, repeat: int) -> dict:
  n = len(times)
  us = sorted(t * 1e6 for t in times)
  cpu_us = sorted(t * 1e6 for t in cpu_times)
  return {"repeat": repeat, "mean": statistics.mean(us), "p50": us[n // 2],
          "p99": us[min(n - 1, math.ceil(0.99 * n) - 1)], "max": us[-1],
          "cpu_mean": statistics.mean(cpu_us), "cpu_p50": cpu_us[n // 2],
          "cpu_p99": cpu_us[min(n - 1, math.ceil(0.99 * n) - 1)]}


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------
def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--pairs", type=int, default=1000)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--repeats", type=int, default=3, help="timed fresh runs per pair (best counts)")
  ap.add_argument("--inequalities", action="store_true",
                  help="general inequality constraints instead (INEQUALITY_SETTINGS)")
  ap.add_argument("--out", default=None, help="default experiments/results/"
                  "bench_compare.json (with --inequalities, bench_compare_inequalities.json)")
  args = ap.parse_args(argv)
  if args.out is None:
    args.out = str(pathlib.Path(__file__).parent / "results" / (
        "bench_compare_inequalities.json" if args.inequalities else "bench_compare.json"))

  pairs = make_pairs(args.pairs, args.seed,
                     INEQUALITY_SETTINGS if args.inequalities else SETTINGS)
  strings = [(str(lhs), str(rhs), cons.source) for _, lhs, rhs, cons, _ in pairs]
  load_before = list(os.getloadavg())
  t_start = time.perf_counter()
  for name, lhs, rhs, cons, _ in pairs:   # warm-up: imports, small caches
    compare_lib.compare_polys(lhs, rhs, cons)
    symbolic.compare(strings[0][0], strings[0][1], constraints=strings[0][2])
    break
  results, times, cpu_times = time_calls(
      [lambda p=p: compare_lib.compare_polys(p[1], p[2], p[3]) for p in pairs], args.repeats)
  str_results, str_times, str_cpu_times = time_calls(
      [lambda x=x: symbolic.compare(x[0], x[1], constraints=x[2]) for x in strings], args.repeats)
  # The string API must answer exactly as the core does on the polynomials it was printed from.
  str_mismatch = [{"lhs": l, "rhs": r, "constraints": list(c), "string": str(a), "poly": str(o)}
                  for (l, r, c), a, o in zip(strings, str_results, results) if a != o]
  load_after = list(os.getloadavg())

  wrong, kinds, methods, per_setting = [], collections.Counter(), collections.Counter(), {}
  jax_counts, jax_wrong = collections.Counter(), 0
  for (name, lhs, rhs, cons, ranges), o in zip(pairs, results):
    kinds[o.kind] += 1
    methods[o.method] += 1
    st = per_setting.setdefault(name, collections.Counter())
    st["pairs"] += 1
    st["decided"] += o.decided
    problem = check(o, lhs, rhs, cons, ranges)
    if problem:
      wrong.append({"lhs": str(lhs), "rhs": str(rhs), "constraints": list(cons.source),
                    "answer": str(o), "problem": problem})
    jax = jax_baseline(lhs, rhs, cons.source)
    jax_counts[jax] += 1
    # JAX's True claims lhs >= rhs everywhere, False claims lhs < rhs everywhere.
    if (jax == "True" and o.kind not in ("GE", "EQ")) or (jax == "False" and o.kind != "LE"):
      jax_wrong += o.decided
  wall = time.perf_counter() - t_start

  n = len(pairs)
  decided = sum(o.decided for o in results)
  str_decided = sum(o.decided for o in str_results)
  t_str = time_summary(str_times, str_cpu_times, args.repeats)
  targets = {"mean_le_100us": t_str["mean"] <= 100, "p99_le_1ms": t_str["p99"] <= 1000,
             "decided_ge_99pct": str_decided >= 0.99 * n, "wrong_0": not wrong,
             "same_answers": not str_mismatch}
  summary = {
      "environment": {"python_loop_us": _common.python_speed_us()},
      "pairs": n, "seed": args.seed, "wrong": len(wrong), "decided": decided,
      "decided_share": decided / n,
      "kinds": dict(kinds), "methods": dict(methods),
      "per_setting": {k: dict(v) for k, v in per_setting.items()},
      # The core on pre-parsed polynomials and normalized constraints.
      "time_us": time_summary(times, cpu_times, args.repeats),
      # The public string API, parsing and constraint normalization included.
      "string_api": {"time_us": t_str, "decided": str_decided, "mismatches": len(str_mismatch),
                     "mismatch_examples": str_mismatch[:5],
                     "with_operations": sum("(" in l + r for l, r, _ in strings)},
      "targets": targets,
      "load_average": load_after, "load_average_before": load_before,
      "jax_ge": {"answers": dict(jax_counts),
                 "decided_share": (jax_counts["True"] + jax_counts["False"]) / n,
                 "disagreements_with_decided_exact": jax_wrong},
      "wrong_examples": wrong[:20],
      "wall_s": wall,
  }
  print(f"pairs: {n} (seed {args.seed}), settings: {', '.join(per_setting)}")
  print(f"wrong answers: {len(wrong)}")
  print(f"decided: {decided}/{n} = {100 * decided / n:.1f}%")
  print("kinds:   " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))
  print("methods: " + ", ".join(f"{k} {v}" for k, v in methods.most_common()))
  for k, v in per_setting.items():
    print(f"  {k:20s} decided {v['decided']}/{v['pairs']}")
  for label, t in (("string API, parsing included", t_str), ("pre-parsed compare_polys", summary["time_us"])):
    print(f"time per compare, {label} (caches cleared, best of {args.repeats}): "
          f"mean {t['mean']:.0f} us, p50 {t['p50']:.0f} us, p99 {t['p99']:.0f} us, "
          f"max {t['max']:.0f} us; thread CPU time mean {t['cpu_mean']:.0f} us, "
          f"p50 {t['cpu_p50']:.0f} us")
  print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after timing "
        f"({os.cpu_count()} cpus); this machine's Python speed: "
        f"{summary['environment']['python_loop_us']:.0f} us for the reference loop "
        "(_common.python_speed_us)")
  print(f"string API: {str_decided}/{n} decided, {len(str_mismatch)} answers differ from the core; "
        f"targets: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in targets.items()))
  print(f"JAX's own >= decided {jax_counts['True'] + jax_counts['False']}/{n} "
        f"({dict(jax_counts)}); disagreements with exact answers: {jax_wrong}")
  for w in wrong[:5]:
    print("WRONG:", w)
  for m in str_mismatch[:5]:
    print("STRING API DIFFERS:", m)
  print(f"wall time {wall:.0f} s")
  print(f"wrote {_common.write_results(args.out, summary)}")
  return 0 if not wrong and not str_mismatch and decided >= 0.99 * n else 1


if __name__ == "__main__":
  sys.exit(main())
