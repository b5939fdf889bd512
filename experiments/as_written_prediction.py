"""How well the step as written is predicted before planning, on third-party and our own steps.

Under a device's limit with no memory_budget, `symmem.jit` compiles a new shape's step as
written first, unless `Analysis.unplanned_footprint` (the model's live ranges in the trace's
order, no plan) predicts it over the limit; from the second shape on that prediction is
scaled by XLA's figure over it at the largest shape compiled so far
(`jit._Entry.unplanned_ratio`). This measures, per third-party step (experiments/third_party.py's
models without jax.checkpoint regions, b=4; or with --workloads experiments.bench_models'
steps) and length, the prediction and XLA's figure for
the step as written compiled as that path compiles it, and, over every pair of a length and
the one before it (as a job whose shapes grow meets them), the error of three ways to
predict the larger from the smaller: the raw prediction, scaled by the smaller's ratio, and
shifted by the smaller's difference.

  python -m experiments.as_written_prediction [--models gpt2,bart,...] [--lengths 64,...]
  python -m experiments.as_written_prediction --workloads llama_scan,llama_accum --out PATH

Writes experiments/results/as_written_prediction.json (or --out).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # also run as `python experiments/as_written_prediction.py`


from experiments import _common  # noqa: E402
from experiments import bench_models  # noqa: E402
from experiments import third_party  # noqa: E402
from experiments._common import MiB  # noqa: E402
import jax_symmem as symmem  # noqa: E402
from jax_symmem._src import variants  # noqa: E402

MODELS = ("gpt2,bart,haiku_stack,mistral,t5,gpt_neo,opt,bloom,pegasus,roformer,gemma,bert,"
          "albert,xglm,gptj,longt5")
LENGTHS = (64, 128, 256, 384, 512)
# Each way predicts a length's figure from the length before: (its prediction, the
# prediction at the length before, XLA's figure there).
RULES = {"raw": lambda p, before, xla: p,
         "scaled": lambda p, before, xla: p * xla / before,
         "shifted": lambda p, before, xla: p + xla - before}


def _third_party(name: str, lengths):
  """(step, its polymorphic shapes and constraints, state, {length: batch}, length -> dims)."""
  third_party.LENGTHS = tuple(lengths)   # a model with lengths of its own keeps them
  m, state, step_fn, lengths, batches = third_party._model_step(name)
  return (step_fn, m["shapes"], m["constraints"], state, batches,
          lambda s: m["dims"](third_party.BATCH, s))


def _workload(name: str):
  """The same for one of experiments.bench_models' steps, at its own three lengths."""
  if not bench_models.flags.FLAGS.is_parsed():
    bench_models.flags.FLAGS(["as_written_prediction"])   # its absl flags at their defaults
  w = bench_models.WORKLOADS[name](bench_models.Geometry())
  return (w.step(None), w.shapes, w.constraints, w.state(),
          {s: w.batch(s) for s in w.lengths}, w.dims)


def run_model(name: str, make) -> dict:
  step_fn, shapes, constraints, state, batches, dims_of = make()
  step = symmem.jit(step_fn, polymorphic_shapes=shapes, constraints=constraints)
  lengths = list(batches)
  analysis = step.analyze(state, *batches[lengths[0]])
  if analysis.planning.annotated:
    return {"model": name, "skipped": "jax.checkpoint regions: planned at once"}
  rows = []
  for s in lengths:
    dims = dims_of(s)
    predicted = analysis.unplanned_footprint(dims)
    # Round 0, the step as written, with the options the unplanned path compiles it with
    # (on CPU: XNNPACK for single dots only, so that XLA's figure sees every buffer).
    exe, _ = bench_models._compile_round(analysis, 0, dims, (state, *batches[s]))
    xla = variants.footprint(exe) + analysis.round_scratch(0, dims)
    rows.append({"dims": dims, "predicted_mib": predicted / MiB, "xla_mib": xla / MiB,
                 "ratio": xla / predicted})
    print(f"{name} {dims}: predicted {predicted / MiB:.2f} MiB, XLA {xla / MiB:.2f} MiB, "
          f"XLA / predicted {xla / predicted:.4f}", flush=True)
  assert not analysis.planning.done   # nothing here needed the plan
  return {"model": name, "rows": rows}


def errors(results) -> dict:
  """Per way of predicting: its errors in % of XLA's figure over every (length, next)."""
  out = {rule: [] for rule in RULES}
  for result in results:
    rows = result.get("rows", [])
    for before, row in zip(rows, rows[1:]):
      for rule, f in RULES.items():
        guess = f(row["predicted_mib"], before["predicted_mib"], before["xla_mib"])
        out[rule].append(100 * (guess - row["xla_mib"]) / row["xla_mib"])
  return out


def summary(errs) -> dict:
  a = sorted(abs(e) for e in errs)
  return {"pairs": len(errs), "mean_pct": statistics.mean(errs),
          "rms_pct": math.sqrt(statistics.mean(e * e for e in errs)),
          "median_abs_pct": statistics.median(a), "max_abs_pct": a[-1],
          "within_1pct": sum(e <= 1 for e in a), "within_2pct": sum(e <= 2 for e in a)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=MODELS, help="experiments.third_party's models")
  parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                      help="the third-party models' lengths")
  parser.add_argument("--workloads", default="", help="experiments.bench_models' steps "
                      "instead (each at its own three lengths), e.g. llama_scan,llama_accum")
  parser.add_argument("--out", default=str(ROOT / "experiments/results/as_written_prediction.json"))
  args = parser.parse_args(argv)
  lengths = [int(s) for s in args.lengths.split(",")]
  if args.workloads:
    results = _common.run_workloads(
        args.workloads, lambda name: run_model(name, lambda: _workload(name)),
        args.out)
  else:
    results = _common.run_workloads(
        args.models, lambda name: run_model(name, lambda: _third_party(name, lengths)),
        args.out, batch=third_party.BATCH, lengths=lengths)
  table = {rule: summary(e) for rule, e in errors(results).items() if e}
  for rule, row in table.items():
    print(f"{rule:8s} {row['pairs']} pairs: mean {row['mean_pct']:+.2f} %, rms "
          f"{row['rms_pct']:.2f} %, median |error| {row['median_abs_pct']:.2f} %, max "
          f"{row['max_abs_pct']:.2f} %, within 1 %: {row['within_1pct']}, within 2 %: "
          f"{row['within_2pct']}")
  _common.write_results(args.out, {**({} if args.workloads else {
      "batch": third_party.BATCH, "lengths": lengths}), "results": results, "errors": table})
  return 0


if __name__ == "__main__":
  sys.exit(main())
