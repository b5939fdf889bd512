"""The reference executor: runs a program op by op and tracks live bytes.

It binds each primitive eagerly in the given order, deletes every array right
after its last use (arguments the caller holds are kept unless donated), and
tracks the bytes of the distinct live arrays; an optimization barrier passes its
operands through, as XLA does (eagerly it would copy them). Its tracked peak is what the
memory model predicts, exactly (DESIGN.md F7); run in a fresh process with the
measurement protocol of `measure.py`, its real peak is what the model claims
about real memory. Control-flow nodes run whole, as one dispatch, unless
`loops_op_by_op`: then a scan runs as XLA runs it, iteration by iteration: its
outputs (final carries, stacked results) are allocated when it starts, each
iteration's body runs op by op on the slices it receives, and the scan's live
bytes are the top level's plus the largest body working set above its inputs.
A cond runs every branch op by op on its operands and returns the taken one's
results: XLA plans a cond's temporaries statically, as the largest branch's
(DESIGN.md F5), so its live bytes are the top level's plus the largest branch
working set above the operands, whichever branch runs; a branch's results are
made in the cond's output buffers (XLA colocates them), so they count once, as
the cond's outputs. (Branches must be pure for that; AD's and users' conds are.)
In that mode a random draw also counts the Threefry counters XLA holds beside its
result while it runs (`memory.DRAW_BYTES_PER_ELEMENT`, measured in XLA's buffer
assignment: tests/test_xla_buffers.py), which a dispatch of the draw does not show.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import jax

from jax_symmem._src import interpret
from jax_symmem._src import memory
from jax_symmem._src import tracing
from jax_symmem._src.ir import Const, Program
from jax_symmem._src.tracing import TracedProgram


@dataclasses.dataclass(frozen=True)
class Execution:
  outputs: Any                  # the function's outputs (pytree)
  live_during: tuple[int, ...]  # tracked live bytes while each step runs
  arguments: int                # tracked bytes of the arguments

  @property
  def peak(self) -> int:
    return max((self.arguments,) + self.live_during)


def _nbytes(x) -> int:
  return int(getattr(x, "nbytes", 0))


def _buffer_key(x) -> tuple:
  """Identifies the device buffer behind an array: views (PRNG key wrappers) share it."""
  base = getattr(x, "_base_array", x)
  try:
    pointer = base.unsafe_buffer_pointer()
  except Exception:  # not a single-device array: fall back to object identity
    pointer = 0
  return ("ptr", pointer) if pointer else ("obj", id(base))


def execute(traced: TracedProgram, args: Sequence[Any], order: Sequence[int] | None = None,
            donated: Iterable[int] = (), loops_op_by_op: bool = False) -> Execution:
  """Runs `traced` on concrete `args` (a tuple matching `trace`'s args) op by op."""
  dims = traced.bind_dims(*args)
  program = traced.specialize(**dims)
  flat = jax.tree_util.tree_leaves(tuple(args))
  flat = [jax.numpy.asarray(a) for a in flat]
  outs, live, arg_bytes = run_tracked(program, flat, order, donated, loops_op_by_op)
  return Execution(jax.tree_util.tree_unflatten(traced.out_tree, outs), tuple(live), arg_bytes)


def _run_scan(node, args, loops_op_by_op):
  """(outputs, bytes above the scan's operands and outputs): one iteration at a time."""
  p = node.params
  (nc, ncarry), length = tracing.scan_counts(p), p["length"]
  consts, carry, xs = args[:nc], list(args[nc:nc + ncarry]), args[nc + ncarry:]
  body = node.subprograms[0]
  ys, working = None, 0
  for i in (reversed(range(length)) if p["reverse"] else range(length)):
    outs, live, arg_bytes = run_tracked(body, [*consts, *carry, *(x[i] for x in xs)],
                                        loops_op_by_op=loops_op_by_op)
    working = max([working] + [b - arg_bytes for b in live])
    carry, y = outs[:ncarry], outs[ncarry:]
    if ys is None:
      ys = [jax.numpy.zeros((length,) + v.shape, v.dtype) for v in y]
    ys = [s.at[i].set(v) for s, v in zip(ys, y)]
  return carry + (ys or []), working


def _run_cond(node, args, loops_op_by_op):
  """(the taken branch's outputs, the largest branch's bytes above the operands)."""
  index, operands = int(args[0]), args[1:]
  taken, working = None, 0
  for k, branch in enumerate(node.subprograms):
    results = frozenset(x for x in branch.outputs if not isinstance(x, Const))
    outs, live, arg_bytes = run_tracked(branch, operands, loops_op_by_op=loops_op_by_op,
                                        preallocated=results)
    working = max([working] + [b - arg_bytes for b in live])
    if k == min(max(index, 0), len(node.subprograms) - 1):   # lax.cond clamps the index
      taken = outs
  # A branch that returns an operand unchanged still gives the cond a buffer of its
  # own, as one dispatch of the cond does (a jitted call never aliases its inputs).
  operand_buffers = {_buffer_key(x) for x in operands}
  taken = [jax.numpy.array(x, copy=True) if _buffer_key(x) in operand_buffers else x
           for x in taken]
  return taken, working


def run_tracked(program: Program, flat_args: Sequence[Any], order: Sequence[int] | None = None,
                donated: Iterable[int] = (), loops_op_by_op: bool = False,
                preallocated: frozenset = frozenset()):
  """(outputs, live bytes during each step, argument bytes) of an op-by-op run.

  A buffer a node makes for a value in `preallocated` is not counted: the caller
  already counts it (a cond's output buffers, which its branches' results fill).
  """
  order = tuple(range(len(program.nodes))) if order is None else tuple(order)
  donated = frozenset(donated)
  last_use: dict[int, int] = {}
  for pos, i in enumerate(order):
    for x in program.nodes[i].operands:
      last_use[x] = pos
  outputs = {x for x in program.outputs if not isinstance(x, Const)}
  held = {v for k, v in enumerate(program.inputs) if k not in donated}

  refs: dict[tuple, int] = {}      # buffer -> number of live values on it
  uncounted: set[tuple] = set()    # buffers of preallocated values
  arrays: dict[tuple, Any] = {}    # buffer -> the first array seen on it
  def hold(x):
    key = _buffer_key(x)
    refs[key] = refs.get(key, 0) + 1
    arrays.setdefault(key, x)
  def release(x) -> bool:
    """Drops one reference; True when the buffer has no live value left."""
    key = _buffer_key(x)
    refs[key] -= 1
    if refs[key] == 0:
      del refs[key], arrays[key]
      uncounted.discard(key)   # a later array may reuse the address
      return True
    return False
  tracked = lambda: sum(_nbytes(a) for k, a in arrays.items() if k not in uncounted)

  env: dict[int, Any] = dict(zip(program.inputs, flat_args))
  for v in program.inputs:
    hold(env[v])
  arg_bytes = tracked()
  pinned = {_buffer_key(env[v]) for v in held}
  read = lambda x: x.value if isinstance(x, Const) else env[x]
  live = []
  for pos, i in enumerate(order):
    node = program.nodes[i]
    working = 0
    if node.name == "optimization_barrier":   # eager, it would copy; XLA passes through
      results = [read(x) for x in node.inputs]
    elif loops_op_by_op and node.name == "scan":
      results, working = _run_scan(node, [read(x) for x in node.inputs], loops_op_by_op)
    elif loops_op_by_op and node.name == "cond":
      results, working = _run_cond(node, [read(x) for x in node.inputs], loops_op_by_op)
    else:
      results = interpret.bind(node, [read(x) for x in node.inputs])
      if loops_op_by_op and node.name == "random_bits":   # the counters XLA holds beside it
        working = memory.DRAW_BYTES_PER_ELEMENT * results[0].size - _nbytes(results[0])
    for o, r in zip(node.outputs, results):
      env[o] = r
      if o in preallocated and _buffer_key(r) not in refs:   # made here, not passed through
        uncounted.add(_buffer_key(r))
      hold(r)
    live.append(tracked() + working)
    dying = {x for x in node.operands if last_use[x] == pos}
    dying |= {o for o in node.outputs if o not in last_use}
    for v in dying - outputs - held:
      x = env.pop(v)
      if release(x) and _buffer_key(x) not in pinned and hasattr(x, "delete"):
        x.delete()
  return [read(x) for x in program.outputs], live, arg_bytes
