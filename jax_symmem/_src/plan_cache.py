"""Plans that survive a restart: the planner's decisions on disk, as plain JSON.

Planning a step (schedule candidates, remat rounds) costs seconds to minutes;
tracing it costs well under a second and is deterministic. So what is stored is
the *decisions*, never jaxprs or `Analysis` objects: the schedule (its main
order and every candidate order, which `Schedule.order_for` picks from per
shape), each round's chosen items (flat `remat.Region`s,
`loop_remat.LoopEviction`s and `body_remat.BodyEviction`s) and the statistics. Loading re-traces the step and
replays the rounds by applying the same items (`remat.ReplayedRounds`, the code
that planning itself applies rounds with), skipping every search.

A file is keyed by a fingerprint of everything a plan depends on: the closed
jaxpr's text (symbolic shapes included), the constraints, the budget, the
argument divisors (sharding), the planner's settings and the jax / jaxlib /
jax_symmem versions. A changed model or version gets another key, so a stale
plan is never found. A file that does not parse, has another format version,
fingerprint or checksum, or whose schedule is not an order of the traced program
is ignored with a warning and the step is planned again. Rounds are rebuilt from
the stored items only when a shape first needs them (`remat.ReplayedRounds`), so
a restart costs the trace, the key and round 0; a round that still does not
replay (only a bug could make one, given the checksum) raises `remat.ReplayError`
naming the file.

Polynomials are stored as plain data (monomial lists), never pickled: a `Poly`
caches its hash, which differs between processes (PYTHONHASHSEED).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Mapping, Sequence

from absl import logging

from jax_symmem._src import body_remat
from jax_symmem._src import loop_remat
from jax_symmem._src import remat
from jax_symmem._src import schedule as schedule_lib
from jax_symmem._src import tracing
from jax_symmem._src.poly import OpAtom, Poly, Var

FORMAT = "jax_symmem plan"
FORMAT_VERSION = 20   # 20: comparisons decide divisions by several constants (remainder cases), a recomputed node's clone marked once; 19: layer inputs offered alone once no layer is left to evict whole; 18: ops of library jits named by the caller's layer, a layer's input made outside any layer kept and read where live; 17: dead top-level nodes dropped from the traced program; 16: bounds that general inequalities imply count for the shapes planned at; 15: rounds also planned at the corners that general inequalities cut (b*s <= n); 14: rounds after the last that lowered the peak where planned dropped; 13: a fence whose trigger copy only dead code reads takes a new trigger; 12: a later layer's input not evicted alone; 11: layer groups per call of a module run once per layer, and from repeated code where no scope names a layer; 10: loop constants computed in rewritten scan bodies (rounds price them so); 9: a random draw's counters in the model (its working set); 8: dropout masks regenerated from their keys (functional random ops recomputable); 7: rounds also planned at smaller shapes; 6: rounds spaced by memory, cond results counted once; 5: cond pairs (plans before had none); 4: regions inside scan bodies; 3: a checksum; 2: regions bounded by FLOPs, one fence per consumer
ENV_VAR = "JAX_SYMMEM_PLAN_CACHE"


@dataclasses.dataclass(frozen=True)
class Decisions:
  """What planning decided: enough to rebuild an `Analysis` from a fresh trace."""
  schedule: schedule_lib.Schedule
  rounds: tuple[tuple[remat.Region | loop_remat.LoopEviction, ...], ...]   # rounds 1..K
  remat_stats: Mapping[str, int]
  as_written_order: tuple[int, ...] | None = None   # the annotated step's schedule


def directory(explicit: str | os.PathLike | None = None) -> str | None:
  """The cache directory: `explicit`, else $JAX_SYMMEM_PLAN_CACHE, else None (off);
  an empty path is off too."""
  d = os.fspath(explicit) if explicit is not None else os.environ.get(ENV_VAR, "")
  return d or None


def versions() -> dict[str, str]:
  import jax
  import jaxlib
  import jax_symmem
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "jax_symmem": jax_symmem.__version__}


def fingerprint(programs: Sequence[Any], constraints: Sequence[str], memory_budget: int | None,
                argument_divisors, settings: Mapping[str, Any] | None = None) -> str:
  """A hex key over the traced closed jaxprs (`tracing.program_text`: their equations
  and symbolic shapes) and everything else a plan depends on."""
  h = hashlib.sha256()
  header = {"format": [FORMAT, FORMAT_VERSION], "versions": versions(),
            "constraints": list(constraints), "memory_budget": memory_budget,
            "argument_divisors": None if argument_divisors is None
            else [list(map(int, d)) for d in argument_divisors],
            "settings": dict(settings or {})}
  if remat.LAYER_GROUPS:   # layers evicted whole: other plans (keys without them unchanged)
    header["settings"]["remat_candidates"] = "layers"
  if not remat.REVIVE_TRIGGERS:
    header["settings"]["fence_triggers"] = "as chosen"
  if not remat.DROP_STALE_ROUNDS:
    header["settings"]["stale_rounds"] = "kept"
  h.update(json.dumps(header, sort_keys=True).encode())
  for p in programs:
    h.update(b"\0jaxpr\0")
    h.update(tracing.program_text(p).encode())
  return h.hexdigest()


# --- encoding ---------------------------------------------------------------------------


def poly_to_json(p: Poly) -> list:
  """[[coefficient, [[atom, exponent], ...]], ...]; an atom is a variable name or
  [op, [operand polys]]."""
  return [[c, [[_atom_to_json(a), e] for a, e in m]] for m, c in p.terms]


def _atom_to_json(a) -> Any:
  if isinstance(a, Var):
    return a.name
  return [a.op, [poly_to_json(o) for o in a.operands]]


def poly_from_json(data) -> Poly:
  coeffs = {}
  for c, mono in data:
    if not isinstance(c, int) or isinstance(c, bool):
      raise ValueError(f"bad coefficient {c!r}")
    m = tuple(sorted(((_atom_from_json(a), int(e)) for a, e in mono),
                     key=lambda ae: ae[0].sort_key))
    coeffs[m] = coeffs.get(m, 0) + c
  return Poly.from_dict(coeffs)


def _atom_from_json(data):
  if isinstance(data, str):
    return Var(data)
  op, operands = data
  return OpAtom(op, tuple(poly_from_json(o) for o in operands))


def _item_to_json(r) -> dict:
  if isinstance(r, body_remat.BodyEviction):
    return {"kind": "body", "node": r.node, "trips": poly_to_json(r.trips),
            "item": _item_to_json(r.item)}
  if isinstance(r, loop_remat.LoopEviction):
    return {"kind": "loop", "forward": r.forward, "output": r.output, "value": r.value,
            "saved": poly_to_json(r.saved), "cost": poly_to_json(r.cost), "source": r.source}
  return {"kind": "region", "value": r.value, "consumer": r.consumer, "nodes": list(r.nodes),
          "anchors": list(r.anchors), "saved": poly_to_json(r.saved),
          "cost": poly_to_json(r.cost), "source": r.source}


def _item_from_json(d: Mapping):
  ints = lambda xs: tuple(int(x) for x in xs)
  if d["kind"] == "loop":
    return loop_remat.LoopEviction(int(d["forward"]), int(d["output"]), int(d["value"]),
                                   poly_from_json(d["saved"]), poly_from_json(d["cost"]),
                                   str(d["source"]))
  if d["kind"] == "body":
    item = _item_from_json(d["item"])
    if isinstance(item, body_remat.BodyEviction):
      raise ValueError("a scan body's eviction must be a region or a scan residual")
    return body_remat.BodyEviction(int(d["node"]), item, poly_from_json(d["trips"]))
  if d["kind"] == "region":
    return remat.Region(int(d["value"]), int(d["consumer"]), ints(d["nodes"]),
                        ints(d["anchors"]), poly_from_json(d["saved"]),
                        poly_from_json(d["cost"]), str(d["source"]))
  raise ValueError(f"unknown item kind {d['kind']!r}")


def _checksum(data: Mapping) -> str:
  """sha256 of everything in a plan file but the checksum itself."""
  body = {k: v for k, v in data.items() if k != "checksum"}
  return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                        ).hexdigest()


def to_json(decisions: Decisions, key: str) -> dict:
  data = _payload(decisions, key)
  return dict(data, checksum=_checksum(data))


def _payload(decisions: Decisions, key: str) -> dict:
  s = decisions.schedule
  return {
      "format": FORMAT, "format_version": FORMAT_VERSION, "fingerprint": key,
      "versions": versions(),
      "schedule": {"order": list(s.order), "mode": s.mode, "stats": dict(s.stats),
                   "source": s.source,
                   "candidates": {k: list(v) for k, v in s.candidates.items()}},
      "rounds": [[_item_to_json(r) for r in items] for items in decisions.rounds],
      "remat_stats": dict(decisions.remat_stats),
      "as_written_order": None if decisions.as_written_order is None
      else list(decisions.as_written_order),
  }


def from_json(data: Mapping, key: str) -> Decisions:
  """The decisions in `data`; ValueError if it is not a plan of this format for `key`."""
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise ValueError("not a jax_symmem plan file")
  if data.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"format version {data.get('format_version')!r}, "
                     f"this jax_symmem reads {FORMAT_VERSION}")
  if data.get("fingerprint") != key:
    raise ValueError("fingerprint mismatch (a plan for another program or setting)")
  # Rounds are replayed only when a shape needs them (remat.ReplayedRounds), so
  # damage must show here: any changed byte of the decisions fails the checksum.
  if data.get("checksum") != _checksum(data):
    raise ValueError("checksum mismatch (the file was changed after it was written)")
  ints = lambda xs: tuple(int(x) for x in xs)
  s = data["schedule"]
  sched = schedule_lib.Schedule(
      ints(s["order"]), str(s["mode"]), {str(k): int(v) for k, v in s["stats"].items()},
      str(s["source"]), {str(k): ints(v) for k, v in s["candidates"].items()})
  rounds = tuple(tuple(_item_from_json(d) for d in items) for items in data["rounds"])
  written = data["as_written_order"]
  return Decisions(sched, rounds, {str(k): int(v) for k, v in data["remat_stats"].items()},
                   None if written is None else ints(written))


# --- files ------------------------------------------------------------------------------


def path_for(cache_dir: str, key: str) -> str:
  return os.path.join(cache_dir, f"plan-{key[:32]}.json")


def load(cache_dir: str, key: str) -> Decisions | None:
  """The stored decisions for `key`, or None (missing; unreadable files warn)."""
  path = path_for(cache_dir, key)
  try:
    with open(path, "rb") as f:
      text = f.read()
  except FileNotFoundError:
    return None
  except OSError as e:
    logging.warning("jax_symmem: cannot read plan cache file %s (%s); planning again", path, e)
    return None
  try:
    return from_json(json.loads(text), key)   # bytes: a decoding error is a ValueError
  except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
    logging.warning("jax_symmem: ignoring plan cache file %s (%s: %s); planning again",
                    path, type(e).__name__, e)
    return None


def save(cache_dir: str, key: str, decisions: Decisions) -> str | None:
  """Writes the decisions atomically (a reader never sees half a file); the path."""
  path = path_for(cache_dir, key)
  try:
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".plan-", suffix=".tmp")
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(to_json(decisions, key), f, separators=(",", ":"))
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise
    return path
  except OSError as e:   # a read-only or full disk costs a replan next time, nothing else
    logging.warning("jax_symmem: cannot write plan cache file %s (%s)", path, e)
    return None
