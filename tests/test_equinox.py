"""An Equinox model (modules as pytrees, layers scanned or in a Python loop) under symmem.jit."""

from unittest import mock

import chex
import jax
import pytest

import jax_symmem as symmem
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import loop_remat
from jax_symmem.examples import llama
from tests import budgets

pytest.importorskip("equinox")
from jax_symmem.examples import gpt_equinox  # noqa: E402

CFG = gpt_equinox.GPTConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)
SHAPES = (None, "b, s", "b, s")
CONSTRAINTS = llama.step_constraints(64, 4)


# Four compiles (symmem.jit and jax.jit at two shapes), the fast tier's slowest test on a
# slow host: slow tier. The fast tier runs the Equinox step under a budget below.
@pytest.mark.slow
def test_equinox_scanned_step_without_a_budget_is_jax_jit_at_each_shape():
  # Without a budget symmem.jit compiles per shape what jax.jit compiles: bitwise equal.
  fn = gpt_equinox.train_step_fn(CFG)
  state = gpt_equinox.init_state(CFG)
  step = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  ref = jax.jit(fn)
  for b, s in ((2, 16), (3, 40)):
    tokens, mask = gpt_equinox.example_batch(CFG, b, s)
    chex.assert_trees_all_equal(step(state, tokens, mask), ref(state, tokens, mask))
  assert step.cache_info()["compiles"] == 2


# Slow (9 s): the fast tier runs the Equinox step's per-layer checkpointing test.
@pytest.mark.slow
def test_equinox_scanned_step_under_a_tight_budget_matches_jax_jit_with_the_same_options():
  # The scan that Equinox's scan-over-layers pattern makes (eqx.filter_vmap-built layers,
  # partition / combine in the body, the model vmapped over the batch) is a loop the
  # planner evicts from: a remat round runs and computes what jax.jit computes.
  fn = gpt_equinox.train_step_fn(CFG)
  state = gpt_equinox.init_state(CFG)
  tokens, mask = gpt_equinox.example_batch(CFG, 4, 64)
  dims = {"b": 4, "s": 64}
  analysis = symmem.analyze(fn, state, tokens, mask, polymorphic_shapes=SHAPES,
                            constraints=CONSTRAINTS)
  assert any(isinstance(r, loop_remat.LoopEviction) for rnd in analysis.rounds for r in rnd.regions)
  step = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS,
                    memory_budget=budgets.tight_budget(analysis, dims, (state, tokens, mask)))
  # The budget is a few MiB: arrays other tests hold must not count against it.
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    got = step(state, tokens, mask)
  assert "fallback" not in step.last_call and step.last_call["round"] > 0
  options = (jit_lib.CPU_COMPILER_OPTIONS if jax.devices()[0].platform == "cpu"
             else jit_lib.GPU_COMPILER_OPTIONS)
  ref = jax.jit(fn).lower(state, tokens, mask).compile(compiler_options=options)
  chex.assert_trees_all_close(got, ref(state, tokens, mask), rtol=1e-5, atol=1e-6)


def test_equinox_per_layer_checkpointing_computes_the_same_step():
  # remat_policy="layer" (eqx.filter_checkpoint on the scanned layer) changes what is
  # saved, not what is computed.
  state = gpt_equinox.init_state(CFG)
  tokens, mask = gpt_equinox.example_batch(CFG, 2, 16)
  plain = jax.jit(gpt_equinox.train_step_fn(CFG))(state, tokens, mask)
  remat = jax.jit(gpt_equinox.train_step_fn(CFG, remat_policy="layer"))(state, tokens, mask)
  chex.assert_trees_all_close(remat, plain, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="remat_policy"):
    gpt_equinox.train_step_fn(CFG, remat_policy="dots")


# Slow (16 s): the fast tier reads unscoped layers in tests/test_remat.py
# (test_layers_without_scopes_are_read_from_their_repeated_code, the NNX loop).
@pytest.mark.slow
def test_equinox_blocks_in_a_python_loop_are_layers_under_a_budget():
  # A list of blocks called in a loop (no scopes: Equinox pushes none) computes the
  # scanned model's step, its layers are read from the repeated code, and a round that
  # evicts one whole runs under a budget with jax.jit's numbers.
  from jax_symmem._src import remat, schedule
  cfg = gpt_equinox.GPTConfig(vocab=64, d_model=32, n_layers=3, n_heads=2, d_ff=64, max_len=64)
  fn = gpt_equinox.train_step_fn(cfg, scan_layers=False)
  state = gpt_equinox.init_state(cfg, scan_layers=False)
  tokens, mask = gpt_equinox.example_batch(cfg, 4, 64)
  _, loss = jax.jit(fn)(state, tokens, mask)   # the same weights as scanned: the same loss
  _, scanned_loss = jax.jit(gpt_equinox.train_step_fn(cfg))(gpt_equinox.init_state(cfg), tokens, mask)
  chex.assert_trees_all_close(loss, scanned_loss, rtol=1e-6)
  analysis = symmem.analyze(fn, state, tokens, mask, polymorphic_shapes=SHAPES,
                            constraints=CONSTRAINTS)
  graph = analysis.graph
  offered = remat.plan(graph, schedule.schedule(graph).order, layer_groups=True).regions
  assert {g.layer for g in offered if isinstance(g, remat.RegionGroup)} == {
      "repeated layer (call 0)", "repeated layer (call 1)"}
  dims = {"b": 4, "s": 64}
  step = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS,
                    memory_budget=budgets.tight_budget(analysis, dims, (state, tokens, mask)))
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    got = step(state, tokens, mask)
  assert "fallback" not in step.last_call and step.last_call["round"] > 0
  (variant,) = step.variants()
  ref = jax.jit(fn).lower(state, tokens, mask).compile(compiler_options=variant["compiler_options"])
  chex.assert_trees_all_close(got, ref(state, tokens, mask), rtol=1e-5, atol=1e-6)
