"""How many compiles `symmem.jit` needs to reach a variant that fits, over every budget.

  python -m experiments.bench_recompile [--workloads=llama,t5] [--out PATH]   (bench_models' flags)
  python -m experiments.bench_recompile --third_party=bert,bart [--out PATH]   (transformers' models)
  python -m experiments.bench_recompile --replay experiments/results/bench_recompile.json
      [--figure=modeled]   # replay deciding by the modeled peak (files that record it)
      [--figure=today]     # ... by symmem.jit's figure computed today for the same plans

For each step of `experiments.bench_models` at its two longer lengths, compiles every
round as `symmem.jit` compiles it under a budget and records the modeled peak and XLA's
`memory_analysis()` footprint. Then it replays `variants.search_rounds` (the search
`symmem.jit` runs when a new shape arrives) on those figures for 101 budgets evenly
spaced between the smallest and the largest footprint, with the first round chosen by
the model alone (a new shape, no calibration yet; where that round fits at once, the
search also tries the first earlier round predicted to fit, as `symmem.jit` does under
a budget), and counts per search: compiles,
whether a fitting round was reached, and how many rounds past the smallest fitting one
it dispatched (extra recomputation). Two jump rules side by side: XLA's ratio alone
(margin 0: the rule before) and the ratio with the last prediction's error as margin
(`variants.next_round`, now). For the margin rule it also replays what the shape's later
calls do (`variants.refine_round`, at most MAX_RECOMPILES more compiles): the rounds past
the smallest fitting one that every later call runs, and the compiles that took.
`--replay` re-runs the replay on a results file's figures and writes it (with the
figures, and the revision and date they were measured at) to --out.
"""

from __future__ import annotations

import collections
import contextlib
import json
from unittest import mock

from absl import app
from absl import flags
import jax

from experiments import _common
from experiments import bench_models
from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import remat
from jax_symmem._src import variants

# --workloads and --out are bench_models' flags (imported above); --out's default here:
flags.FLAGS.set_default("out", "experiments/results/bench_recompile.json")
REPLAY = flags.DEFINE_string("replay", None, "replay the search on this results file only")
THIRD_PARTY = flags.DEFINE_list("third_party", None,
                                "measure these models of experiments.third_party instead "
                                "(transformers' and Haiku's; their two longer lengths, b=4)")
FIGURE = flags.DEFINE_enum("figure", "dispatch", ["dispatch", "modeled", "today"],
                           "the figure the replayed search decides by: symmem.jit's as "
                           "recorded (the predicted footprint), the op-by-op modeled peak "
                           "where recorded, or symmem.jit's computed today for the same plans")
BUDGETS = 101


def figures(w, analysis) -> dict:
  """{length: [(round, the figure symmem.jit decides by, XLA footprint, modeled peak)]} at
  the workload's two longer lengths. The figure is `Analysis.dispatch_figure`: the predicted
  footprint, or with JAX_SYMMEM_XLA_BUFFERS=0 the modeled peak (files before 2026-12-02
  hold (round, modeled peak, XLA footprint))."""
  return {str(s): _rows(analysis, f"{w.name} s={s}", w.dims(s), (w.state(), *w.batch(s)))
          for s in w.lengths[1:]}


def _rows(analysis, label: str, dims, args) -> list[tuple[int, int, int, int]]:
  """Every round at dims, compiled as symmem.jit compiles it under a budget: `figures`' rows."""
  rows = []
  for k in range(len(analysis.rounds)):
    exe, _ = bench_models._compile_round(analysis, k, dims, args)
    rows.append((k, analysis.dispatch_figure(k, dims), bench_models._footprint(exe),
                 analysis.round_peak(k, dims)))
  print(f"{label}: " + " ".join(f"{k}:{p / 2**20:.0f}/{x / 2**20:.0f}" for k, p, x, _ in rows),
        flush=True)
  return rows


