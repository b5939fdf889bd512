"""jax_symmem: symbolic-shape memory optimization for dynamic-shape training in JAX.

Trace a training step once with symbolic dims, know every value's size as an
exact polynomial over them, compare sizes exactly, and run the step under a
memory budget with `symmem.jit`:

    import jax_symmem as symmem

    step = symmem.jit(train_step, polymorphic_shapes=(None, "b, s", "b, s"),
                      constraints=("s >= 2", "s <= 4096", "b <= 64"), memory_budget="8GiB")
    loss, params = step(params, tokens, mask)     # any (b, s) within the constraints

    traced = symmem.trace(train_step, params, tokens, mask,
                          polymorphic_shapes=(None, "b, s", "b, s"),
                          constraints=("s >= 2", "s <= 4096", "b <= 64"))
    graph = symmem.shape_graph(traced)
    graph.bytes(value_id)                 # an exact Poly over b, s
    symmem.symbolic.compare("11008*b*s", "32*b*s^2", constraints=("s <= 4096",))
"""

from jax_symmem import symbolic
from jax_symmem._src.analysis import Analysis
from jax_symmem._src.curves import MemoryCurves
from jax_symmem._src.curves import memory_curves
from jax_symmem._src.curves import sweep
from jax_symmem._src.errors import BudgetError
from jax_symmem._src.errors import ConstraintError
from jax_symmem._src.errors import InfeasibleConstraintsError
from jax_symmem._src.errors import PlanningError
from jax_symmem._src.errors import ShapeError
from jax_symmem._src.errors import ShapeSpecError
from jax_symmem._src.errors import SymmemError
from jax_symmem._src.errors import TracingError
from jax_symmem._src.poly import Poly
from jax_symmem._src.report import memory_report
from jax_symmem._src.report import shape_report
from jax_symmem._src.shape_graph import Relation
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.shape_graph import ValueInfo
from jax_symmem._src.ir import Program
from jax_symmem._src.tracing import TracedProgram
from jax_symmem._src.jit import SymmemFunction
from jax_symmem._src.jit import jit
from jax_symmem._src.nnx_jit import NnxFunction
from jax_symmem._src.nnx_jit import nnx_jit
from jax_symmem._src.tracing import trace


def shape_graph(traced: TracedProgram) -> ShapeGraph:
  """The symbolic shape graph of a traced program (`symmem.trace`'s result)."""
  if not isinstance(traced, TracedProgram):   # e.g. traced.specialize(...)'s Program
    raise TypeError(f"shape_graph takes a TracedProgram (symmem.trace(...)), got "
                    f"{type(traced).__name__}")
  return ShapeGraph(traced)


def analyze(fun, *args, polymorphic_shapes, constraints=(), memory_budget=None,
            in_shardings=None, plan_cache_dir=None) -> Analysis:
  """Traces `fun` once with symbolic dims and plans its memory for every allowed shape.

  Returns an `Analysis`: `peak_bytes(**dims)` (the optimized step as dispatched at
  those dims under `memory_budget`), `baseline_peak_bytes(**dims)` (trace order,
  no rematerialization), `static_peak_bytes(**dims)` (the same pipeline planned
  with exact shapes), `stats`, a printable `plan`, and `graph`. Figures are the
  jaxpr-level memory model's (see README: what the model measures), per device
  when `in_shardings` (as in `jax.jit`) or the arguments' own shardings split them.
  `plan_cache_dir` (default $JAX_SYMMEM_PLAN_CACHE) keeps the plan across processes.
  """
  from jax_symmem._src import analysis as analysis_lib
  from jax_symmem._src import sharding
  from jax_symmem._src.jit import resolve_budget
  return analysis_lib.analyze_function(
      fun, *args, polymorphic_shapes=polymorphic_shapes, constraints=constraints,
      memory_budget=resolve_budget(memory_budget),
      argument_divisors=sharding.argument_divisors(in_shardings, args),
      plan_cache_dir=plan_cache_dir)


__version__ = "0.1.0"

__all__ = [
    "Analysis", "BudgetError", "NnxFunction", "SymmemFunction", "analyze", "jit", "nnx_jit",
    "ConstraintError", "InfeasibleConstraintsError", "Poly", "Program", "Relation", "ShapeError", "ShapeGraph",
    "PlanningError", "ShapeSpecError", "SymmemError", "TracedProgram", "TracingError", "ValueInfo",
    "MemoryCurves", "memory_curves", "memory_report", "shape_graph", "shape_report", "sweep",
    "symbolic", "trace",
]
