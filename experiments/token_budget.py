"""Batches of a fixed number of tokens: `b*s <= T` cuts off the box's largest corner.

Token-budget batching (many short sequences or a few long ones, about T tokens a
step) declares `b <= B, s <= S, b*s <= T`, or leaves b's bound to the inequality (b <=
T/2 with s >= 2: `Constraints.planning_bounds`). No call has b = B and s = S, where the
rounds are planned first (`ShapeGraph.max_dims`); the planner then also plans at the
largest allowed points along the cut (`Constraints.cut_corners`, via
`remat._smaller_shapes`). For each step (AdamW, masked loss) this prints and writes:

* the ladder planned three ways: at the box's corner alone (`later_shapes=[]`), with
  the midpoint and geometric-mean shapes as before 2026-12-06 (cut corners and bounds
  implied by the inequality switched off), and as planned now; the rounds and the
  floor (smallest modeled peak over the rounds) at each shape along the cut, b = T / s
  for s = S/8, S/4, S/2, S;
* with `--budget_fraction` f, `symmem.jit` under a budget f of the way from the
  largest floor to round 0's modeled peak at the long-sequence corner, at each of
  those shapes: the round it runs, XLA's figure against the budget, compiles, and the
  updated state and loss against `jax.jit` compiled with the variant's options
  (`_common.trees_close`; where they differ, `_common.deviation`: recomputing rounds
  round differently, and AdamW's first step turns a gradient element near zero into a
  full step of either sign, so compare the first moments).

    python -m experiments.token_budget [--workloads llama,llama_scan,gpt2]
        [--tokens 8192] [--max_batch 64] [--budget_fraction 0.05] [--out PATH]
    python -m experiments.token_budget --max_batch 0 --out experiments/results/token_budget_implied.json
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

from absl import app
from absl import flags
import jax

from experiments import _common
from experiments._common import MiB
import jax_symmem as symmem
from jax_symmem._src import constraints as constraints_lib
from jax_symmem._src import remat
from jax_symmem.examples import gpt2
from jax_symmem.examples import llama

WORKLOADS = flags.DEFINE_list("workloads", ["llama", "llama_scan", "gpt2"],
                              "steps: llama, llama_scan (nn.scan over the layers), gpt2 "
                              "(the examples' small presets, S = their max_len)")
TOKENS = flags.DEFINE_integer("tokens", 8192, "T: b*s <= T")
MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "B: b <= B (0: no such constraint, as a "
                                 "token budget is often declared; b <= T / 2 is implied)")
FRACTION = flags.DEFINE_float("budget_fraction", 0.05, "where the budget sits (0: no run)")
OUT = flags.DEFINE_string("out", "experiments/results/token_budget.json", "results file")


def _workload(name: str):
  """(step_fn, state, max_len, batch(b, s))."""
  if name in ("llama", "llama_scan"):
    cfg = llama.PRESETS["small"]
    scan = name == "llama_scan"
    step = llama.train_step_fn(llama.Llama(cfg, scan_layers=scan))
    return step, llama.init_state(cfg, scan_layers=scan), cfg.max_len, \
        lambda b, s: llama.example_batch(cfg, b, s)
  if name == "gpt2":
    cfg = gpt2.PRESETS["small"]
    return llama.train_step_fn(gpt2.GPT2(cfg)), gpt2.init_state(cfg), cfg.max_len, \
        lambda b, s: gpt2.example_batch(cfg, b, s)
  raise app.UsageError(f"unknown workload {name!r}")


@contextlib.contextmanager
def _before():
  """The planner before 2026-12-06: no cut corners, no bounds implied by inequalities."""
  cls = constraints_lib.Constraints
  with mock.patch.object(cls, "cut_corners", lambda self: []), \
       mock.patch.object(cls, "planning_bounds", lambda self: self.bounds):
    yield


def _floors(analysis, shapes) -> list[float]:
  return [min(r.peak_at(d) for r in analysis.rounds) / MiB for d in shapes]


def run(name: str) -> dict:
  step_fn, state, max_len, batch = _workload(name)
  tokens = TOKENS.value
  batch_bound = (f"b <= {MAX_BATCH.value}",) if MAX_BATCH.value else ()
  constraints = (*batch_bound, "s >= 2", f"s <= {max_len}", f"b*s <= {tokens}")
  lengths = [max_len // 8, max_len // 4, max_len // 2, max_len]
  shapes = [{"b": min(MAX_BATCH.value or tokens, tokens // s), "s": s} for s in lengths]
  spec = dict(polymorphic_shapes=(None, "b, s", "b, s"), constraints=constraints)
  args = (state, *batch(2, 16))
  out = {"workload": name, "constraints": constraints, "shapes": shapes, "ladders": {}}
  ways = {
      "corner_only": mock.patch.object(remat, "_smaller_shapes", lambda g, t: []),
      "before": _before(),
      "now": contextlib.nullcontext(),
  }
  for way, patch in ways.items():
    with patch:
      t0 = time.perf_counter()
      analysis = symmem.analyze(step_fn, *args, **spec)
      seconds = time.perf_counter() - t0
    floors = _floors(analysis, shapes)
    out["ladders"][way] = {"rounds": len(analysis.rounds) - 1, "floors_mib": floors,
                           "plan_s": seconds}
    print(f"{name} {way:>11}: {len(analysis.rounds) - 1:2d} rounds, floors "
          + ", ".join(f"({d['b']}, {d['s']}) {f:.1f}" for d, f in zip(shapes, floors))
          + f" MiB ({seconds:.1f} s)", flush=True)
  if FRACTION.value <= 0:
    return out
  longest = shapes[-1]
  budget = _common.budget_between(max(out["ladders"]["now"]["floors_mib"]) * MiB,
                                  analysis.round_peak(0, longest), FRACTION.value)
  step = symmem.jit(step_fn, memory_budget=budget, **spec)
  ref = jax.jit(step_fn)
  out["budget_mib"], out["runs"] = budget / MiB, []
  for d in shapes:
    call_args = (state, *batch(d["b"], d["s"]))
    try:
      _common.settle(step, call_args)
      got = jax.block_until_ready(step(*call_args))
    except symmem.BudgetError as e:
      out["runs"].append({"dims": d, "budget_error": str(e)})
      print(f"{name} {d}: BudgetError: {e}", flush=True)
      continue
    call = step.last_call
    (variant,) = [v for v in step.variants()
                  if v["dims"] == call["dims"] and v["round"] == call["round"]]
    want = ref.lower(*call_args).compile(compiler_options=variant["compiler_options"])(*call_args)
    row = {"dims": d, "round": call["round"], "xla_mib": call["xla_bytes"] / MiB,
           "fits": call["xla_bytes"] + call["reserved"] <= budget,
           "equal_to_jax_jit": _common.trees_close(got, want),
           "compiles": step.cache_info()["compiles"]}
    if not row["equal_to_jax_jit"]:   # how far, and whether the gradients (first moments) agree
      row["deviation"] = _common.deviation(got, want)
    del got, want   # as a training loop replaces its state: not live at the next shape's call
    out["runs"].append(row)
    print(f"{name} budget {budget / MiB:.1f} MiB at ({d['b']}, {d['s']}): round {row['round']}, "
          f"XLA {row['xla_mib']:.1f} MiB, fits {row['fits']}, equal to jax.jit "
          f"{row['equal_to_jax_jit']}, compiles so far {row['compiles']}"
          + (f"; {row['deviation']}" if "deviation" in row else ""), flush=True)
  return out


def main(argv):
  del argv
  results = {"tokens": TOKENS.value, "max_batch": MAX_BATCH.value,
             "budget_fraction": FRACTION.value,
             "workloads": [run(name) for name in WORKLOADS.value]}
  print(f"wrote {_common.write_results(OUT.value, results)}")


if __name__ == "__main__":
  app.run(main)
