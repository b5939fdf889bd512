"""Exceptions raised by jax_symmem; each message says what went wrong and what to do."""


class SymmemError(Exception):
  """Base class for jax_symmem errors."""


class ConstraintError(SymmemError, ValueError):
  """Constraints that cannot be parsed, or that contradict each other."""


class ShapeSpecError(SymmemError, ValueError):
  """A polymorphic shape spec that does not match the arguments."""


class TracingError(SymmemError):
  """The function cannot be traced with symbolic dimensions."""


class ShapeError(SymmemError, ValueError):
  """Concrete shapes that violate the declared constraints."""


class BudgetError(SymmemError, ValueError):
  """A memory budget below the smallest achievable peak."""
