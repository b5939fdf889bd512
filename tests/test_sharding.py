"""Sharded steps: per-device sizes (propagation rules) and symmem.jit with shardings on 8 devices."""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import sharding
from tests import host_devices


def _propagated(fun, args, shapes, divisors):
  traced = symmem.trace(fun, *args, polymorphic_shapes=shapes, constraints=("b <= 64",))
  graph = symmem.shape_graph(traced)
  got = sharding.propagate(traced.program, divisors, lambda v: graph.values[v].dims)
  per_device = graph.per_device(got)
  out = traced.program.outputs
  return traced, graph, per_device, [got[v] for v in out]


def test_propagation_follows_batch_and_model_splits():
  def f(x, w1, w2):
    h = jnp.tanh(x @ w1)                 # (b, 32): b from x, 32 from w1's free dim
    y = (h @ w2).T                       # (16, b): contracting dim split -> all-reduced
    return h, y, jnp.sum(h, axis=0), h.reshape(-1)
  x, w1, w2 = jnp.ones((8, 64)), jnp.ones((64, 32)), jnp.ones((32, 16))
  traced, graph, per_device, outs = _propagated(
      f, (x, w1, w2), ("b, 64", None, None), [(4, 1), (1, 2), (2, 1)])
  assert outs == [(4, 2), (1, 4), (2,), (4,)]
  h = traced.program.outputs[0]
  assert per_device.bytes(h).evaluate({"b": 8}) == graph.bytes(h).evaluate({"b": 8}) // 8
  # A split that does not divide the dim: ceil per device (b = 6 over 4 shards -> 2 rows).
  assert per_device.bytes(h).evaluate({"b": 6}) == 4 * 2 * 16


def test_lookups_and_their_gradients_follow_the_indices_split():
  # An embedding lookup and optax's label pick (`take_along_axis`) are gathers whose rows
  # follow the indices; the label pick's gradient is a scatter-add into each row's own
  # row (batching dims): all split as the batch of indices is.
  def f(table, tokens, logits, labels):
    pick = lambda z: jnp.sum(jnp.take_along_axis(z, labels[:, None], axis=-1))
    return table[tokens], jnp.take_along_axis(logits, labels[:, None], axis=-1), jax.grad(pick)(logits)
  args = (jnp.ones((32, 8)), jnp.ones((8, 5), jnp.int32), jnp.ones((8, 16)),
          jnp.ones((8,), jnp.int32))
  _, _, _, outs = _propagated(f, args, (None, "b, 5", "b, 16", "b"),
                              [(1, 2), (4, 1), (1, 1), (4,)])
  assert outs == [(4, 1, 2), (4, 1), (4, 1)]


def test_unknown_ops_are_replicated():
  def f(x):
    return jnp.cumsum(x, axis=0)[::2]    # a strided slice changes dim 0: not carried
  _, _, _, outs = _propagated(f, (jnp.ones((8, 4)),), ("b, 4",), [(4, 2)])
  assert outs == [(1, 2)]


def test_control_flow_bodies_propagate_their_operands_splits():
  # A scan's body sees its scanned slices without their leading dim, its stacked results
  # take the body's split under a whole leading dim; a carry keeps the split it enters
  # with where the body keeps it (here it does, so it stays split); a cond's results are
  # split only where every branch splits them; a while's carry as a scan's.
  def f(x, xs):
    def body(c, slab):
      y = jnp.tanh(c * slab)
      return y, y * 2
    carry, ys = jax.lax.scan(body, x, xs)
    picked = jax.lax.cond(carry[0, 0] > 0, lambda a: a + 1,
                          lambda a: jnp.broadcast_to(a.sum(0), a.shape), carry)
    looped = jax.lax.while_loop(lambda c: c[0, 0] < 3, lambda c: c + 1, x)
    return carry, ys, picked, looped
  x, xs = jnp.ones((8, 4)), jnp.ones((3, 8, 4))
  traced, graph, per_device, outs = _propagated(
      f, (x, xs), ("b, 4", "3, b, 4"), [(4, 1), (1, 4, 1)])
  assert outs == [(4, 1), (1, 4, 1), (1, 1), (4, 1)]
  ys = traced.program.outputs[1]
  assert per_device.bytes(ys).evaluate({"b": 8}) == graph.bytes(ys).evaluate({"b": 8}) // 4
  # A carry the body replicates (a sum over the split dim broadcast back) is replicated.
  def g(x):
    return jax.lax.scan(lambda c, _: (jnp.broadcast_to(c.sum(0), c.shape), None), x,
                        length=2)[0]
  _, _, _, (out,) = _propagated(g, (x,), ("b, 4",), [(4, 1)])
  assert out == (1, 1)


