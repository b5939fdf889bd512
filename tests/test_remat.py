"""Rematerialization: regions recompute exactly what they evict, and lower the modeled peak."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import analysis
from jax_symmem._src import executor
from jax_symmem._src import ir
from jax_symmem._src.ir import Const
from jax_symmem._src import memory
from jax_symmem._src import remat
from jax_symmem._src import schedule
from jax_symmem._src import variants
from jax_symmem._src import xla_buffers
from jax_symmem.examples import transformer
from tests import programs

CFG = transformer.Config(vocab=61, d_model=32, n_heads=2, d_ff=64, n_layers=2)
CONSTRAINTS = ("s >= 2", "b <= 4", "s <= 128")


@functools.lru_cache(maxsize=None)
def _analysis():
  return symmem.analyze(transformer.make_train_step(CFG), *programs.transformer_args(CFG, 2, 8),
                        polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS)


def test_regions_are_valid_and_never_recompute_effects():
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
  args = programs.transformer_args(CFG, 3, 50)
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


def test_every_fence_keeps_a_trigger_xla_cannot_drop():
  # XLA's algebraic simplifier drops an element of an optimization barrier that nothing
  # reads: a fence whose trigger copy is read only by dead code (the producer of a value a
  # later round evicted) loses the trigger, and XLA may run the recomputation early. On
  # this step rounds 10 on had such a fence; each now takes a trigger a live node reads.
  case = next(c for c in programs.CASES if c.name == "transformer_step")
  a = symmem.analyze(case.fun, *case.make_args(2, 8), polymorphic_shapes=case.polymorphic_shapes,
                     constraints=case.constraints)
  assert len(a.rounds) > 10
  for r in a.rounds[1:]:
    live = ir.live_nodes(r.program)
    read = {x for n in r.program.nodes if live[n.index] for x in n.operands}
    fences = [n for n in r.program.nodes if live[n.index] and n.name == "optimization_barrier"
              and n.source.startswith(remat.FENCE_SOURCE)]
    assert fences and all(f.outputs[-1] in read for f in fences)
    assert schedule.is_valid_order(r.program, r.order)   # the new copies read after they are made


def test_a_recomputed_value_is_evicted_again_reading_its_fenced_anchors_originals():
  # A recomputation reads its anchors' fenced copies, which die there; regenerating its
  # value again later (where a layer regenerated whole is live again) reads the originals.
  a = _analysis()
  found = None
  for j in range(1, len(a.rounds)):
    before, r = a.rounds[j - 1], a.rounds[j]
    producer = {o: n for n in before.program.nodes for o in n.outputs}
    through = remat.fenced_originals(before.program)
    for region in r.regions:
      if not isinstance(region, remat.Region):
        continue
      reads = {x for i in region.nodes for x in before.program.nodes[i].inputs
               if not isinstance(x, Const)}
      if (producer[region.value].source.endswith(remat.RECOMPUTED)
          and set(region.anchors) & set(through.values()) and reads & set(through)):
        found = found or j
  assert found, "no round evicts a recomputed value again"
  # Its clone is marked recomputed once, as the plan prints it.
  assert not any(n.source.count(remat.RECOMPUTED) > 1 for r in a.rounds for n in r.program.nodes)
  dims = {"b": 3, "s": 50}
  args = programs.transformer_args(CFG, 3, 50)
  want = jax.tree_util.tree_leaves(jax.jit(transformer.make_train_step(CFG))(*args))
  r = a.rounds[found]
  assert schedule.is_valid_order(r.program, r.order)
  got = _run_op_by_op(r.graph, r.program, r.order, jax.tree_util.tree_leaves(args), dims)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max() + 1))


def test_rounds_lower_the_modeled_peak_where_it_was_planned():
  a = _analysis()
  tight = a.graph.max_dims()
  peaks = [r.peak_at(tight) for r in a.rounds]
  assert min(peaks[1:]) < peaks[0]
  assert a.stats["remat_rounds"] == len(a.rounds) - 1
  assert "round 1" in a.plan and "evict" in a.plan



def test_rounds_after_the_last_that_lowered_a_planned_peak_are_dropped():
  # The six-layer MLP of test_jit ends its planning with a round that lowers the modeled
  # peak at none of the shapes planned for (the largest dims, then smaller ones): it only
  # recomputes more. Such a tail is dropped; the rounds before it are unchanged.
  from tests import test_jit
  traced = symmem.trace(test_jit._mlp_step, *test_jit._mlp_args(8),
                        polymorphic_shapes=(None, "b, _"), constraints=("b <= 512",))
  graph = symmem.shape_graph(traced)
  order = schedule.schedule(graph).order
  kept, _ = remat.plan_rounds(graph, order)
  every, _ = remat.plan_rounds(graph, order, drop_stale=False)
  assert 2 <= len(kept) < len(every)
  assert [r.regions for r in kept] == [r.regions for r in every[:len(kept)]]
  shapes = [graph.max_dims(), *remat._smaller_shapes(graph, graph.max_dims())]
  # The last round kept lowered the peak at some planned shape; no dropped round goes
  # below the rounds kept at any of them.
  assert any(kept[-1].peak_at(s) < kept[-2].peak_at(s) for s in shapes)
  for r in every[len(kept):]:
    assert all(r.peak_at(s) >= min(k.peak_at(s) for k in kept) for s in shapes)


def test_rounds_go_on_at_smaller_shapes_once_the_largest_runs_out():
  # A peak at a smaller shape spans values the largest shape's peak does not: the rounds
  # planned there, after the largest dims' rounds (unchanged), lower the floor there.
  a = _analysis()
  main_only, _ = remat.plan_rounds(a.graph, a.rounds[0].order, later_shapes=[])
  assert len(a.rounds) > len(main_only)
  assert [r.regions for r in a.rounds[:len(main_only)]] == [r.regions for r in main_only]
  mid, geo = {"b": 2, "s": 65}, {"b": 2, "s": 16}   # of b <= 4, 2 <= s <= 128
  assert remat._smaller_shapes(a.graph, a.graph.max_dims()) == [mid, geo]
  # (At the midpoint, the largest dims' rounds already reach the floor on this model.)
  assert (min(r.peak_at(geo) for r in a.rounds) < min(r.peak_at(geo) for r in main_only))


def test_rounds_are_also_planned_at_the_corners_a_token_budget_cuts():
  # Batches of at most 2048 tokens: no call has the box's corner (b=64, s=256), where the
  # rounds are planned first; then at the largest allowed points, many short sequences
  # (64, 32) and a few long ones (8, 256), which lowers the ladder's floor there.
  a = symmem.analyze(transformer.make_train_step(CFG), *programs.transformer_args(CFG, 2, 8),
                     polymorphic_shapes=(None, "b, s", "b, s"),
                     constraints=("b <= 64", "s >= 2", "s <= 256", "b*s <= 2048"))
  corners = [{"b": 64, "s": 32}, {"b": 8, "s": 256}]
  later = remat._smaller_shapes(a.graph, a.graph.max_dims())
  assert later[:2] == corners and all(a.graph.constraints.allows(s) for s in later)
  main_only, _ = remat.plan_rounds(a.graph, a.rounds[0].order, later_shapes=[])
  floor = lambda rounds, at: min(r.peak_at(at) for r in rounds)
  assert all(floor(a.rounds, c) <= floor(main_only, c) for c in corners)
  assert floor(a.rounds, corners[0]) < floor(main_only, corners[0])
  # Reports evaluate sizes at an allowed shape: the corner where the values are largest.
  assert a.graph.report_dims() == corners[1]
  assert "at {'b': 8, 's': 256}" in a.plan and "b=8, s=256" in symmem.shape_report(a)


def test_choose_round_picks_the_smallest_that_fits_and_names_the_minimum():
  a = _analysis()
  dims = a.graph.max_dims()
  peaks = [a.round_peak(k, dims) for k in range(len(a.rounds))]
  assert a.choose_round(dims, None) == 0
  assert a.choose_round(dims, peaks[0]) == 0
  k = a.choose_round(dims, min(peaks))
  assert peaks[k] <= min(peaks) and all(p > min(peaks) for p in peaks[:k])
  # One byte short: both figures would read the same in MiB, so the message gives bytes.
  with pytest.raises(symmem.BudgetError, match=f"{min(peaks) - 1:,} bytes is below .*: "
                                               f"{min(peaks):,} bytes modeled"):
    a.choose_round(dims, min(peaks) - 1)
  with pytest.raises(symmem.BudgetError, match=f"{min(peaks) / 2 / 2**20:.1f} MiB is below "
                                               f".*: {min(peaks) / 2**20:.1f} MiB modeled"):
    a.choose_round(dims, min(peaks) // 2)


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


# --- the regeneration bound: FLOPs, not a node count ----------------------------------------

W_DIM = 32


def test_a_rounds_footprint_runs_what_frees_memory_as_soon_as_xla_would():
  # XLA schedules a round itself: a node that reads a value last runs as soon as its
  # operands exist where that frees memory. A round whose order keeps such a node late
  # (here one of round 5's dots moved to just before its first consumer) is predicted in
  # the hoisted order (schedule.hoist), as XLA runs it; its own order would say more.
  a = _analysis()
  k, dims = 5, {"b": 4, "s": 128}
  r = a.rounds[k]
  footprint = lambda order: xla_buffers.footprint_at(r.graph, dims, r.program, order)
  succs = [[] for _ in r.program.nodes]
  for i, ps in enumerate(schedule.dependencies(r.program)):
    for p in ps:
      succs[p].append(i)
  def delayed(i):
    q = min(r.order.index(j) for j in succs[i])
    rest = [n for n in r.order if n != i]
    return rest[:q - 1] + [i] + rest[q - 1:]
  late = max((delayed(i) for i in r.order if succs[i]), key=footprint)
  assert footprint(late) > footprint(r.order)
  rounds = list(a.rounds)
  rounds[k] = dataclasses.replace(r, order=tuple(late))
  fresh = {f.name: {} for f in dataclasses.fields(a) if f.name.startswith("_round")}
  planning = analysis.Planning(lambda: (a.schedule, tuple(rounds), a.remat_stats), False)
  moved = dataclasses.replace(a, planning=planning, **fresh)
  hoisted, moves = schedule.hoist(r.graph, late, dims, r.program)
  assert moves and schedule.is_valid_order(r.program, hoisted)
  assert moved.round_footprint(k, dims) == min(footprint(late), footprint(hoisted))
  assert moved.round_footprint(k, dims) < footprint(late)


def _chain_step(n_ops):
  """A step whose first matmul reads `h`, built from the data by a chain of 2 * n_ops cheap
  elementwise ops: h is a residual of the backward pass that only the chain regenerates."""
  def step(w, x):
    def loss(w):
      h = x
      for _ in range(n_ops):
        h = jnp.sin(h) * 0.9
      a = jnp.tanh(h @ w)
      return jnp.sum(jnp.tanh(a @ w) ** 2)
    return jax.grad(loss)(w)
  return step


def _randn(seed, *shape):
  """Standard normal float32 data from NumPy: jax.random.normal compiles per shape, a
  3-d one for ~2 s on XLA:CPU."""
  return jnp.asarray(np.random.RandomState(seed).randn(*shape), jnp.float32)


def _chain_args(b, s):
  return _randn(0, W_DIM, W_DIM) / W_DIM, _randn(1, b, s, W_DIM)


def _chain_plan(n_ops):
  traced = symmem.trace(_chain_step(n_ops), *_chain_args(2, 8),
                        polymorphic_shapes=(None, "b, s, _"), constraints=("s <= 256", "b <= 4"))
  graph = symmem.shape_graph(traced)
  sched = schedule.schedule(graph)
  return graph, sched, remat.plan(graph, sched.order)


def test_a_long_cheap_chain_is_regenerated_and_the_rewrite_equals_jax_jit():
  graph, sched, p = _chain_plan(30)
  # The chain's 60 ops regenerate h: more than the 40-node cap this bound replaced.
  long = [r for r in p.regions if len(r.nodes) > 40]
  assert long, [len(r.nodes) for r in p.regions]
  program, order, _ = remat.apply_regions(graph.traced.program, sched.order, long[:1])
  assert schedule.is_valid_order(program, order)
  args = _chain_args(3, 50)
  from jax_symmem._src import tracing
  specialized = tracing.specialize_program(program, graph.constraints.complete({"b": 3, "s": 50}))
  outs, _, _ = executor.run_tracked(specialized, [jnp.asarray(a) for a in args], order)
  want = jax.jit(_chain_step(30))(*args)
  np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_ops", [5, 30, 400])
def test_every_region_costs_at_most_its_share_of_the_step(n_ops):
  graph, _, p = _chain_plan(n_ops)
  env = graph.constraints.complete(graph.max_dims())
  program = graph.traced.program
  step = sum(remat.flops(graph, n).evaluate(env) for n in program.nodes)
  assert 0 < p.max_flops_per_byte <= step   # the step's FLOPs per evictable byte
  for r in p.regions:
    # Brute force: the region's cost is the sum of its nodes' FLOPs, and within the bound.
    cost = sum(remat.flops(graph, program.nodes[i]).evaluate(env) for i in r.nodes)
    assert cost == r.cost.evaluate(env) <= p.max_flops_per_byte * r.saved.evaluate(env)
  # h's regeneration (the whole chain: 2 * n_ops FLOPs per element of h, 4 bytes) is in
  # the plan exactly when that is within the bound (n_ops = 400 is not).
  h_bytes = 4 * env["b"] * env["s"] * W_DIM
  chain = 2 * n_ops * env["b"] * env["s"] * W_DIM
  found = any(len(r.nodes) >= 2 * n_ops for r in p.regions)
  assert found == (chain <= p.max_flops_per_byte * h_bytes)


# --- shared recomputation: work that several evicted values need runs once ------------------


def _fork_step(w1, w2, w3, x):
  """h = sin(x @ w1) feeds two branches; the values they keep for the backward pass all
  regenerate from the one matmul."""
  def loss(w1, w2, w3):
    h = jnp.sin(x @ w1)
    p, q = jnp.tanh(h), jnp.cos(h) * 2.0
    return jnp.sum((jnp.tanh(p @ w2) * jnp.tanh(q @ w3)) ** 2)
  return jax.grad(loss, argnums=(0, 1, 2))(w1, w2, w3)


def _fork_args(b, s, d=16):
  return (_randn(0, d, d) / d, _randn(1, d, 4 * d) / d, _randn(2, d, 4 * d) / d,
          _randn(3, b, s, d))


@functools.lru_cache(maxsize=None)
def _fork_graph():
  traced = symmem.trace(_fork_step, *_fork_args(2, 8), polymorphic_shapes=(None,) * 3 + ("b, s, _",),
                        constraints=("s <= 256", "b <= 4"))
  graph = symmem.shape_graph(traced)
  return graph, schedule.schedule(graph)


def _run_op_by_op(graph, program, order, args, dims):
  from jax_symmem._src import tracing
  specialized = tracing.specialize_program(program, graph.constraints.complete(dims))
  outs, _, _ = executor.run_tracked(specialized, [jnp.asarray(a) for a in args], order)
  return outs


def test_regions_of_one_consumer_recompute_shared_work_once_and_equal_jax_jit():
  graph, sched = _fork_graph()
  program = graph.traced.program
  chosen = []
  for r in remat.plan(graph, sched.order).regions:   # the regions that recompute the matmul
    if any(program.nodes[i].name == "dot_general" and program.nodes[i].inputs[0] in
           program.inputs for i in r.nodes) and remat.compatible(chosen, r):
      chosen.append(r)
  assert len(chosen) >= 2 and len({i for r in chosen for i in r.nodes}) < sum(
      len(r.nodes) for r in chosen)
  # Regenerated before the same (the latest) consumer, they share one fence and every node
  # any of them needs is cloned once.
  position = {i: k for k, i in enumerate(sched.order)}
  last = max((r.consumer for r in chosen), key=position.__getitem__)
  group = [dataclasses.replace(r, consumer=last) for r in chosen]
  rewritten, order, blocks = remat.apply_regions(program, sched.order, group)
  assert schedule.is_valid_order(rewritten, order)
  assert len({b.barrier for b in blocks}) == 1
  union = {i for r in group for i in r.nodes}
  assert len({i for b in blocks for i in b.clones}) == len(union)
  args = _fork_args(3, 20)
  want = jax.tree_util.tree_leaves(jax.jit(_fork_step)(*args))
  for got, w in zip(_run_op_by_op(graph, rewritten, order, args, {"b": 3, "s": 20}), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


# --- fences XLA keeps ------------------------------------------------------------------------


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
  # Fence outputs something reads on the way to the step's outputs: a value whose every
  # read is after a later round's eviction point is regenerated there, and its first
  # computation (a fenced recomputation of an earlier round) is dead code XLA removes.
  live = {x for x in program.outputs if not isinstance(x, Const)}
  for i in reversed(a.round_order(k, dims)):
    n = program.nodes[i]
    if live & set(n.outputs) or n.effects:
      live |= {x for x in n.inputs if not isinstance(x, Const)}
  want = sum(o in live for n in program.nodes if n.name == "optimization_barrier"
             for o in n.outputs)
  flat = jax.tree_util.tree_leaves(programs.transformer_args(CFG, 2, 16))
  hlo = jax.jit(variants.round_function(a, k, dims)).lower(*flat).compile(
      compiler_options=variants.round_options(a, k)).as_text()
  kept = sum(line.split("opt-barrier(")[0].count("[") for line in hlo.splitlines()
             if " opt-barrier(" in line)
  assert kept >= want > 0


def test_a_residual_out_of_reach_of_recomputation_is_read_from_live_values():
  # c = cos(2x) is neither live at the use nor recomputable within the cost (a FLOP
  # per node, two at most), so the walk that recomputes large inputs fails; the
  # second reads the live a = sin(c).
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
  one_each = lambda i: 1
  nodes, anchors = remat._regeneration(program, producer, v, anchor, one_each, 2)
  assert anchors == (a_value,) and [program.nodes[i].name for i in nodes] == ["exp"]
  assert remat._walk_back(program, producer, v, anchor, one_each, 2) is None


# --- one candidate per layer ---------------------------------------------------------------


class _Block(nn.Module):
  """A residual MLP block, as a Flax user writes one."""

  @nn.compact
  def __call__(self, h):
    y = nn.Dense(32)(nn.LayerNorm()(h))
    return h + nn.Dense(h.shape[-1])(jax.nn.gelu(y) * jax.nn.sigmoid(y))


class _Blocks(nn.Module):
  @nn.compact
  def __call__(self, h):
    for i in range(2):
      h = _Block(name=f"layer_{i}")(h)   # scopes layer_0, layer_1
    return h


def _blocks_step(params, x, mask):
  def loss(p):
    h = _Blocks().apply({"params": p}, x)
    return jnp.sum(jnp.where(mask[..., None], h, 0.0) ** 2) / jnp.maximum(mask.sum(), 1)
  value, grads = jax.value_and_grad(loss)(params)
  return value, jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads)


def _blocks_args(b, s, seed=0):
  params = _Blocks().init(jax.random.PRNGKey(0), jnp.zeros((1, 2, 16)))["params"]
  mask = jnp.arange(s)[None, :] < jnp.asarray([s, s // 2, s, 1][:b])[:, None]
  return params, _randn(seed, b, s, 16), mask


def test_a_layer_group_evicts_the_layers_residuals_and_recomputes_the_layer_once():
  from jax_symmem._src.ir import layer_scope
  traced = symmem.trace(_blocks_step, *_blocks_args(2, 8),
                        polymorphic_shapes=(None, "b, s, _", "b, s"),
                        constraints=("s <= 256", "b <= 4"))
  graph = symmem.shape_graph(traced)
  sched = schedule.schedule(graph)
  program = traced.program
  producer = {o: n for n in program.nodes for o in n.outputs}
  offered = remat.plan(graph, sched.order, layer_groups=True).regions
  groups = [r for r in offered if isinstance(r, remat.RegionGroup)]
  # The last layer forms no group: its backward comes first, right after the peak.
  assert [g.layer for g in groups] == ["layer_0"]
  # A grouped value is offered with its layer only, never alone as well; the last
  # layer's values are offered alone, as without groups.
  grouped = {r.value for g in groups for r in g.regions}
  alone = remat.plan(graph, sched.order, layer_groups=False).regions
  assert not any(isinstance(r, remat.RegionGroup) for r in alone)
  singles = {r.value for r in offered if isinstance(r, remat.Region)}
  assert not grouped & singles
  last_layer = {r.value for r in alone if layer_scope(producer[r.value].source) == "layer_1"}
  assert last_layer and last_layer <= singles
  env = graph.constraints.complete(graph.max_dims())
  for g in groups:
    assert len({r.consumer for r in g.regions}) == 1   # one consumer: one recomputation
    assert {layer_scope(producer[r.value].source) for r in g.regions} == {g.layer}
    assert not {r.value for r in g.regions} & {a for r in g.regions for a in r.anchors}
    # A layer's values share work (the first projection): the group costs their union.
    assert g.cost.evaluate(env) < sum(r.cost.evaluate(env) for r in g.regions)
    assert g.saved.evaluate(env) == sum(r.saved.evaluate(env) for r in g.regions)
  # The first layer's output is the second's input: it stays, as jax.checkpoint keeps it.
  first = next(g for g in groups if g.layer == "layer_0")
  reads_of_layer_1 = {v for n in program.nodes if layer_scope(n.source) == "layer_1"
                      for v in n.operands}
  assert not {r.value for r in first.regions} & reads_of_layer_1
  regions = [r for g in groups for r in g.regions]
  rewritten, order, blocks = remat.apply_regions(program, sched.order, regions)
  assert schedule.is_valid_order(rewritten, order)
  assert len({b.barrier for b in blocks}) == 1
  assert len({i for b in blocks for i in b.clones}) == sum(
      len({i for r in g.regions for i in r.nodes}) for g in groups)
  args = _blocks_args(3, 20, seed=1)
  want = jax.tree_util.tree_leaves(jax.jit(_blocks_step)(*args))
  got = _run_op_by_op(graph, rewritten, order, jax.tree_util.tree_leaves(args), {"b": 3, "s": 20})
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max() + 1))


class _PostNormBlock(nn.Module):
  """BERT's order: the block's output is normalized, and the next block's dense reads it
  (its weight gradient too, after the peak)."""

  @nn.compact
  def __call__(self, h):
    y = nn.Dense(h.shape[-1])(jax.nn.gelu(nn.Dense(8)(h)))   # narrower than its input
    return nn.LayerNorm()(h + y)


def _post_norm_step(params, x):
  def loss(p):
    h = jnp.tanh(x) * 2.0   # made outside any layer: the first layer's input
    for i in range(3):
      h = _PostNormBlock(name=f"layer_{i}").apply({"params": p[f"layer_{i}"]}, h)
    return jnp.mean(h ** 2)
  return jax.grad(loss)(params)


def test_a_layers_input_stays_while_a_layer_is_left_to_evict_whole():
  from jax_symmem._src.ir import layer_scope
  params = {f"layer_{i}": _PostNormBlock().init(jax.random.PRNGKey(i), jnp.zeros((1, 2, 16)))
            ["params"] for i in range(3)}
  traced = symmem.trace(_post_norm_step, params, _randn(0, 2, 8, 16),
                        polymorphic_shapes=(None, "b, s, _"), constraints=("s <= 256", "b <= 4"))
  graph = symmem.shape_graph(traced)
  order = schedule.schedule(graph).order
  program = traced.program
  producer = {o: n for n in program.nodes for o in n.outputs}
  scope = lambda v: layer_scope(producer[v].source)
  read_by_next = {v for n in program.nodes for v in n.operands
                  if v in producer and scope(v) != layer_scope(n.source)
                  and layer_scope(n.source) is not None}
  alone = remat.plan(graph, order, layer_groups=False).regions
  boundaries = {r.value for r in alone} & read_by_next
  # each layer's output, live across the peak for the next weight gradient; and the
  # first layer's input, made outside any layer
  assert len(boundaries) == 3 and None in {scope(v) for v in boundaries}, boundaries
  offered = remat.plan(graph, order, layer_groups=True).regions
  members = [r for x in offered for r in (x.regions if isinstance(x, remat.GROUPS) else (x,))]
  assert not {r.value for r in members} & boundaries   # kept, as jax.checkpoint keeps them
  assert any(isinstance(x, remat.RegionGroup) for x in offered)
  # ...and read where live, however large: recomputed, a copy would sit beside the original.
  position = {n: k for k, n in enumerate(order)}
  last_read = {}
  for n in program.nodes:
    for v in n.operands:
      last_read[v] = max(last_read.get(v, -1), position[n.index])
  for r in members:
    for i in r.nodes:
      for o in program.nodes[i].outputs:
        assert not (o in boundaries and last_read[o] >= position[r.consumer]), (r, o)
  assert any(set(r.anchors) & boundaries for r in members)
  # Once every layer is evicted whole, a layer's input is offered alone (checkpoints
  # further apart than per-layer checkpointing's).
  rnd = remat.first_round(graph, order)
  for _ in range(8):
    plan = remat.plan(rnd.graph, rnd.order, program=rnd.program, layer_groups=True)
    groups = [x for x in plan.regions if isinstance(x, remat.RegionGroup)]
    if not groups:
      break
    rnd = remat.apply_round(rnd, list(groups[0].regions))
  assert not groups and rnd.regions
  assert {x.value for x in plan.regions if isinstance(x, remat.Region)} & boundaries


@pytest.mark.slow   # test_a_layer_group_evicts_the_layers_residuals_and_recomputes_the_layer_once
def test_rounds_evict_whole_layers_stay_valid_and_compute_what_jax_jit_does():
  from jax_symmem._src.ir import layer_scope
  from jax_symmem.examples import llama
  cfg = llama.PRESETS["tiny"]
  step = llama.train_step_fn(llama.Llama(cfg))
  state = llama.init_state(cfg)
  traced = symmem.trace(step, state, *llama.example_batch(cfg, 2, 16),
                        polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=llama.step_constraints(64, 4))
  graph = symmem.shape_graph(traced)
  rounds, _ = remat.plan_rounds(graph, schedule.schedule(graph).order, layer_groups=True)
  at = graph.max_dims()
  peaks = [rd.peak_at(at) for rd in rounds]
  assert len(rounds) > 2 and min(peaks[1:]) < peaks[0]
  # Some round evicts a layer whole: several of its values, one consumer (one fence).
  def layers_taken(rd):
    consumers = {}   # a layer's scope -> the consumer of each of its evicted values
    for block in rd.blocks:
      consumers.setdefault(layer_scope(block.region.source), []).append(block.region.consumer)
    return {scope for scope, cs in consumers.items() if scope and len(cs) > 1 and len(set(cs)) == 1}
  assert any(layers_taken(rd) for rd in rounds[1:])
  args = (state, *llama.example_batch(cfg, 3, 20, seed=1))
  want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
  for rd in (rounds[len(rounds) // 2], rounds[-1]):
    assert schedule.is_valid_order(rd.program, rd.order)
    got = _run_op_by_op(rd.graph, rd.program, rd.order, jax.tree_util.tree_leaves(args),
                        {"b": 3, "s": 20})
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max() + 1))


# --- dropout: masks regenerated from their keys -----------------------------------------


class _DropoutBlock(nn.Module):
  """A pre-norm MLP block with dropout on its hidden activations and its output, as
  fine-tuning recipes write it (HF's models default to 0.1)."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(64)(nn.LayerNorm()(x)))
    h = nn.Dropout(0.1, deterministic=False)(h)
    return x + nn.Dropout(0.1, deterministic=False)(nn.Dense(32)(h))


class _DropoutNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = _DropoutBlock(name=f"block_{i}")(x)
    return x


def _dropout_step(params, x, key):
  def loss(p):
    y = _DropoutNet().apply({"params": p}, x, rngs={"dropout": key})
    return jnp.mean(y ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


# Every round of the dropout step: slow; the dropout budget test below stays fast.
@pytest.mark.slow
def test_dropout_masks_are_regenerated_from_their_keys_and_every_round_equals_jax_jit():
  # jax.random's ops are functions of their key: a regeneration may run them again (as
  # jax.checkpoint does) and gets the same bits, so the masks need not stay resident.
  params = _DropoutNet().init(jax.random.key(0), jnp.ones((1, 4, 32)))["params"]
  key = jax.random.key(1)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 48, 32).astype(np.float32))
  a = symmem.analyze(_dropout_step, params, x, key,
                     polymorphic_shapes=(None, "b, s, 32", None), constraints=("b <= 4", "s <= 64"))
  def draws_again(j: int) -> bool:   # round j regenerates a value through random_bits
    nodes = a.rounds[j - 1].program.nodes   # a round's regions index the program before it
    regions = [r for item in a.rounds[j].regions for r in getattr(item, "regions", (item,))]
    return any(nodes[i].name == "random_bits" for r in regions if isinstance(r, remat.Region)
               for i in r.nodes)
  assert any(draws_again(j) for j in range(1, len(a.rounds)))
  want = jax.tree_util.tree_leaves(jax.jit(_dropout_step)(params, x, key))
  flat = jax.tree_util.tree_leaves((params, x, key))
  dims = {"b": 2, "s": 48}
  for k in sorted({1, len(a.rounds) // 2, len(a.rounds) - 1}):
    got = jax.jit(variants.round_function(a, k, dims))(*flat)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert a.round_peak(len(a.rounds) - 1, dims) < a.round_peak(0, dims)


def test_a_random_draw_costs_threefry_per_word():
  # Regenerating a mask runs Threefry again: ranked by its work, not one FLOP per bit.
  from jax_symmem._src import flops as flops_lib
  from jax_symmem._src import tracing
  from jax_symmem._src.shape_graph import ShapeGraph
  traced = tracing.trace(lambda k, x: jax.random.bits(k, x.shape, jnp.uint32),
                         jax.random.key(0), jnp.ones((2, 8)), polymorphic_shapes=(None, "b, 8"))
  graph = ShapeGraph(traced)
  (node,) = [n for n in traced.program.nodes if n.name == "random_bits"]
  cost = flops_lib.flops(graph, node)
  assert cost.evaluate({"b": 3}) == flops_lib.THREEFRY_OPS_PER_WORD * 3 * 8


@pytest.mark.usefixtures("own_arrays_only")   # a budget of a few KiB to 1 MiB
def test_a_dropout_step_under_a_budget_jax_jit_exceeds_runs_a_round_within_it():
  # End to end on a step that draws masks: under a budget jax.jit's program exceeds, a
  # round > 0 runs, XLA's figure within the budget, with jax.jit's numbers.
  from tests import budgets
  params = _DropoutNet().init(jax.random.key(0), jnp.ones((1, 4, 32)))["params"]
  key = jax.random.key(1)
  x = jnp.asarray(np.random.RandomState(1).randn(4, 64, 32).astype(np.float32))
  kw = dict(polymorphic_shapes=(None, "b, s, 32", None), constraints=("b <= 4", "s <= 64"))
  a = symmem.analyze(_dropout_step, params, x, key, **kw)
  dims = {"b": 4, "s": 64}
  budget = budgets.tight_budget(a, dims, (params, x, key))
  assert budgets.xla_bytes(a, 0, dims, (params, x, key)) > budget   # jax.jit's program does not fit
  step = symmem.jit(_dropout_step, memory_budget=budget, **kw)
  got = step(params, x, key)
  assert step.last_call["round"] > 0
  assert step.last_call["xla_bytes"] <= budget - step.last_call["reserved"]
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(jax.jit(_dropout_step)(params, x, key))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _haiku_named_step(checkpointed=False):
  """Three MLP layers called as Haiku calls three instances of one module: under the
  scopes "block", "block_1", "block_2" (`jax.named_call` by the module's own name)."""
  def loss(ws, x):
    for name, (w1, w2) in zip(("block", "block_1", "block_2"), ws):
      def layer(x, w1, w2, name=name):
        with jax.named_scope(name):
          return x + jax.nn.gelu(jnp.tanh(x @ w1) @ w1.T @ w1) @ w2
      x = (jax.checkpoint(layer) if checkpointed else layer)(x, w1, w2)
    return jnp.mean(x ** 2)
  return jax.value_and_grad(loss)


def _mlp_layers_reach(make_step, shared=False):
  """(analysis, the layer groups its first round offers, and the modeled peak of its
  least-peak round at b=4, s=256 over the step's with `jax.checkpoint` on each layer, as
  written) for a step of three 16 -> 64 -> 16 MLP layers; the least-peak round's outputs
  are checked against `jax.jit`'s at that shape."""
  rng = np.random.RandomState(0)
  def weights():
    return (jnp.asarray(rng.randn(16, 64), jnp.float32) / 4,
            jnp.asarray(rng.randn(64, 16), jnp.float32) / 8)
  ws = weights() if shared else [weights() for _ in range(3)]
  x = jnp.asarray(rng.randn(2, 8, 16), jnp.float32)
  kw = dict(polymorphic_shapes=(None, "b, s, _"), constraints=("s <= 256", "b <= 4"))
  plain = symmem.analyze(make_step(), ws, x, **kw)
  offered = remat.plan(plain.graph, schedule.schedule(plain.graph).order, layer_groups=True)
  groups = [g for g in offered.regions if isinstance(g, remat.RegionGroup)]
  dims = {"b": 4, "s": 256}
  ckpt = symmem.analyze(make_step(checkpointed=True), ws, x, **kw)
  floor = min(range(len(plain.rounds)), key=lambda k: plain.round_peak(k, dims))
  args = (ws, jnp.asarray(rng.randn(4, 256, 16), jnp.float32))
  got = jax.jit(variants.round_function(plain, floor, dims))(*jax.tree_util.tree_leaves(args))
  want = jax.tree_util.tree_leaves(jax.jit(make_step())(*args))
  for g, w in zip(got, want):   # a shared weight's gradient sums its calls in another order
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4 * float(np.abs(w).max()))
  return plain, groups, plain.round_peak(floor, dims) / ckpt.round_peak(ckpt.as_written_round, dims)


def test_haiku_named_layers_form_groups_and_reach_per_layer_checkpointing():
  _, groups, reach = _mlp_layers_reach(_haiku_named_step)
  # The unindexed first call is a layer too (the last layer forms no group: its backward
  # comes right after the peak).
  assert {g.layer for g in groups} == {"block_0", "block_1"}
  assert reach <= 1.02


def _shared_layer_step(checkpointed=False):
  """One MLP layer's weights applied three times, each call under the same scope, as a
  Flax module called once per layer names them (ALBERT: "albert_layer_groups/0")."""
  def loss(ws, x):
    w1, w2 = ws
    def layer(x, w1, w2):
      with jax.named_scope("shared_0"):
        return x + jax.nn.gelu(jnp.tanh(x @ w1) @ w1.T @ w1) @ w2
    with jax.named_scope("model"):
      for _ in range(3):
        x = (jax.checkpoint(layer) if checkpointed else layer)(x, w1, w2)
      return jnp.mean(x ** 2)
  return jax.value_and_grad(loss)


def test_a_module_called_once_per_layer_forms_a_group_per_call():
  _, groups, reach = _mlp_layers_reach(_shared_layer_step, shared=True)
  # All three calls share the scope "shared_0"; each call but the last is a layer.
  assert {g.layer for g in groups} == {"shared_0 (call 0)", "shared_0 (call 1)"}
  assert reach <= 1.02


def _unscoped_layers_step(checkpointed=False):
  """Three MLP layers in a Python loop and no scope at all, as Flax NNX and Equinox
  modules trace (neither pushes a name scope)."""
  def loss(ws, x):
    def layer(x, w1, w2):
      return x + jax.nn.gelu(jnp.tanh(x @ w1) @ w1.T @ w1) @ w2
    x = jnp.tanh(x)   # an embedding of sorts: ops before the layers
    for w1, w2 in ws:
      x = (jax.checkpoint(layer) if checkpointed else layer)(x, w1, w2)
    return jnp.mean(x ** 2)
  return jax.value_and_grad(loss)


def test_layers_without_scopes_are_read_from_their_repeated_code():
  plain, groups, reach = _mlp_layers_reach(_unscoped_layers_step)
  assert {g.layer for g in groups} == {"repeated layer (call 0)", "repeated layer (call 1)"}
  # The calls are the layers, in order: the first group's values are all made before
  # the second's.
  producer = {o: n for n in plain.traced.program.nodes for o in n.outputs}
  made = {g.layer: [producer[r.value].index for r in g.regions] for g in groups}
  assert max(made["repeated layer (call 0)"]) < min(made["repeated layer (call 1)"])
  assert reach <= 1.02


# Slow: the layer-group test above covers whole-layer eviction in the fast tier.
@pytest.mark.slow
def test_an_nnx_python_loop_of_layers_reaches_per_layer_nnx_remat():
  """Flax NNX pushes no name scopes: its layers come from the repeated code."""
  from flax import nnx
  from jax_symmem.examples import llama, llama_nnx
  cfg = dataclasses.replace(llama.PRESETS["tiny"], n_layers=3)
  def analyze(policy):
    model, optimizer = llama_nnx.init_state(cfg, remat_policy=policy)
    tokens, mask = llama.example_batch(cfg, 2, 16)
    return symmem.analyze(llama_nnx.pure_train_step(model, optimizer),
                          nnx.state((model, optimizer)), tokens, mask,
                          polymorphic_shapes=(None, "b, s", "b, s"),
                          constraints=("s <= 256", "b <= 4", "s >= 2"))
  plain = analyze(None)
  assert {ir.layer_scope(n.source) for n in plain.traced.program.nodes} == {None}
  offered = remat.plan(plain.graph, schedule.schedule(plain.graph).order, layer_groups=True)
  assert {g.layer for g in offered.regions if isinstance(g, remat.RegionGroup)} == {
      "repeated layer (call 0)", "repeated layer (call 1)"}
  dims = {"b": 4, "s": 256}
  ckpt = analyze("layer")
  floor = min(plain.round_peak(k, dims) for k in range(len(plain.rounds)))
  assert floor <= 1.02 * ckpt.round_peak(ckpt.as_written_round, dims)
