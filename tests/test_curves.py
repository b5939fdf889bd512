"""memory_curves: the same numbers as direct Analysis calls, shape by shape."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem.examples import transformer

CFG = transformer.Config(vocab=61, d_model=32, n_heads=2, d_ff=64, n_layers=1)
SHAPES = symmem.sweep(b=(1, 4), s=(2, 17, 64, 128))


@pytest.fixture(scope="module")
def analysis():
  # From the arguments' shapes: the curves are the model's, nothing runs the step.
  args = jax.eval_shape(lambda: transformer.example_args(CFG, 2, 8))
  return symmem.analyze(transformer.make_train_step(CFG), *args,
                        polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=("s >= 2", "s <= 128", "b <= 4"))


@pytest.fixture(scope="module")
def budget(analysis):
  """Between the last round's and round 0's peak at b=1, s=128: remat needed there."""
  dims = {"b": 1, "s": 128}
  return (analysis.round_peak(0, dims) + analysis.round_peak(len(analysis.rounds) - 1, dims)) // 2


def test_sweep():
  assert symmem.sweep(b=4, s=range(16, 49, 16)) == [
      {"b": 4, "s": 16}, {"b": 4, "s": 32}, {"b": 4, "s": 48}]
  assert symmem.sweep(b=(1, 2), s=(3, 5)) == [
      {"b": 1, "s": 3}, {"b": 1, "s": 5}, {"b": 2, "s": 3}, {"b": 2, "s": 5}]


def test_curves_match_direct_calls(analysis, budget):
  budgeted = dataclasses.replace(analysis, memory_budget=budget, _round0_orders={}, _round_peaks={})
  curves = symmem.memory_curves(budgeted, SHAPES)   # default: the analysis's budget
  assert curves.budget == budget
  assert curves == symmem.memory_curves(analysis, SHAPES, budget=budget)
  for i, dims in enumerate(SHAPES):
    assert curves.shapes[i] == dims
    assert curves.baseline[i] == budgeted.baseline_peak_bytes(**dims)
    assert curves.scheduled[i] == budgeted.round_peak(0, dims)
    if curves.dispatched[i] is None:
      assert curves.rounds[i] is None
      with pytest.raises(symmem.BudgetError):
        budgeted.peak_bytes(**dims)
    else:
      assert curves.dispatched[i] == budgeted.peak_bytes(**dims) <= budget
      assert curves.rounds[i] == budgeted.choose_round(dims, budget)
  # The three regimes all occur, so the comparison above covers each.
  assert 0 in curves.rounds and None in curves.rounds
  assert any(k for k in curves.rounds if k is not None)
  assert curves.static is None


def test_no_budget_and_static(analysis):
  shapes = symmem.sweep(b=2, s=17)   # static replans per shape: one keeps the test quick
  curves = symmem.memory_curves(analysis, shapes, budget=None, static=True)
  assert curves.rounds == (0,)
  assert curves.dispatched == curves.scheduled == tuple(analysis.peak_bytes(**d) for d in shapes)
  assert curves.static == tuple(analysis.static_peak_bytes(**d) for d in shapes)


def test_plotting_helpers(analysis, budget):
  curves = symmem.memory_curves(analysis, SHAPES, budget=budget)
  assert curves.x("s") == [d["s"] for d in SHAPES]
  mib = curves.mib("dispatched")
  for v, d in zip(mib, curves.dispatched):
    assert math.isnan(v) if d is None else v == d / 2**20
  assert all(math.isnan(v) for v in curves.mib("static"))
  with pytest.raises(ValueError, match="unknown curve"):
    curves.mib("peak")
  changes = curves.round_changes()
  assert changes[0] == (SHAPES[0], curves.rounds[0])
  assert [k for _, k in changes] == [k for i, k in enumerate(curves.rounds)
                                     if i == 0 or k != curves.rounds[i - 1]]
  text = str(curves)
  assert "over budget" in text and "trace order" in text and len(text.splitlines()) == 2 + len(SHAPES)


def test_sweep_takes_numpy_integers_and_refuses_strings():
  import numpy as np
  assert symmem.sweep(b=np.int64(4), s=np.arange(2, 4)) == [{"b": 4, "s": 2}, {"b": 4, "s": 3}]
  for wrong in ("32", 4.0, [16, 32.5]):
    with pytest.raises(TypeError, match=r"sweep\(s=...\): give an int or an iterable of ints"):
      symmem.sweep(s=wrong)


def test_reports_take_the_analysis_budget_or_a_size(analysis, budget):
  budgeted = dataclasses.replace(analysis, memory_budget=budget, _round0_orders={}, _round_peaks={})
  mib = f"{budget / 2**20:.6f}MiB"   # a size string for (about) the same budget
  as_string = symmem.memory_curves(analysis, SHAPES, budget=mib)
  assert abs(as_string.budget - budget) < 2**10
  assert symmem.memory_curves(budgeted, SHAPES).budget == budget
  report = symmem.memory_report(budgeted, SHAPES)   # default: the analysis's own budget
  assert report == symmem.memory_report(analysis, SHAPES, budget)
  assert "over budget" in report and f"(budget {budget / 2**20:,.1f} MiB)" in report
  assert "(no budget)" in symmem.memory_report(budgeted, SHAPES, None)
  with pytest.raises(ValueError, match="fraction of device memory; give bytes"):
    symmem.memory_curves(analysis, SHAPES, budget=0.5)


def test_shape_report_takes_the_graph_the_traced_program_or_the_analysis(analysis):
  text = symmem.shape_report(analysis.graph)
  assert symmem.shape_report(analysis) == text
  assert symmem.shape_report(analysis.traced) == text
  with pytest.raises(TypeError, match="expected a ShapeGraph, TracedProgram or Analysis"):
    symmem.shape_report("graph")


def test_figures_only_within_the_constraints_the_plan_was_made_for(analysis):
  with pytest.raises(symmem.ShapeError, match=r"outside the constraints .*s = 4096 is outside \[2, 128\]"):
    analysis.peak_bytes(b=1, s=4096)
  with pytest.raises(symmem.ShapeError, match=r"s = 1 is outside \[2, 128\]"):
    analysis.baseline_peak_bytes(b=1, s=1)
  with pytest.raises(ValueError, match="unknown dims q: .*dims are b, s"):
    analysis.round_peak(0, {"b": 1, "s": 8, "q": 1})
  last = len(analysis.rounds) - 1
  for k in (-1, last + 1):   # no index from the end; no IndexError from the tuple
    for figure in (analysis.round_peak, analysis.dispatch_figure):
      with pytest.raises(ValueError, match=f"plan has rounds 0 to {last}"):
        figure(k, {"b": 1, "s": 8})
  with pytest.raises(ValueError, match="give every dim of .*: s missing"):
    symmem.memory_curves(analysis, [{"b": 1}])
  # Sizes are integers: NumPy and JAX integer scalars count, a float or a bool does not.
  assert analysis.peak_bytes(b=np.int64(1), s=jnp.int32(8)) == analysis.peak_bytes(b=1, s=8)
  for bad in ({"b": 1, "s": 8.5}, {"b": True, "s": 8}):
    with pytest.raises(TypeError, match="is not an integer"):
      analysis.peak_bytes(**bad)
    with pytest.raises(TypeError, match="is not an integer"):
      analysis.baseline_peak_bytes(**bad)
  # Also where the integer dims' figures are cached (4.0 == 4 would find them), and in
  # the methods symmem.jit calls: the ladder, the scratch, the round it picks.
  analysis.round_peak(0, {"b": 1, "s": 8})
  for method in (lambda d: analysis.round_peak(0, d), lambda d: analysis.round_scratch(0, d),
                 analysis.ladder, lambda d: analysis.best_round(d, 2**30)):
    with pytest.raises(TypeError, match="is not an integer"):
      method({"b": 1.0, "s": 8})
    with pytest.raises(symmem.ShapeError, match=r"s = 4096 is outside \[2, 128\]"):
      method({"b": 1, "s": 4096})
    with pytest.raises(ValueError, match="s missing"):
      method({"b": 1})
  # A budget as a size string, as analyze() and memory_curves() take it.
  assert analysis.choose_round({"b": 1, "s": 8}, "1GiB") == analysis.choose_round(
      {"b": 1, "s": 8}, 2**30)
