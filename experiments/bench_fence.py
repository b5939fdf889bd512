"""Does imposing our schedule on XLA lower the compiled step's real peak? (issue 3, part 4)

For the transformer training step of experiments/workloads.py at several sequence
lengths, measures the real peak (DESIGN.md F3 protocol, fresh process each) and
XLA's memory_analysis() temp of:
  default            XLA:CPU's default scheduler
  memory_optimized   XLA:CPU's CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED scheduler
  trace_fenced       jaxpr trace order imposed with optimization barriers
  schedule_fenced    the symbolic schedule imposed with optimization barriers
  schedule_fenced_memopt  the same, compiled with the memory-optimized scheduler
Barriers are kept by disabling cse_barrier_expander (F1).

  python -m experiments.bench_fence [--lengths 64,128,256,512,1024] [--batch 4]
"""

import argparse

from experiments import _common
from experiments._common import MiB
from jax_symmem import measure

MODES = ("default", "memory_optimized", "trace_fenced", "schedule_fenced", "schedule_fenced_memopt")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="64,128,256,512,1024")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--min_mib", type=float, default=1.0, help="fence nodes whose results take >= this")
  parser.add_argument("--out", default="experiments/results/bench_fence.json")
  args = parser.parse_args()
  lengths = [int(x) for x in args.lengths.split(",")]
  rows = []
  print(f"real peak above resident arguments, MiB (XLA temp in parentheses); batch {args.batch}")
  print(f"{'seq':>5}  " + "  ".join(f"{m:>24}" for m in MODES))
  for s in lengths:
    row = {"seq": s, "batch": args.batch}
    cells = []
    for mode in MODES:
      m = measure.measure("experiments.workloads:compiled_step", batch=args.batch, seq=s, mode=mode,
                          min_mib=args.min_mib)
      row[mode] = {"real_delta": m.peak_delta, **m.extra}
      cells.append(f"{m.peak_delta / MiB:>12.1f} ({m.extra['temp'] / MiB:>8.1f})")
    rows.append(row)
    print(f"{s:>5}  " + "  ".join(f"{c:>24}" for c in cells), flush=True)
  print("\nbest per length:")
  for row in rows:
    best = min(MODES, key=lambda m: row[m]["real_delta"])
    fenced = row["schedule_fenced"]["real_delta"] / MiB
    print(f"  s={row['seq']:>5}: best {best}; schedule_fenced vs default "
          f"{fenced - row['default']['real_delta'] / MiB:+.1f} MiB, vs memory_optimized "
          f"{fenced - row['memory_optimized']['real_delta'] / MiB:+.1f} MiB")
  _common.write_results(args.out, {"min_mib": args.min_mib, "rows": rows})
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