def test_recomputed_values_keep_their_split_in_later_rounds():
  # A clone of a value split 8 ways is split 8 ways too: rounds >= 1 of a
  # data-parallel step are modeled per device, like round 0.
  from jax_symmem._src import analysis as analysis_lib
  import dataclasses
  from jax_symmem.examples import llama
  cfg = dataclasses.replace(llama.PRESETS["tiny"], n_layers=1)
  # Shapes only: the step is traced and planned, never run.
  state = jax.eval_shape(lambda: llama.init_state(cfg))
  tokens, mask = jax.eval_shape(lambda: llama.example_batch(cfg, 16, 48))
  traced = symmem.trace(llama.train_step_fn(llama.Llama(cfg)), state, tokens, mask,
                        polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=("s >= 2", "s <= 64", "b <= 16"))
  divisors = [[1] * x.ndim for x in jax.tree_util.tree_leaves(state)] + [[8, 1], [8, 1]]
  a = analysis_lib.analyze_traced(traced, argument_divisors=divisors)
  dims = {"b": 16, "s": 48}
  env = a.graph.constraints.complete(dims)
  checked = 0
  for r in a.rounds[1:]:
    for b in r.blocks:
      for i, j in zip(b.clones, b.region.nodes):
        for new, old in zip(r.program.nodes[i].outputs, r.program.nodes[j].outputs):
          assert r.graph.bytes(new).evaluate(env) == r.graph.bytes(old).evaluate(env)
          checked += 1
  assert checked
  peaks = [a.round_peak(k, dims) for k in range(len(a.rounds))]
  assert min(peaks[1:]) <= peaks[0]


def test_a_scanned_steps_rewritten_scans_are_split_as_their_originals():
  # Data parallel over 8 devices with the layers under nn.scan: the residuals the forward
  # scan stacks are per device, and so are those of the scans a round rewrites (new
  # values, split by propagating the rewritten program: `ShapeGraph.extended`).
  from jax_symmem._src import analysis as analysis_lib
  from jax_symmem._src import jax_dims
  import dataclasses
  from jax_symmem.examples import llama
  cfg = dataclasses.replace(llama.PRESETS["tiny"], n_layers=2)
  state = jax.eval_shape(lambda: llama.init_state(cfg, scan_layers=True))
  tokens, mask = jax.eval_shape(lambda: llama.example_batch(cfg, 16, 48))
  traced = symmem.trace(llama.train_step_fn(llama.Llama(cfg, scan_layers=True)), state,
                        tokens, mask, polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=("s >= 2", "s <= 64", "b <= 16"))
  divisors = [[1] * x.ndim for x in jax.tree_util.tree_leaves(state)] + [[8, 1], [8, 1]]
  a = analysis_lib.analyze_traced(traced, argument_divisors=divisors)
  env = a.graph.constraints.complete({"b": 16, "s": 48})
  def whole(program, v):
    aval = program.avals[v]
    return aval.dtype.itemsize * int(np.prod([d.evaluate(env) for d in
                                              jax_dims.shape_to_polys(aval.shape)]))
  assert len(a.rounds) > 1
  # A round's graph propagates only what its rewrites added (`known`), splitting the new
  # values as a full pass over the round's program does.
  def avals(program):
    out = dict(program.avals)
    for n in program.nodes:
      for body in n.subprograms:
        out.update(avals(body))
    return out
  first, last = a.rounds[0].program, a.rounds[-1].program
  dims_of = lambda v, table=avals(last) | avals(first): jax_dims.shape_to_polys(table[v].shape)
  full = sharding.propagate(last, divisors, dims_of)
  known = sharding.propagate(first, divisors, dims_of)
  incremental = sharding.propagate(last, divisors, dims_of, known=known)
  fresh = set(full) - set(known)
  assert fresh and {v: incremental[v] for v in fresh} == {v: full[v] for v in fresh}
  for r in a.rounds:
    forward = next(n for n in r.program.nodes if n.name == "scan")
    batched = [o for o in forward.outputs if "b" in str(r.program.avals[o].shape)]
    assert len(batched) >= 2   # (the last round stacks the layers' inputs alone)
    for o in batched:
      assert 8 * r.graph.bytes(o).evaluate(env) == whole(r.program, o), o