def third_party_figures(name: str) -> tuple[dict, dict]:
  """`figures` and `roles` of an `experiments.third_party` model, planned as its run plans it."""
  import numpy as np   # noqa: PLC0415 - the third-party models load only when asked for
  import jax_symmem as symmem   # noqa: PLC0415
  from experiments import third_party   # noqa: PLC0415
  from jax_symmem.examples import llama   # noqa: PLC0415
  m = third_party.MODELS[name]()
  params = m["init"](jax.random.PRNGKey(0))
  state = {"params": params, "opt_state": llama.make_optimizer().init(params)}
  step_fn = llama.adamw_train_step(m["loss_fn"])
  lengths = m.get("lengths", third_party.LENGTHS)
  batch = lambda s: m["batch"](third_party.BATCH, s, np.random.RandomState(0))
  analysis = symmem.analyze(step_fn, state, *batch(lengths[0]),
                            polymorphic_shapes=m["shapes"], constraints=m["constraints"])
  out = {str(s): _rows(analysis, f"{name} s={s}", m["dims"](third_party.BATCH, s), (state, *batch(s)))
         for s in lengths[1:]}
  return out, roles(analysis)


def today(name: str, lengths: dict) -> dict:
  """Recorded rows with the figure symmem.jit decides by computed today (the XLA figures
  stay as measured: the plans must be the ones they were measured on)."""
  if name not in bench_models.WORKLOADS:
    raise SystemExit(f"{name}: --figure=today replans bench_models' workloads only")
  w = bench_models.WORKLOADS[name]()
  analysis = bench_models._analysis(w)
  out = {}
  for s, rows in lengths.items():
    if len(rows) != len(analysis.rounds):
      raise SystemExit(f"{name}: {len(rows)} rounds measured, {len(analysis.rounds)} planned "
                       "today; --figure=today needs the same plans")
    dims = w.dims(int(s))
    out[s] = [[k, analysis.dispatch_figure(k, dims), *rest] for k, _, *rest in rows]
  return out


def _old_rule(peaks, k, size, predicted, tried, fits, _next=variants.next_round):
  del predicted   # the jump before: XLA's ratio, no margin
  return _next(peaks, k, size, size, tried, fits)


def roles(analysis) -> dict:
  """Which rounds the search treats apart: the planner's last, and the step as written
  (jax.jit's program: round 0, or an annotated step's round after the planner's last)."""
  return {"rounds": len(analysis.rounds), "last": remat.last_planned(analysis.rounds),
          "as_written": analysis.as_written_round}


def replay(rows, rule: str, role: dict | None = None) -> dict:
  """The search over BUDGETS budgets on one (workload, length)'s figures."""
  role = role or {}
  column = 3 if FIGURE.value == "modeled" and len(rows[0]) > 3 else 1
  peaks = [row[column] for row in rows]
  xla = [row[2] for row in rows]
  lo, hi = min(xla), max(xla)
  compiles, extra, unreached = collections.Counter(), [], 0
  refined, later = [], []   # after the later calls' refinement: extra rounds, compiles
  for i in range(BUDGETS):
    budget = lo + (hi - lo) * i // (BUDGETS - 1)
    fits = lambda b: b <= budget
    first, _ = analysis_lib.first_round(peaks, fits)   # the model's pick, no calibration
    patch = (mock.patch.object(variants, "next_round", _old_rule) if rule == "ratio"
             else contextlib.nullcontext())
    with patch:
      # scale={}: no ratio from other shapes, as compile_fitting passes at a new shape.
      tried = variants.search_rounds(peaks, first, peaks[first], xla.__getitem__, fits,
                                     scale={}, last=role.get("last"),
                                     as_written=role.get("as_written", 0))
    compiles[len(tried)] += 1
    reached = [k for k, x in tried if fits(x)]
    if not reached:
      unreached += 1
      continue
    smallest = next(k for k, x in enumerate(xla) if fits(x))
    extra.append(min(reached) - smallest)
    if rule == "margin":   # the shape's later calls (jit.SymmemFunction._refine)
      first_call = len(tried)
      for _ in range(variants.MAX_RECOMPILES):
        j = variants.refine_round(peaks, tried, fits)
        if j is None:
          break
        tried.append((j, xla[j]))
      refined.append(min(k for k, x in tried if fits(x)) - smallest)
      later.append(len(tried) - first_call)
  n = sum(compiles.values())
  out = {"compiles": dict(sorted(compiles.items())),
         "at_most_2": sum(c for k, c in compiles.items() if k <= 2) / n,
         "mean_compiles": sum(k * c for k, c in compiles.items()) / n,
         "unreached": unreached, "mean_extra_rounds": sum(extra) / max(1, len(extra)),
         "max_extra_rounds": max(extra, default=0)}
  if rule == "margin":
    out.update(refined_mean_extra_rounds=sum(refined) / max(1, len(refined)),
               refined_max_extra_rounds=max(refined, default=0),
               mean_refinement_compiles=sum(later) / max(1, len(later)))
  return out


