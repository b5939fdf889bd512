"""Why budgeted variants compile without XNNPACK fusions: XLA's figure vs the real peak.

Under a budget, `symmem.jit` compiles with `xla_cpu_experimental_ynn_fusion_type=""`
(jax_symmem/_src/variants.py), which costs step time (README, "Models as people write
them"). This measures, for rounds of one `experiments.bench_models` workload at one
length, the planner's round compiled with the budget options as they are and with
XNNPACK fusions left on: XLA's `memory_analysis()` footprint and the real peak
(DESIGN.md F3, a fresh process per figure). Where the footprints agree but the real
peaks do not, the fusions hold memory XLA's figure cannot see (F2), so a budget
checked against it would not hold.

  python -m experiments.bench_xnnpack [--workload llama_scan] [--length 512] [--rounds 0,4,-1]

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


def measured(workload: str, length: int, k: int, xnnpack: bool):
  """(fn, args, extra) for jax_symmem.measure: round k (-1: the last) at `length`,
  compiled with the budget's XLA options, XNNPACK fusions on or off."""
  import jax
  from experiments import bench_models
  from jax_symmem._src import variants
  w = bench_models.WORKLOADS[workload]()
  analysis = bench_models._analysis(w)
  k = len(analysis.rounds) - 1 if k < 0 else k
  args = (w.state(), *w.batch(length))
  flat = jax.tree_util.tree_leaves(args)
  options = {o: v for o, v in variants.CPU_COMPILER_OPTIONS.items()
             if not (xnnpack and o == YNN_OFF)}
  exe = jax.jit(variants.round_function(analysis, k, w.dims(length))).lower(*flat).compile(
      compiler_options=options)
  return (lambda *_: exe(*flat)), args, {"argument_bytes": _common.tree_bytes(args),
                                         "xla": _common.xla_memory(exe)["footprint"], "round": k}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", default="llama_scan")
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--rounds", default="0,4,-1", help="rounds to compile (-1: the last)")
  parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_xnnpack.json"))
  args = parser.parse_args(argv)
  rows = []
  print(f"{args.workload} at length {args.length}: MiB, XNNPACK fusions off / on")
  print(f"{'round':>5} {'XLA off':>9} {'XLA on':>9} {'real off':>9} {'real on':>9} {'on - off':>9}")
  for k in (int(x) for x in args.rounds.split(",")):
    off, on = (_common.real_peak("experiments.bench_xnnpack:measured", workload=args.workload,
                                 length=args.length, k=k, xnnpack=x) for x in (False, True))
    row = {"round": off["round"], "xla_off": off["xla"], "xla_on": on["xla"],
           "real_off": off["real"], "real_on": on["real"]}
    rows.append(row)
    print(f"{row['round']:>5} {off['xla'] / MiB:>9.1f} {on['xla'] / MiB:>9.1f} "
          f"{off['real'] / MiB:>9.1f} {on['real'] / MiB:>9.1f} "
          f"{(on['real'] - off['real']) / MiB:>+9.1f}", flush=True)
  print(f"wrote {_common.write_results(args.out, {'workload': args.workload, 'length': args.length, 'rows': rows})}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
