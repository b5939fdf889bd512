"""The symbolic shape graph against concrete tracing (sampled, as JAX's shape_poly tests do)."""

import difflib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import shape_graph as shape_graph_lib
from jax_symmem._src import tracing
from jax_symmem.examples import transformer

CFG = transformer.Config(vocab=97, d_model=32, n_heads=4, d_ff=88, n_layers=2)
CONSTRAINTS = ("s >= 2", "s <= 512", "b <= 16")
# >= 20 shapes, b != s and both >= 2 so that concrete tracing takes no size-1 shortcuts.
SHAPES = [(b, s) for b, s in itertools.product((2, 3, 5, 16), (4, 7, 12, 31, 64, 511)) if b != s]


@pytest.fixture(scope="module")
def symbolic_step():
  args = jax.eval_shape(lambda: transformer.example_args(CFG, 2, 8))   # traced, never run
  traced = symmem.trace(transformer.make_train_step(CFG), *args,
                        polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS)
  return traced, symmem.shape_graph(traced)


def _concrete_program(b, s):
  params = jax.eval_shape(lambda: transformer.init_params(jax.random.PRNGKey(0), CFG))
  tokens = jax.ShapeDtypeStruct((b, s), jnp.int32)
  mask = jax.ShapeDtypeStruct((b, s), jnp.float32)
  return tracing.flatten(jax.make_jaxpr(transformer.make_train_step(CFG))(params, tokens, mask))


def _values(program):
  """(key, aval, id) of every node output in walk order; key = (primitive, source line)."""
  return [((n.name, n.source), prog.avals[o], o) for prog, n in program.walk() for o in n.outputs]


def _matching_values(symbolic, concrete):
  """Pairs of (symbolic value id, concrete aval) for the same value of the user's program.

  JAX takes shape-specific paths for a few ops (x[:, :-1] is a slice at concrete
  shapes and a gather at symbolic ones), so the programs are aligned by
  (primitive, source line); where they differ, the last value each source line
  produces is the one the user's expression returns, and must agree.
  """
  a, b = _values(symbolic), _values(concrete)
  matcher = difflib.SequenceMatcher(a=[k for k, _, _ in a], b=[k for k, _, _ in b], autojunk=False)
  pairs = []
  for tag, i1, i2, j1, j2 in matcher.get_opcodes():
    if tag == "equal":
      pairs += [(a[i][2], b[j][1]) for i, j in zip(range(i1, i2), range(j1, j2))]
    else:
      last_a = {k[1]: (vid, aval) for k, aval, vid in a[i1:i2]}
      last_b = {k[1]: aval for k, aval, _ in b[j1:j2]}
      pairs += [(last_a[src][0], last_b[src]) for src in last_a.keys() & last_b.keys()]
  return pairs


def test_sizes_match_concrete_tracing_at_sampled_shapes(symbolic_step):
  traced, graph = symbolic_step
  n_symbolic = len(_values(traced.program))
  assert len(SHAPES) >= 20
  for b, s in SHAPES:
    concrete = _concrete_program(b, s)
    pairs = _matching_values(traced.program, concrete)
    assert len(pairs) >= 0.95 * n_symbolic, (b, s, len(pairs), n_symbolic)
    for vid, aval in pairs:
      info = graph.values[vid]
      assert tuple(d.evaluate({"b": b, "s": s}) for d in info.dims) == tuple(aval.shape), info
      expected = int(np.prod(aval.shape, dtype=object)) * shape_graph_lib.itemsize(aval)
      assert graph.evaluate(vid, b=b, s=s) == expected, info
    # The arguments too.
    for v, w in zip(traced.program.inputs, concrete.inputs):
      assert graph.evaluate(v, b=b, s=s) == int(np.prod(concrete.avals[w].shape, dtype=object)) * \
          shape_graph_lib.itemsize(concrete.avals[w])


