"""What XLA:CPU's XNNPACK fusions may hold beyond `memory_analysis()` (DESIGN.md F2).

With its default options XLA:CPU hands chains of dots, convolutions, elementwise ops
and reductions to XNNPACK (fusions whose backend config says `__ynn_fusion`). The
values inside such a fusion are XNNPACK's to allocate, outside XLA's buffer
assignment, so `memory_analysis()` does not count them; that is why a budget's
variants compile with XNNPACK for single dots only (`variants.XNNPACK_DOTS`).

`hidden_bytes_bound` reads, from a compiled executable's optimized HLO, the bytes of
the inner values (all but parameters, constants, bitcasts and the root, which XLA
allocates) of the largest such fusion, counting for each convolution in it the patch
matrix a convolution computed as a dot reads (output positions x window x input
features): with inner values alone a Flax ResNet's round 0 at 128 px held 22.0–22.3 MiB
beside XLA's figure (and the scratch `xla_buffers.convolution_scratch` adds) where its
largest fusion's inner values were 16.0 MiB. Measured against real peaks
(`python -m experiments.bench_xnnpack --fusions default`; experiments/RESULTS.md, "XNNPACK's fusions
where they fit").
"""

from __future__ import annotations

import math
import re

FUSION_KIND = '"__ynn_fusion"'
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%?[\w.\-]+ = (.*?) ([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_NOT_INNER = frozenset({"parameter", "constant", "bitcast"})
_OPERANDS = re.compile(r"\(%?([\w.\-]+), %?([\w.\-]+)\)")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")


def _bytes_per_element(dtype: str) -> int:
  if dtype == "pred":
    return 1
  bits = re.search(r"(\d+)", dtype)
  if bits is None or int(bits.group(1)) % 8:
    raise ValueError(f"an HLO element type this module does not size: {dtype!r}")
  return int(bits.group(1)) // 8


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (an array, or a tuple of arrays)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _bytes_per_element(dtype)
  return total


def _dims(shape: str) -> list[int]:
  (_, dims), = _ARRAY.findall(shape)
  return [int(d) for d in filter(None, dims.split(","))]


def _patch_bytes(line: str, shape: str, shapes: dict[str, str]) -> int:
  """The patch matrix of a convolution computed as a dot: output positions x kernel
  window x input features, in the output's element type."""
  operands, labels = _OPERANDS.search(line), _DIM_LABELS.search(line)
  if operands is None or labels is None or operands.group(2) not in shapes:
    raise ValueError(f"a convolution this module does not read: {line.strip()[:200]}")
  out, kernel = _dims(shape), _dims(shapes[operands.group(2)])
  positions = math.prod(out) // out[labels.group(3).index("f")]
  window_by_inputs = math.prod(kernel) // kernel[labels.group(2).index("o")]
  (dtype, _), = _ARRAY.findall(shape)
  return positions * window_by_inputs * _bytes_per_element(dtype)


def fusion_inner_bytes(hlo_text: str) -> list[int]:
  """Per XNNPACK fusion of the module, the bytes of its inner values (with each
  convolution's patch matrix).

  Raises ValueError where the text does not read as expected (a fusion's computation
  missing, an element type of unknown size): the caller then knows no bound."""
  lines = hlo_text.splitlines()
  inner: dict[str, int] = {}
  current, shapes = None, {}
  for line in lines:
    if not line.startswith(" "):
      m = _COMPUTATION.match(line)
      current, shapes = (m.group(1) if m else None), {}
      if current is not None:
        inner[current] = 0
      continue
    m = _INSTRUCTION.match(line)
    if current is not None and m is not None:
      root, shape, op = m.groups()
      shapes[line.split("=", 1)[0].split()[-1].lstrip("%")] = shape
      if not root and op not in _NOT_INNER:
        inner[current] += _shape_bytes(shape)
      if op == "convolution":
        inner[current] += _patch_bytes(line, shape, shapes)
  sizes = []
  for line in lines:
    if FUSION_KIND in line:
      called = _CALLS.search(line)
      if called is None or called.group(1) not in inner:
        raise ValueError(f"an XNNPACK fusion without its computation: {line.strip()[:200]}")
      sizes.append(inner[called.group(1)])
  return sizes


def hidden_bytes_bound(hlo_text: str) -> int:
  """The largest XNNPACK fusion's inner values, in bytes (0 without such fusions)."""
  return max(fusion_inner_bytes(hlo_text), default=0)
