"""Why budgeted variants compile without XNNPACK fusions: XLA's figure vs the real peak.

Under a budget, `symmem.jit` compiles with `xla_cpu_experimental_ynn_fusion_type=
LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT` (XNNPACK for single dots only, `variants.XNNPACK_DOTS`;
until 2026-12-03 with "", no XNNPACK), which costs step time against XLA's default fusions
(experiments/RESULTS.md, "Models as people write them"). This measures, for rounds of one
`experiments.bench_models` workload at one length, the planner's round compiled with the budget options as they are and with
XNNPACK fusions left on: XLA's `memory_analysis()` footprint and the real peak
(DESIGN.md F3, a fresh process per figure). Where the footprints agree but the real
peaks do not, the fusions hold memory XLA's figure cannot see (F2), so a budget
checked against it would not hold. Each figure also records the bound `symmem.jit` puts
on what the fusions hold (`xnnpack.hidden_bytes_bound`, the largest fusion's inner
values) and the scratch XLA's figure leaves out (`Analysis.round_scratch`): round 0
compiled with XLA's own fusions runs under a budget only where XLA's figure + scratch +
bound fits (`variants.compile_with_fusions`), so the check is real <= that sum.

  python -m experiments.bench_xnnpack [--workload llama_scan[,gpt2,...]] [--length 512[,128]]
      [--rounds 0,4,-1] [--fusions off,default,dot,individual_dot,individual_dot_eltwise]

Writes experiments/results/bench_xnnpack.json (or --out).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # also run as `python experiments/bench_xnnpack.py`

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402

YNN_OFF = "xla_cpu_experimental_ynn_fusion_type"


FUSION_TYPES = {"off": "", "default": None, "dot": "LIBRARY_FUSION_TYPE_DOT",
                "individual_dot": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
                # single dots, and chains of elementwise ops (with the dot they start from)
                "individual_dot_eltwise": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                                          "LIBRARY_FUSION_TYPE_ELTWISE"}


def measured(workload: str, length: int, k: int, fusions: str):
  """(fn, args, extra) for jax_symmem.measure: round k (-1: the last) at `length`,
  compiled with the XLA options symmem.jit compiles it with under a budget, but the XNNPACK fusions `fusions` (a key of
  FUSION_TYPES: "individual_dot" is what the budget compiles with, "off" what it compiled
  with until 2026-12-03, "default" XLA's own choice)."""
  import jax
  from experiments import bench_models
  from jax_symmem._src import variants
  from jax_symmem._src import xnnpack
  w = bench_models.WORKLOADS[workload]()
  analysis = bench_models._analysis(w)
  if not -len(analysis.rounds) <= k < len(analysis.rounds):
    raise ValueError(f"{workload} has rounds 0..{len(analysis.rounds) - 1} (-1: the last); "
                     f"round {k} asked")
  k = k % len(analysis.rounds)
  args = (w.state(), *w.batch(length))
  flat = jax.tree_util.tree_leaves(args)
  options = {o: v for o, v in variants.round_options(analysis, k).items()
             if o != YNN_OFF}   # as symmem.jit compiles the round, but for the fusions
  if FUSION_TYPES[fusions] is not None:
    options[YNN_OFF] = FUSION_TYPES[fusions]
  exe = jax.jit(variants.round_function(analysis, k, w.dims(length))).lower(*flat).compile(
      compiler_options=options)
  return (lambda *_: exe(*flat)), args, {
      "argument_bytes": _common.tree_bytes(args), "xla": _common.xla_memory(exe)["footprint"],
      "round": k, "bound": xnnpack.hidden_bytes_bound(exe.as_text()),
      "scratch": analysis.round_scratch(k, w.dims(length))}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", default="llama_scan",
                      help="comma-separated experiments.bench_models workloads")
  parser.add_argument("--length", default="512", help="comma-separated lengths")
  parser.add_argument("--rounds", default="0,4,-1", help="rounds to compile (-1: the last)")
  parser.add_argument("--fusions", default="off,default",
                      help=f"comma-separated XNNPACK fusion settings among {sorted(FUSION_TYPES)}")
  parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_xnnpack.json"))
  args = parser.parse_args(argv)
  rows = []
  kinds = args.fusions.split(",")
  print("MiB per XNNPACK fusion setting: XLA's footprint / real peak / (+ scratch + bound) - real")
  print(f"{'workload':>14}{'length':>7}{'round':>6} " + " ".join(f"{k:>26}" for k in kinds))
  for workload in args.workload.split(","):
    for length in (int(x) for x in args.length.split(",")):
      for k in (int(x) for x in args.rounds.split(",")):
        got = {f: _common.real_peak("experiments.bench_xnnpack:measured", workload=workload,
                                    length=length, k=k, fusions=f) for f in kinds}
        row = {"workload": workload, "length": length, "round": got[kinds[0]]["round"]}
        for f in kinds:
          for field in ("xla", "real", "bound", "scratch"):
            row[f"{field}_{f}"] = got[f][field]
        rows.append(row)
        print(f"{workload:>14}{length:>7}{row['round']:>6} " + " ".join(
            f"{g['xla'] / MiB:>8.1f} /{g['real'] / MiB:>7.1f} /"
            f"{(g['xla'] + g['scratch'] + g['bound'] - g['real']) / MiB:>+8.1f}"
            for g in (got[f] for f in kinds)), flush=True)
  print(f"wrote {_common.write_results(args.out, {'rows': rows})}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
