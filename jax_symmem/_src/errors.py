"""Exceptions raised by jax_symmem; each message says what went wrong and what to do."""


class SymmemError(Exception):
  """Base class for jax_symmem errors."""


class ConstraintError(SymmemError, ValueError):
  """Constraints that cannot be parsed, or that contradict each other."""


class InfeasibleConstraintsError(ConstraintError):
  """Constraints that no assignment of the dims satisfies (they contradict each other)."""


class ShapeSpecError(SymmemError, ValueError):
  """A polymorphic shape spec that does not match the arguments."""


class TracingError(SymmemError):
  """The function cannot be traced with symbolic dimensions."""


class ShapeError(SymmemError, ValueError):
  """Concrete shapes that violate the declared constraints."""


class BudgetError(SymmemError, ValueError):
  """A memory budget below XLA's figure for every variant the planner builds at a shape."""


class PlanningError(SymmemError):
  """The planner failed on a program it traced: a defect of jax_symmem, not of the call.
  `symmem.jit` falls back to `jax.jit` for that step (with a warning), as for an op the
  pipeline cannot handle."""

