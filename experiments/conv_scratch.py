"""What XLA:CPU's convolutions hold outside `memory_analysis()`: real peak vs XLA's figure.

A strided convolution's input gradient is an input-dilated convolution (`lhs_dilation`).
On CPU it holds scratch XLA's buffer assignment does not see; `symmem.jit` adds
`xla_buffers.convolution_scratch` (batch x input pixels x kernel taps x output features
x item size) to XLA's figure. This measures, for single convolutions compiled with the
budget's XLA options, the real peak (DESIGN.md F3, a fresh process per figure) minus
XLA's footprint beside that formula; also a strided forward convolution and a weight
gradient, which hold none, a transposed convolution (input-dilated, kernel 2 x 2) and
its weight gradient, which holds none either: its kernel (the output gradient) is larger
than its input, and XLA swaps the two before choosing a kernel; and two with one spatial
dim (an audio frontend's strided convolution).

  python -m experiments.conv_scratch [--cap] [--out PATH]

Writes experiments/results/conv_scratch.json (or --out).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # also run as `python experiments/conv_scratch.py`

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402

RESULTS = "experiments/results/conv_scratch.json"
# (kind, batch, input side, in features, out features, kernel side, dilation or stride)
CASES = [("input_dilated", 16, 64, 16, 16, 3, 2), ("input_dilated", 16, 64, 16, 32, 3, 2),
         ("input_dilated", 16, 64, 32, 16, 3, 2), ("input_dilated", 16, 64, 16, 16, 1, 2),
         ("input_dilated", 16, 64, 16, 16, 3, 3), ("input_dilated", 16, 64, 16, 16, 5, 2),
         ("input_dilated", 8, 64, 16, 16, 3, 2),
         ("strided", 16, 128, 16, 16, 3, 2), ("weight_gradient", 16, 128, 16, 16, 3, 2),
         # A transposed convolution (nn.ConvTranspose, strides 2) is input-dilated; its
         # weight gradient is input-dilated too, with the output gradient as its kernel.
         ("input_dilated", 16, 64, 32, 16, 2, 2),
         ("input_dilated_weight_gradient", 16, 64, 32, 16, 2, 2),
         ("input_dilated_weight_gradient", 8, 32, 64, 32, 3, 2),
         ("input_gradient", 16, 128, 16, 16, 3, 2), ("input_gradient", 16, 128, 16, 32, 5, 2),
         # One spatial dim (an audio frontend's), which XLA runs as two, the first of size 1.
         ("input_dilated_1d", 16, 4096, 64, 64, 3, 2), ("input_gradient_1d", 16, 8192, 64, 128, 3, 2)]
# --cap: scratch just under and just over XLA's cap (`xla_buffers.TRANSPOSED_CONV_MAX_SCRATCH`,
# 8 GiB), above which its generic kernel runs without any; needs about 9 GiB of memory.
CAP_CASES = [("input_dilated", 8, 64, 8, 512, 11, 2), ("input_dilated", 8, 64, 8, 576, 11, 2)]


def _convolution(kind, k, d, n):
  """The convolution `kind` names, of n spatial dims."""
  import jax
  from jax import lax
  dn = ("NHWC", "HWIO", "NHWC") if n == 2 else ("NWC", "WIO", "NWC")
  full = [(k - 1, k - 1)] * n   # padded by the kernel less one: the input-dilated kinds
  if kind == "input_dilated":
    return lambda y, w: lax.conv_general_dilated(y, w, (1,) * n, full, lhs_dilation=(d,) * n,
                                                 dimension_numbers=dn)
  if kind == "strided":
    return lambda y, w: lax.conv_general_dilated(y, w, (d,) * n, "SAME", dimension_numbers=dn)
  if kind == "input_gradient":   # a strided convolution's, padded (1, 1): input-dilated
    return lambda y, w: jax.grad(lambda y: lax.conv_general_dilated(
        y, w, (d,) * n, [(1, 1)] * n, dimension_numbers=dn).sum())(y)
  if kind == "input_dilated_weight_gradient":
    return lambda y, w: jax.grad(lambda w: lax.conv_general_dilated(
        y, w, (1,) * n, full, lhs_dilation=(d,) * n, dimension_numbers=dn).sum())(w)
  return lambda y, w: jax.grad(lambda w: lax.conv_general_dilated(
      y, w, (d,) * n, "SAME", dimension_numbers=dn).sum())(w)


def measured(kind: str, b: int, side: int, c_in: int, c_out: int, k: int, d: int):
  """(fn, args, extra) for jax_symmem.measure: one convolution compiled as symmem.jit
  compiles a budget's round, with XLA's figure and the scratch symmem.jit adds."""
  import jax
  import jax.numpy as jnp
  import jax_symmem as symmem
  from jax_symmem._src import variants
  kind, n = (kind[:-3], 1) if kind.endswith("_1d") else (kind, 2)   # "…_1d": one spatial dim
  fn = _convolution(kind, k, d, n)
  args = (jnp.ones((b, *(side,) * n, c_in)), jnp.full((*(k,) * n, c_in, c_out), 0.01))
  # keep_unused: an input gradient does not read the input, which the real peak holds
  exe = jax.jit(fn, keep_unused=True).lower(*args).compile(
      compiler_options=variants.CPU_COMPILER_OPTIONS)
  analysis = symmem.analyze(fn, *args, polymorphic_shapes=(", ".join(["b"] + ["_"] * (n + 1)),
                                                          None))
  return (lambda *_: exe(*args)), args, {
      "argument_bytes": _common.tree_bytes(args), "xla": variants.footprint(exe),
      "scratch_added": analysis.round_scratch(0, {"b": b})}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=RESULTS)
  parser.add_argument("--cap", action="store_true", help="also the two cases at XLA's cap")
  args = parser.parse_args(argv)
  rows = []
  for kind, b, side, c_in, c_out, k, d in CASES + (CAP_CASES if args.cap else []):
    r = _common.real_peak("experiments.conv_scratch:measured", kind=kind, b=b, side=side,
                          c_in=c_in, c_out=c_out, k=k, d=d)
    row = {"kind": kind, "batch": b, "side": side, "in": c_in, "out": c_out, "kernel": k,
           "dilation_or_stride": d, "real_mib": r["real"] / MiB, "xla_mib": r["xla"] / MiB,
           "outside_xla_mib": (r["real"] - r["xla"]) / MiB,
           "scratch_added_mib": r["scratch_added"] / MiB}
    rows.append(row)
    size, window = ((f"{side}", f"{k}") if kind.endswith("_1d") else (f"{side}x{side}", f"{k}x{k}"))
    print(f"{kind} b={b} {size} {c_in}->{c_out} {window} /{d}: real {row['real_mib']:.1f} "
          f"MiB, XLA {row['xla_mib']:.1f}, outside XLA {row['outside_xla_mib']:.2f}, "
          f"symmem.jit adds {row['scratch_added_mib']:.2f}", flush=True)
  _common.write_results(args.out, {"rows": rows})


if __name__ == "__main__":
  main()
