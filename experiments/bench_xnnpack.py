"""Why budgeted variants compile without XNNPACK fusions: XLA's figure vs the real peak.

Under a budget, `symmem.jit` compiles with `xla_cpu_experimental_ynn_fusion_type=
LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT` (XNNPACK for single dots only, `variants.XNNPACK_DOTS`;
until 2026-12-03 with "", no XNNPACK), which costs step time against XLA's default fusions
(README, "Models as people write them"). This measures, for rounds of one `experiments.bench_models` workload at one
length, the planner's round compiled with the budget options as they are and with
XNNPACK fusions left on: XLA's `memory_analysis()` footprint and the real peak
(DESIGN.md F3, a fresh process per figure). Where the footprints agree but the real
peaks do not, the fusions hold memory XLA's figure cannot see (F2), so a budget
checked against it would not hold.

  python -m experiments.bench_xnnpack [--workload llama_scan] [--length 512] [--rounds 0,4,-1]
      [--fusions off,default,dot,individual_dot,individual_dot_eltwise]

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
  w = bench_models.WORKLOADS[workload]()
  analysis = bench_models._analysis(w)
  k = len(analysis.rounds) - 1 if k < 0 else k
  args = (w.state(), *w.batch(length))
  flat = jax.tree_util.tree_leaves(args)
  options = {o: v for o, v in variants.round_options(analysis, k).items()
             if o != YNN_OFF}   # as symmem.jit compiles the round, but for the fusions
  if FUSION_TYPES[fusions] is not None:
    options[YNN_OFF] = FUSION_TYPES[fusions]
  exe = jax.jit(variants.round_function(analysis, k, w.dims(length))).lower(*flat).compile(
      compiler_options=options)
  return (lambda *_: exe(*flat)), args, {"argument_bytes": _common.tree_bytes(args),
                                         "xla": _common.xla_memory(exe)["footprint"], "round": k}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", default="llama_scan")
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--rounds", default="0,4,-1", help="rounds to compile (-1: the last)")
  parser.add_argument("--fusions", default="off,default",
                      help=f"comma-separated XNNPACK fusion settings among {sorted(FUSION_TYPES)}")
  parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_xnnpack.json"))
  args = parser.parse_args(argv)
  rows = []
  kinds = args.fusions.split(",")
  print(f"{args.workload} at length {args.length}: MiB, XLA's footprint / real peak per XNNPACK "
        f"fusion setting")
  print(f"{'round':>5} " + " ".join(f"{k:>22}" for k in kinds))
  for k in (int(x) for x in args.rounds.split(",")):
    got = {f: _common.real_peak("experiments.bench_xnnpack:measured", workload=args.workload,
                                length=args.length, k=k, fusions=f) for f in kinds}
    row = {"round": got[kinds[0]]["round"]}
    for f in kinds:
      row[f"xla_{f}"], row[f"real_{f}"] = got[f]["xla"], got[f]["real"]
    rows.append(row)
    print(f"{row['round']:>5} " + " ".join(
        f"{got[f]['xla'] / MiB:>10.1f} / {got[f]['real'] / MiB:>9.1f}" for f in kinds), flush=True)
  print(f"wrote {_common.write_results(args.out, {'workload': args.workload, 'length': args.length, 'rows': rows})}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
