"""XLA's footprint predicted from the model's live ranges (xla_buffers.footprint_at).

Checked against XLA's own memory_analysis() where no fusion can make XLA's values
differ from the jaxpr's (a chain of dots), and by the bounds that hold on any program:
every live byte of the model is in an argument, an output's allocation or the heap,
and the layout adds at most the outputs' bytes.
"""

import jax.numpy as jnp
from jax import lax
import pytest

import jax_symmem as symmem
from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import memory
from jax_symmem._src import xla_buffers
from jax_symmem._src.ir import Const
from tests import budgets
from tests import programs


def _dots(x, w):
  h = x @ w                                                # [n, 64], read by the next dot
  g = lax.dot_general(h, h, (((0,), (0,)), ((), ())))      # [64, 64]: no transpose to fuse
  return g @ w                                             # the output, made last


def _dots_analysis():
  x, w = jnp.ones((8, 64)), jnp.ones((64, 64))
  return symmem.analyze(_dots, x, w, polymorphic_shapes=("n, _", None),
                        constraints=("n <= 4096",)), w


@pytest.mark.parametrize("n", [32, 512, 4096])
def test_equals_xla_where_nothing_fuses(n):
  an, w = _dots_analysis()
  dims = {"n": n}
  xla = budgets.xla_bytes(an, 0, dims, (jnp.ones((n, 64)), w))
  assert an.round_footprint(0, dims) == xla
  if n > 64:
    # h is larger than the output's buffer: XLA holds that buffer apart, for the whole
    # run, while h and g are live; the op-by-op model counts the output when it is made.
    assert an.round_peak(0, dims) == xla - 64 * 64 * 4
  else:
    # h fits in the output's buffer, free until the last dot: XLA puts it there.
    assert an.round_peak(0, dims) == xla


def test_a_donated_argument_holds_the_output():
  an, _ = _dots_analysis()
  r, dims = an.rounds[0], {"n": 512}
  order = an.round_order(0, dims)
  kept = xla_buffers.footprint_at(r.graph, dims, r.program, order)
  donated = xla_buffers.footprint_at(r.graph, dims, r.program, order, donated=(1,))
  assert kept - donated == 64 * 64 * 4   # the new w goes into the donated w's buffer


def _output_bytes(graph, program, env):
  alias = memory._aliases(program)
  outs = {alias.get(x, x) for x in program.outputs if not isinstance(x, Const)}
  return sum(graph.bytes(v).evaluate(env) for v in outs - set(program.inputs))


@pytest.mark.parametrize("case", programs.CASES, ids=lambda c: c.name)
def test_bounds_on_every_round(case):
  an = symmem.analyze(case.fun, *case.make_args(**case.shapes[1]),
                      polymorphic_shapes=case.polymorphic_shapes, constraints=case.constraints)
  for dims in case.shapes:
    env = an.graph.constraints.complete(dims)
    for k, r in enumerate(an.rounds):
      order = an.round_order(k, dims)
      peak = memory.peak_at(r.graph, dims, r.program, order)
      predicted = xla_buffers.footprint_at(r.graph, dims, r.program, order)
      assert peak <= predicted <= peak + _output_bytes(r.graph, r.program, env), (dims, k)


def test_the_setting_decides_by_the_modeled_peak(monkeypatch):
  an, _ = _dots_analysis()
  monkeypatch.setattr(analysis_lib, "PREDICT_XLA_BUFFERS", False)
  assert an.round_footprint(0, {"n": 512}) == an.round_peak(0, {"n": 512})
