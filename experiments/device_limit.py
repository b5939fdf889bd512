"""symmem.jit with no memory_budget on a device with a memory limit (a GPU), against jax.jit.

There a new shape first compiles the step as written (exactly jax.jit's program) and runs
it where XLA's memory_analysis() fits the device's limit, without planning; only where it
does not (where jax.jit runs out of memory) is the step planned and a round that fits run
(planned before that compile where the step as written is predicted over the limit).
This checks both sides on the small Llama preset (b=4; lengths ascending) with the device
limited to --limit_mib (XLA_PYTHON_CLIENT_MEM_FRACTION, set for a child process from the
device's total): per length, whether jax.jit ran or ran out of memory, the round
symmem.jit ran, whether the plan had been made by then, its compiles, XLA's figure beside
the limit, the device's peak so far, and whether the loss and parameters equal jax.jit's
(where it ran). On the CPU, which reports no limit, every length runs as written unplanned
(a smoke run).

  python -m experiments.device_limit [--limit_mib 400] [--lengths 128,256,512] [--out PATH]

Writes experiments/results/device_limit.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # also run as `python experiments/device_limit.py`

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402

_CHILD = """
import json, sys
import jax
from experiments import _common
import jax_symmem as symmem
from jax_symmem.examples import llama

lengths = [int(s) for s in sys.argv[1].split(",")]
cfg = llama.PRESETS["small"]
stats = lambda: jax.local_devices()[0].memory_stats() or {}
step = llama.jit_step(llama.train_step_fn(llama.Llama(cfg)), use_symmem=True,
                      max_len=max(lengths), max_batch=4)
reference = jax.jit(llama.train_step_fn(llama.Llama(cfg)))
state = llama.init_state(cfg)
rows = []
for s in lengths:
  batch = llama.example_batch(cfg, 4, s)
  try:
    want = jax.device_get(reference(state, *batch))
  except Exception as e:   # XlaRuntimeError: RESOURCE_EXHAUSTED where jax.jit does not fit
    if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
      raise
    want = None
  before = step.cache_info()["compiles"]
  got = jax.device_get(step(state, *batch))
  call = step.last_call
  rows.append({"length": s, "jax_jit": "ran" if want is not None else "out of memory",
               "round": call["round"], "planned": step.analyze(state, *batch).planning.done,
               "compiles": step.cache_info()["compiles"] - before,
               "xla_mib": call["xla_bytes"] / 2**20,
               "limit_mib": None if call["budget"] is None else call["budget"] / 2**20,
               "peak_so_far_mib": stats().get("peak_bytes_in_use", 0) / 2**20 or None,
               "equal_to_jax_jit": None if want is None else _common.trees_close(got, want)})
  del got, want
print(json.dumps({"platform": jax.devices()[0].platform, "rows": rows}))
"""

_TOTAL = """
import json, jax
stats = jax.local_devices()[0].memory_stats() or {}
print(json.dumps({"bytes_limit": stats.get("bytes_limit")}))
"""


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--limit_mib", type=float, default=400.0,
                      help="the device's memory for the measured process (GPU)")
  parser.add_argument("--lengths", default="128,256,512")
  parser.add_argument("--out", default="experiments/results/device_limit.json")
  args = parser.parse_args()
  env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
  # The allocator's default limit is 75 % of the device's memory: the fraction for the
  # limit asked for follows from it.
  default_limit = _common.run_python(_TOTAL, [], env)["bytes_limit"]
  if default_limit is not None:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{args.limit_mib * MiB / (default_limit / 0.75):.6f}"
  result = _common.run_python(_CHILD, [args.lengths], env)
  print(f"{result['platform']}, device limit "
        + ("none (CPU: every length runs as written, unplanned)" if default_limit is None
           else f"{args.limit_mib:.0f} MiB (XLA_PYTHON_CLIENT_MEM_FRACTION "
           f"{env['XLA_PYTHON_CLIENT_MEM_FRACTION']})"))
  print("  s  jax.jit         round planned compiles  XLA MiB  limit MiB  peak so far  equal")
  for r in result["rows"]:
    fmt = lambda v: "—" if v is None else f"{v:.1f}"
    print(f"{r['length']:4d}  {r['jax_jit']:14s} {r['round']:5d} {str(r['planned']):7s} "
          f"{r['compiles']:8d} {r['xla_mib']:8.1f} {fmt(r['limit_mib']):>10s} "
          f"{fmt(r['peak_so_far_mib']):>11s}  {r['equal_to_jax_jit']}")
  path = _common.write_results(args.out, {"limit_mib": args.limit_mib if default_limit else None,
                                          "lengths": args.lengths, **result})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
