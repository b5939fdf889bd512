"""Rematerialization: regions recompute exactly what they evict, and lower the modeled peak."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import executor
from jax_symmem._src import memory
from jax_symmem._src import remat
from jax_symmem._src import schedule
from jax_symmem.examples import transformer

CFG = transformer.Config(vocab=61, d_model=32, n_heads=2, d_ff=64, n_layers=2)
CONSTRAINTS = ("s >= 2", "b <= 4", "s <= 128")


@functools.lru_cache(maxsize=None)
def _analysis():
  return symmem.analyze(transformer.make_train_step(CFG), *transformer.example_args(CFG, 2, 8),
                        polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS)


def test_regions_are_valid_and_never_recompute_randomness_or_effects():
  a = _analysis()
  assert len(a.rounds) > 1
  for r in a.rounds[1:]:
    assert schedule.is_valid_order(r.program, r.order)
    for region in r.regions:
      nodes = [r.program.nodes[i] for i in region.nodes]
      assert all(remat.recomputable(n) for n in nodes)
      assert region.value not in region.anchors
      env = a.graph.constraints.complete(a.graph.max_dims())
      assert region.saved.evaluate(env) > 0 and region.cost.evaluate(env) >= 0


def test_every_round_computes_the_same_outputs_op_by_op_and_matches_the_model():
  a = _analysis()
  dims = {"b": 3, "s": 50}
  args = transformer.example_args(CFG, **{"batch": 3, "seq": 50})
  flat = jax.tree_util.tree_leaves(args)
  env = a.graph.constraints.complete(dims)
  want = jax.tree_util.tree_leaves(jax.jit(transformer.make_train_step(CFG))(*args))
  from jax_symmem._src import tracing
  for r in (a.rounds[0], a.rounds[len(a.rounds) // 2], a.rounds[-1]):
    program = tracing.specialize_program(r.program, env)
    outs, live, _ = executor.run_tracked(program, [jax.numpy.asarray(x) for x in flat], r.order)
    for got, w in zip(outs, want):
      np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max() + 1))
    assert memory.profile(r.graph, r.program, r.order).live_bytes(
        include_transients=False, **dims) == live


def test_rounds_lower_the_modeled_peak_where_it_was_planned():
  a = _analysis()
  tight = a.graph.max_dims()
  peaks = [r.peak_at(tight) for r in a.rounds]
  assert min(peaks[1:]) < peaks[0]
  assert a.stats["remat_rounds"] == len(a.rounds) - 1
  assert "round 1" in a.plan and "evict" in a.plan


def test_choose_round_picks_the_smallest_that_fits_and_names_the_minimum():
  a = _analysis()
  dims = a.graph.max_dims()
  peaks = [a.round_peak(k, dims) for k in range(len(a.rounds))]
  assert a.choose_round(dims, None) == 0
  assert a.choose_round(dims, peaks[0]) == 0
  k = a.choose_round(dims, min(peaks))
  assert peaks[k] <= min(peaks) and all(p > min(peaks) for p in peaks[:k])
  with pytest.raises(symmem.BudgetError, match=f"{min(peaks) / 2**20:.1f} MiB"):
    a.choose_round(dims, min(peaks) - 1)


# Plans the step again at exact shapes: slow; the rounds' own tests stay fast.
@pytest.mark.slow
def test_static_anchor_and_analysis_peaks():
  a = _analysis()
  for s in (8, 64, 128):
    dims = {"b": 4, "s": s}
    # No budget: no eviction, only the schedule (never above trace order).
    assert a.peak_bytes(**dims) == a.round_peak(0, dims) <= a.baseline_peak_bytes(**dims)
    assert a.static_peak_bytes(**dims) <= a.baseline_peak_bytes(**dims)
    assert a.peak_bytes(**dims) <= 1.01 * a.static_peak_bytes(**dims)


def test_each_fence_waits_for_a_late_value_that_later_nodes_read():
  # XLA's simplifier drops a barrier operand nobody reads, and a recomputation fenced
  # only by its anchors runs as soon as they exist: each fence passes a trigger (the
  # deepest value still read from the consumer on) whose fenced copy later nodes read.
  a = _analysis()
  checked = 0
  for r in a.rounds[1:]:
    program, pos = r.program, {i: k for k, i in enumerate(r.order)}
    producer = {o: n for n in program.nodes for o in n.outputs}
    anchors: dict[int, set] = {}   # a consumer's regions share one fence
    for b in r.blocks:
      anchors.setdefault(b.barrier, set()).update(b.region.anchors)
    for barrier, group_anchors in anchors.items():
      fence = program.nodes[barrier]
      extra = [(x, o) for x, o in zip(fence.inputs, fence.outputs) if x not in group_anchors]
      if not extra:
        continue
      (trigger, copy), = extra
      assert producer[trigger].name not in remat.NOT_A_TRIGGER
      readers = [pos[n.index] for n in program.nodes if copy in n.inputs]
      assert readers and min(readers) > pos[barrier]
      checked += 1
  assert checked


def test_xla_keeps_every_fence_operand():
  # With cse_barrier_expander disabled (DESIGN.md F1), nothing of a fence is simplified
  # away: the optimized module passes as many operands through barriers as the round.
  from jax_symmem._src import tracing
  from jax_symmem._src import variants
  a = _analysis()
  dims = {"b": 2, "s": 16}
  k = len(a.rounds) - 1
  program = tracing.specialize_program(a.rounds[k].program, a.graph.constraints.complete(dims))
  want = sum(len(n.inputs) for n in program.nodes if n.name == "optimization_barrier")
  flat = jax.tree_util.tree_leaves(transformer.example_args(CFG, 2, 16))
  hlo = jax.jit(variants.round_function(a, k, dims)).lower(*flat).compile(
      compiler_options=variants.round_options(a, k)).as_text()
  kept = sum(line.split("opt-barrier(")[0].count("[") for line in hlo.splitlines()
             if " opt-barrier(" in line)
  assert kept >= want > 0


def test_a_residual_out_of_reach_of_recomputation_is_read_from_live_values():
  # c = cos(2x) is neither live at the use nor recomputable within one node, so the
  # walk that recomputes large inputs fails; the second reads the live a = sin(c).
  def f(x):
    c = jnp.cos(2 * x)
    a = jnp.sin(c)
    return jnp.exp(a), a
  traced = symmem.trace(f, jnp.ones(8), polymorphic_shapes=("n",))
  program = traced.program
  producer = {o: n.index for n in program.nodes for o in n.outputs}
  (v, a_value) = program.outputs
  live = {a_value}
  def anchor(x, prefer_recompute):
    return x in program.inputs or (x in live and not prefer_recompute)
  nodes, anchors = remat._regeneration(program, producer, v, anchor, max_nodes=2)
  assert anchors == (a_value,) and [program.nodes[i].name for i in nodes] == ["exp"]
  assert remat._walk_back(program, producer, v, anchor, max_nodes=2) is None
