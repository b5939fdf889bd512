"""jax_symmem: symbolic-shape memory optimization for dynamic-shape training in JAX.

Trace a training step once with symbolic dims, know every value's size as an
exact polynomial over them, and compare sizes exactly:

    import jax_symmem as symmem
    traced = symmem.trace(step, params, tokens, mask,
                          polymorphic_shapes=(None, "b, s", "b, s"),
                          constraints=("s <= 4096", "b <= 64"))
    graph = symmem.shape_graph(traced)
    graph.bytes(value_id)                 # an exact Poly over b, s
    symmem.symbolic.compare("11008*b*s", "32*b*s^2", constraints=("s <= 4096",))
"""

from jax_symmem import symbolic
from jax_symmem._src.errors import ConstraintError
from jax_symmem._src.errors import ShapeError
from jax_symmem._src.errors import ShapeSpecError
from jax_symmem._src.errors import SymmemError
from jax_symmem._src.errors import TracingError
from jax_symmem._src.poly import Poly
from jax_symmem._src.report import shape_report
from jax_symmem._src.shape_graph import Relation
from jax_symmem._src.shape_graph import ShapeGraph
from jax_symmem._src.shape_graph import ValueInfo
from jax_symmem._src.tracing import Program
from jax_symmem._src.tracing import TracedProgram
from jax_symmem._src.tracing import trace


def shape_graph(traced: TracedProgram) -> ShapeGraph:
  """The symbolic shape graph of a traced program."""
  return ShapeGraph(traced)


__version__ = "0.1.0"

__all__ = [
    "ConstraintError", "Poly", "Program", "Relation", "ShapeError", "ShapeGraph",
    "ShapeSpecError", "SymmemError", "TracedProgram", "TracingError", "ValueInfo",
    "shape_graph", "shape_report", "symbolic", "trace",
]
