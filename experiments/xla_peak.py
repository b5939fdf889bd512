"""What XLA holds at its peak: a round's footprint split into live bytes and packing.

`memory_analysis()` gives one figure per executable. Where a round's footprint and per-layer
checkpointing's part, that figure does not say whether the round keeps more alive at XLA's
peak or XLA packs its buffers worse. XLA's own dump does: its live-range report names the
peak of its heap simulation and the values live there, by the JAX op that made each. For a
`bench_models` workload at one length, this compiles per-layer checkpointing (barriers
kept, XNNPACK for single dots as under a budget) and the chosen rounds as `symmem.jit`
compiles them under a budget, each with
`xla_dump_to` set, and prints per variant, in MiB:

* the footprint (`memory_analysis()`: arguments + outputs + temp - alias);
* XLA's live bytes at its peak, and the rest of the footprint: packing (what the buffer
  assigner's layout adds over the peak: fragmentation, outputs allocated apart);
* the live bytes at the peak by JAX op (largest first) and the peak's largest values;
* for rounds, the op-by-op model's peak and the prediction `symmem.jit` decides by.

  python -m experiments.xla_peak --workload gpt2 [--length 512] [--rounds 0,last,floor]
      [--d_model 256] [--out PATH]

The live-range report is XLA's debug output (`*-live-range.txt`), not an API: its format
may change with jaxlib. Writes experiments/results/xla_peak_<workload>.json (or --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import tempfile

import jax

from experiments import _common
from experiments import bench_models
from experiments._common import MiB
from jax_symmem._src import variants

_PEAK = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")
_BY_OP = re.compile(r"── (.+?) \([\d.]+%, total: ([\d ]+) bytes")
_LIVE = re.compile(r"^\s+(\S+)\{\S*\}: (\d+) bytes")


def _int(text: str) -> int:
  return int(text.replace(" ", ""))


def parse_live_range(text: str) -> dict:
  """XLA's peak (bytes), the bytes live there by JAX op, and the largest values there."""
  peak = _PEAK.search(text)
  if peak is None:
    raise ValueError("no 'Stack trace breakdown for peak usage' in XLA's live-range report")
  by_op: dict[str, int] = {}
  for name, total in _BY_OP.findall(text[peak.end():]):
    # "jit(fn)/exp" -> "exp"; arguments are listed by their names ("a[3]", "x"): one entry
    op = name.rsplit("/", 1)[-1] if "/" in name else "arguments"
    by_op[op] = by_op.get(op, 0) + _int(total)
  values = []
  section = text[text.index("Live ranges at"):peak.start()] if "Live ranges at" in text else ""
  for line in section.splitlines():
    m = _LIVE.match(line)
    if m:
      values.append((m.group(1), int(m.group(2))))
  values.sort(key=lambda nv: -nv[1])
  return {"peak": _int(peak.group(1)), "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
          "largest_values": values[:8]}


def compile_and_read(fn, args, options: dict, name: str) -> dict:
  """`fn` compiled with `options` and XLA's dump: its footprint and its peak's live set."""
  fn.__name__ = name   # names the dumped module
  with tempfile.TemporaryDirectory() as dump:
    exe = jax.jit(fn).lower(*args).compile(
        compiler_options=dict(options, xla_dump_to=dump))
    reports = list(pathlib.Path(dump).glob(f"*jit_{name}.*live-range.txt"))
    if len(reports) != 1:
      raise RuntimeError(f"XLA's dump of jit_{name} holds {len(reports)} live-range reports, "
                         f"not 1 (jax {jax.__version__}; jax 0.10's XLA writes one)")
    (report,) = reports
    live = parse_live_range(report.read_text())
  footprint = _common.xla_memory(exe)["footprint"]
  return dict(live, footprint=footprint, packing=footprint - live["peak"])


def run(workload: str, length: int | None, rounds: list[str], d_model: int | None) -> dict:
  g = bench_models.Geometry() if d_model is None else dataclasses.replace(
      bench_models.Geometry(), d_model=d_model)
  w = bench_models.WORKLOADS[workload](g)
  length = length or w.lengths[-1]
  state = bench_models._state(w)
  args = (state, *w.batch(length))
  dims = w.dims(length)
  rows = []
  per_layer = w.step("layer")
  # With the options the rounds get under a budget (on CPU: XNNPACK for single dots only,
  # whose buffers XLA sees), not bench_models' (XNNPACK's fusions, F2).
  options = dict(bench_models._per_layer_options(), **bench_models.BUDGET_XNNPACK)
  rows.append(dict(variant="per-layer checkpointing", **compile_and_read(
      lambda *a: per_layer(*a), args, options, "per_layer")))
  analysis = bench_models._analysis(w, state)
  last = len(analysis.rounds) - 1
  named = {"last": last, "floor": analysis.floor_round(dims)}
  flat = jax.tree_util.tree_leaves(args)
  for k in dict.fromkeys(named.get(r) if r in named else int(r) for r in rounds):
    if k > last:
      continue
    fn = variants.round_function(analysis, k, dims)
    row = compile_and_read(lambda *a, fn=fn: fn(*a), flat, variants.round_options(analysis, k),
                           f"round{k}")
    rows.append(dict(variant=f"round {k}", model=analysis.round_peak(k, dims),
                     predicted=analysis.round_footprint(k, dims), **row))
  return {"workload": workload, "dims": dims, "d_model": g.d_model, "rounds": last, "rows": rows}


def _print(result: dict) -> None:
  print(f"{result['workload']} (d_model {result['d_model']}) at {result['dims']}, "
        f"{result['rounds']} rounds; MiB")
  for r in result["rows"]:
    model = (f"; model {r['model'] / MiB:.1f}, predicted {r['predicted'] / MiB:.1f}"
             if "model" in r else "")
    ops = ", ".join(f"{op} {b / MiB:.1f}" for op, b in list(r["by_op"].items())[:6])
    print(f"  {r['variant']:24s} footprint {r['footprint'] / MiB:6.1f} = live at XLA's peak "
          f"{r['peak'] / MiB:6.1f} + packing {r['packing'] / MiB:5.1f}{model}\n"
          f"      at the peak: {ops}", flush=True)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--workload", required=True, choices=sorted(bench_models.WORKLOADS))
  ap.add_argument("--length", type=int, default=None, help="default: the workload's longest")
  ap.add_argument("--rounds", default="0,floor,last",
                  help="comma-separated round numbers, 'floor' and 'last'")
  ap.add_argument("--d_model", type=int, default=None)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  bench_models.flags.FLAGS(["xla_peak"])   # bench_models' absl flags at their defaults
  result = run(args.workload, args.length, args.rounds.split(","), args.d_model)
  _print(result)
  out = _common.write_results(
      args.out or f"experiments/results/xla_peak_{args.workload}.json", result)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
