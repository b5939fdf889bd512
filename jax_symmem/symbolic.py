"""Exact comparison of symbolic dimension expressions.

Sizes in a dynamic-shape program are polynomials over the dimension symbols
(with floordiv/mod/max/min), and memory decisions need to know which of two
sizes is larger. JAX's own `>=` on symbolic dims gives up on cases as plain as
`b*s >= s`; `compare` decides them exactly over the integers (every dimension
is >= 1, within the declared constraints):

    >>> from jax_symmem import symbolic
    >>> o = symbolic.compare("11008*b*s", "32*b*s^2", constraints=("s <= 4096", "b <= 64"))
    >>> o.kind, o.dim, o.breakpoints
    ('DEPENDS', 's', (344, 345))
    >>> print(o)
    DEPENDS: lhs > rhs for s in [1, 343]; lhs == rhs at s = 344; lhs < rhs for s in [345, 4096]
    >>> symbolic.compare("b*s", "s").kind
    'GE'
    >>> symbolic.compare("floordiv(s, 128)", "k", constraints=("s == 128*k",)).kind
    'EQ'

`Ordering.kind` is a `Kind` (a `str` enum: `o.kind == "GE"` holds): GE / LE / EQ
(proofs, never wrong), DEPENDS (with two witness assignments verified by exact
evaluation) or UNKNOWN (out of budget; never a claim). `is_feasible` /
`check_feasible` tell whether general inequality constraints can hold at all.
"""

from jax_symmem._src.compare import Kind
from jax_symmem._src.compare import Ordering
from jax_symmem._src.compare import Piece
from jax_symmem._src.compare import check_feasible
from jax_symmem._src.compare import compare
from jax_symmem._src.compare import compare_polys
from jax_symmem._src.compare import is_feasible
from jax_symmem._src.constraints import Constraints
from jax_symmem._src.constraints import parse_constraints
from jax_symmem._src.jax_dims import parse
from jax_symmem._src.poly import Poly

__all__ = [
    "Constraints", "Kind", "Ordering", "Piece", "Poly", "check_feasible", "compare",
    "compare_polys", "is_feasible", "parse", "parse_constraints",
]