def summarize(table: dict, table_roles: dict) -> dict:
  out = {}
  for rule in ("ratio", "margin"):
    per, total = {}, collections.Counter()
    extra, n = 0.0, 0
    for name, lengths in table.items():
      for s, rows in lengths.items():
        r = per[f"{name} s={s}"] = replay(rows, rule, table_roles.get(name))
        total.update(r["compiles"])
        extra += r["mean_extra_rounds"] * BUDGETS
        n += BUDGETS
    count = sum(total.values())
    out[rule] = {"per_step": per, "compiles": dict(sorted(total.items())),
                 "at_most_2": sum(c for k, c in total.items() if k <= 2) / count,
                 "mean_compiles": sum(k * c for k, c in total.items()) / count,
                 "mean_extra_rounds": extra / n}
    later = ""
    if rule == "margin":   # every (step, length) replays the same number of budgets
      for key in ("refined_mean_extra_rounds", "mean_refinement_compiles"):
        out[rule][key] = sum(r[key] for r in per.values()) / len(per)
      later = (f"; after the later calls' refinement {out[rule]['refined_mean_extra_rounds']:.2f}"
               f" rounds past, {out[rule]['mean_refinement_compiles']:.2f} more compiles")
    print(f"{rule:>6}: compiles {out[rule]['compiles']}, <= 2 in "
          f"{100 * out[rule]['at_most_2']:.1f} %, mean {out[rule]['mean_compiles']:.2f}, "
          f"rounds past the smallest fitting one {out[rule]['mean_extra_rounds']:.2f}{later}")
    for step, r in per.items():
      refined = (f"; refined {r['refined_mean_extra_rounds']:.2f} (max "
                 f"{r['refined_max_extra_rounds']}) in {r['mean_refinement_compiles']:.2f} more "
                 "compiles" if rule == "margin" else "")
      print(f"        {step:<22} <= 2: {100 * r['at_most_2']:5.1f} %  mean compiles "
            f"{r['mean_compiles']:.2f}  extra rounds {r['mean_extra_rounds']:.2f} "
            f"(max {r['max_extra_rounds']})  unreached {r['unreached']}{refined}")
  return out


def main(argv):
  del argv
  if REPLAY.value:
    with open(REPLAY.value) as f:
      measured = json.load(f)
    table = measured["figures"]
    if FIGURE.value == "today":
      table = {name: today(name, lengths) for name, lengths in table.items()}
    # Files from before the roles were recorded: the plan made now, where it has as many
    # rounds as were measured (else the defaults: the last round and round 0).
    table_roles = measured.get("roles")
    if table_roles is None:
      table_roles = {}
      for name, lengths in table.items():
        r = roles(bench_models._analysis(bench_models.WORKLOADS[name]()))
        if r["rounds"] == len(next(iter(lengths.values()))):
          table_roles[name] = r
    out = {"figures": table, "roles": table_roles, "budgets": BUDGETS,
           "replay": summarize(table, table_roles),
           "figures_measured": measured.get("figures_measured") or {
               k: measured.get(k) for k in ("git_revision", "date", "command")}}
    _common.write_results(bench_models.OUT.value, out)
    print(f"wrote {bench_models.OUT.value}")
    return
  table, table_roles = {}, {}
  if THIRD_PARTY.value:
    for name in THIRD_PARTY.value:
      table[name], table_roles[name] = third_party_figures(name)
      jax.clear_caches()
  for name in [] if THIRD_PARTY.value else (
      bench_models.WORKLOADS_FLAG.value or list(bench_models.WORKLOADS)):
    w = bench_models.WORKLOADS[name]()
    analysis = bench_models._analysis(w)
    table[name], table_roles[name] = figures(w, analysis), roles(analysis)
    jax.clear_caches()
  out = {"figures": table, "roles": table_roles, "budgets": BUDGETS,
         "replay": summarize(table, table_roles)}
  _common.write_results(bench_models.OUT.value, out)
  print(f"wrote {bench_models.OUT.value}")


if __name__ == "__main__":
  app.run(main)