def test_attention_scores_are_quadratic_in_s(symbolic_step):
  _, graph = symbolic_step
  biggest = graph.largest(1, b=16, s=512)[0]
  assert str(graph.bytes(biggest.id)) == f"{4 * CFG.n_heads}*b*s^2"
  # Dims outside the constraints, or not the step's, are refused as by the analysis.
  with pytest.raises(symmem.ShapeError, match=r"outside the constraints.*s = 4096"):
    graph.largest(1, b=16, s=4096)
  with pytest.raises(ValueError, match="unknown dims t"):
    graph.largest(1, b=16, s=512, t=3)


def test_relations_hold_at_concrete_points(symbolic_step):
  _, graph = symbolic_step
  assert graph.relations and not graph.implied
  for r in graph.relations:
    for b, s in SHAPES[:5]:
      assert r.lhs.evaluate({"b": b, "s": s}) == r.rhs.evaluate({"b": b, "s": s}), r


def test_stats_count_the_graph(symbolic_step):
  traced, graph = symbolic_step
  stats = graph.stats()
  assert stats["values"] == len(traced.program.inputs) + sum(
      len(n.outputs) for _, n in traced.program.walk())
  assert stats["symbols"] == 2 and stats["constraints"] == len(CONSTRAINTS)
  assert stats["relations"] == len(graph.relations) > 0
  assert 1 < stats["distinct_size_expressions"] < stats["values"]


def test_implied_relation_becomes_a_constraint():
  # Two independent symbols made equal by a dot_general contraction would be
  # rejected by JAX; a relation that is not an identity is recorded instead.
  rel = shape_graph_lib.Relation("test", symmem.Poly.var("s"), symmem.Poly.var("t"), "")
  cons, _, implied = shape_graph_lib.ShapeGraph._close(
      symmem.symbolic.parse_constraints(("s <= 10",), ["s", "t"]), [rel])
  assert implied == (rel,)
  assert cons.reduce(symmem.Poly.var("s")) == cons.reduce(symmem.Poly.var("t"))


def test_scan_body_values_are_in_the_graph():
  def f(x):
    return jax.lax.scan(lambda c, row: (c + jnp.sum(row * row), row * 2.0), 0.0, x)
  traced = symmem.trace(f, jax.ShapeDtypeStruct((3, 5), jnp.float32), polymorphic_shapes="n, d")
  graph = symmem.shape_graph(traced)
  (scan,) = [n for n in traced.program.nodes if n.name == "scan"]
  body_values = scan.subprograms[0].value_ids()
  assert any(str(graph.bytes(v)) == "4*d" for v in body_values)
  ys = scan.outputs[-1]
  assert str(graph.bytes(ys)) == "4*d*n"


def test_sibling_extensions_do_not_share_bytes_of_a_reused_id(symbolic_step):
  """Two rewrites of one program may give the same new value id to values of different
  sizes (each starts numbering above the program's ids); the values' bytes the memory
  model caches per graph must not leak from one extended graph to the other."""
  from jax_symmem._src import memory
  from jax_symmem._src.ir import Node, Program
  traced, graph = symbolic_step
  program = traced.program
  env = graph.constraints.complete({"b": 4, "s": 64})
  size = lambda v: graph.bytes(v).evaluate(env)
  small = program.inputs[-1]
  large = next(o for n in program.nodes for o in n.outputs if size(o) > size(small))
  new_id = program.max_id() + 1

  def extended_with_copy_of(value):
    copy = Node(index=len(program.nodes), primitive=jax.lax.copy_p, params={}, inputs=(value,),
                outputs=(new_id,), source="test")
    avals = dict(program.avals)
    avals[new_id] = program.avals[value]
    rewritten = Program(program.inputs, program.nodes + (copy,), program.outputs, avals)
    return rewritten, graph.extended(rewritten)

  for value in (small, large, small):
    rewritten, extended = extended_with_copy_of(value)
    tables = memory.order_tables(extended, env, rewritten)
    assert tables.size_of(new_id) == size(value)