def test_without_shardings_nothing_changes():
  step = symmem.jit(lambda x: x * 2, polymorphic_shapes=("b, 4",), constraints=("b <= 8",))
  x = jnp.ones((4, 4))
  assert step.analyze(x).graph.bytes(step.analyze(x).traced.program.inputs[0]).evaluate(
      {"b": 4}) == 64


def test_shardings_on_a_one_device_mesh_match_jax_jit():
  # The in_shardings / out_shardings path of symmem.jit in this process (one device:
  # every divisor is 1, so per-device sizes are the global ones); the 8-device Llama
  # runs below are in the slow tier.
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  w_sharding = NamedSharding(mesh, P(None, "model"))
  x_sharding = NamedSharding(mesh, P("data", None))
  shardings = dict(in_shardings=(w_sharding, x_sharding),
                   out_shardings=(w_sharding, NamedSharding(mesh, P())))

  def step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, loss

  ref = jax.jit(step, **shardings)
  sym = symmem.jit(step, polymorphic_shapes=(None, "b, _"), constraints=("b <= 64",),
                   memory_budget=2**30, **shardings)
  rng = np.random.RandomState(0)
  w = jax.device_put(jnp.asarray(rng.randn(16, 8), jnp.float32), w_sharding)
  for b in (8, 32, 8):
    x = jax.device_put(jnp.asarray(rng.randn(b, 16), jnp.float32), x_sharding)
    got, want = sym(w, x), ref(w, x)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      assert g.sharding.is_equivalent_to(r.sharding, g.ndim)
  info = sym.cache_info()
  assert info["compiles"] == 2 and info["hits"] == 1 and info["fallback_calls"] == 0
  analysis = sym.analyze(w, x)
  x_value = analysis.traced.program.inputs[1]
  assert analysis.graph.bytes(x_value).evaluate({"b": 32}) == 32 * 16 * 4


# One test reads the run's four layouts, a subtest each: as four tests they landed on both
# xdist workers, and one waited ~80 s for the other's run (host_devices.shared).
@pytest.mark.slow   # a subprocess with 8 host devices: ~1 min
def test_sharded_llama_step_matches_jax_jit_and_models_per_device(subtests):
  results = {r["layout"]: r for r in host_devices.run_json("tests.sharded_llama", 8)}
  assert sorted(results) == ["data", "data_scan", "tensor", "tensor_scan"]
  for layout, result in results.items():
    with subtests.test(layout=layout):
      _check_sharded_llama(result)


def _check_sharded_llama(result):
  assert result["max_rel_err"] <= 1.0   # every element: |d| <= 1e-6 + 1e-5 |ref|
  assert result["cache_info"]["fallback_calls"] == 0
  assert result["cache_info"]["compiles"] == len(result["shapes"])
  for row in result["shapes"]:
    assert row["out_sharding_ok"], row
    assert row["loss"] == pytest.approx(row["loss_ref"], rel=1e-5), row
    # Per device, the scheduled model vs XLA's memory_analysis() of the same sharded
    # step: measured -9 % ... +22 % on jax 0.9.2, 0.10.2 and 0.12; with nn.scan -7 % ... +15 %
    # (0.10.2; before scan bodies were propagated up to 4.3x) (values whose split is unknown
    # count as replicated, so the model errs high where XLA splits more; XLA's layout
    # adds what the model leaves out at the small shape). The unsharded model is up to 4x
    # off at the larger shape.
    ratio = row["model_scheduled_per_device"] / row["xla_per_device"]
    assert 0.9 <= ratio <= 1.3, row
  big = result["shapes"][-1]
  assert big["model_unsharded"] > 2 * big["xla_per_device"], big
