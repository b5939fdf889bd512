"""Plans that survive a restart: stored decisions replay to the same rounds, and
anything stale, foreign or damaged is ignored with a warning and planned again."""

import json
import logging as py_logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import jax_symmem
from jax_symmem._src import analysis as analysis_lib
from jax_symmem._src import body_remat
from jax_symmem._src import loop_remat
from jax_symmem._src import plan_cache
from jax_symmem._src import progress
from jax_symmem._src import remat
from jax_symmem._src import tracing
from jax_symmem._src import variants
from jax_symmem._src.parse import parse_polynomial
from jax_symmem._src.poly import ZERO, Poly
from jax_symmem.examples import llama
from jax_symmem.examples import transformer

CFG = transformer.Config(vocab=61, d_model=32, n_heads=2, d_ff=64, n_layers=2)
CONSTRAINTS = ("s >= 2", "b <= 4", "s <= 128")
DIMS = ({"b": 1, "s": 2}, {"b": 2, "s": 37}, {"b": 4, "s": 128})
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mlp_step(width):
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)
  return jax.value_and_grad(loss)


def _mlp_args(width=16, layers=3):
  ws = tuple(jax.ShapeDtypeStruct((width, width), jnp.float32) for _ in range(layers))
  return ws, jax.ShapeDtypeStruct((2, 8, width), jnp.float32)


def _analyze_mlp(cache_dir, width=16, constraints=("b <= 8", "s <= 512"), budget=None):
  return analysis_lib.analyze_function(
      _mlp_step(width), *_mlp_args(width), polymorphic_shapes=(None, "b, s, _"),
      constraints=constraints, memory_budget=budget, plan_cache_dir=cache_dir)


def _analyze_transformer(cache_dir):
  # Planned from the arguments' shapes: nothing here runs the step.
  return analysis_lib.analyze_function(
      transformer.make_train_step(CFG), *jax.eval_shape(lambda: transformer.example_args(CFG, 2, 8)),
      polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS,
      plan_cache_dir=cache_dir)


def _files(d):
  return sorted(f for f in os.listdir(d) if f.endswith(".json"))


def _item_key(r):
  if isinstance(r, body_remat.BodyEviction):
    return ("body", r.node, str(r.trips), _item_key(r.item))
  if isinstance(r, loop_remat.LoopEviction):
    return ("loop", r.forward, r.output, r.value, str(r.saved), str(r.cost))
  return ("region", r.value, r.consumer, r.nodes, r.anchors, str(r.saved), str(r.cost))


def _assert_same_plan(a, b, dims=DIMS):
  assert b.schedule.order == a.schedule.order
  assert dict(b.schedule.candidates) == dict(a.schedule.candidates)
  assert dict(b.remat_stats) == dict(a.remat_stats)
  assert b.stats == a.stats
  assert len(b.rounds) == len(a.rounds)
  for ra, rb in zip(a.rounds, b.rounds):
    assert [_item_key(r) for r in rb.regions] == [_item_key(r) for r in ra.regions]
    assert rb.order == ra.order
    assert rb.program.max_id() == ra.program.max_id()
  for d in dims:
    for k in range(len(a.rounds)):
      assert b.round_peak(k, d) == a.round_peak(k, d)
      assert b.round_order(k, d) == a.round_order(k, d)


# --- plain data ------------------------------------------------------------------------


_b, _s = Poly.var("b"), Poly.var("s")
POLYS = (ZERO, Poly.const(7), _b * _s, parse_polynomial("3*b^2*s - 5*s + 2"),
         _b * _s.floordiv(128), 4 * _s.max(2 * _b) * _s.mod(8) + _b.min(3) - 1,
         (_s.floordiv(_b.max(2)) + 1) ** 2)


@pytest.mark.parametrize("p", POLYS, ids=str)
def test_polynomials_round_trip_through_json(p):
  data = json.loads(json.dumps(plan_cache.poly_to_json(p)))
  q = plan_cache.poly_from_json(data)
  assert q == p and hash(q) == hash(p) and str(q) == str(p)
  env = {"b": 3, "s": 300}
  assert q.evaluate(env) == p.evaluate(env)


# --- miss, hit, invalidation --------------------------------------------------------------


def test_miss_then_hit_replays_identical_rounds(tmp_path):
  cold, warm = _analyze_transformer(str(tmp_path)), _analyze_transformer(str(tmp_path))
  assert cold.origin == "planned" and len(cold.rounds) > 1
  (name,) = _files(tmp_path)
  assert warm.origin == os.path.join(str(tmp_path), name)
  assert any(isinstance(r, remat.Region) for rnd in warm.rounds for r in rnd.regions)
  _assert_same_plan(cold, warm)
  assert warm.plan == cold.plan
  for a in (cold, warm):   # the time split that experiments/bench_plan_cache.py reports
    assert set(a.seconds) == {"trace", "plan"} and all(t > 0 for t in a.seconds.values())


def test_the_file_is_plain_json_with_a_format_version(tmp_path):
  _analyze_mlp(str(tmp_path))
  (name,) = _files(tmp_path)
  data = json.loads((tmp_path / name).read_text())
  assert data["format"] == plan_cache.FORMAT
  assert data["format_version"] == plan_cache.FORMAT_VERSION
  assert data["versions"]["jax"] == jax.__version__


def test_the_environment_variable_turns_the_cache_on(tmp_path, monkeypatch):
  monkeypatch.setenv(plan_cache.ENV_VAR, str(tmp_path))
  assert _analyze_mlp(None).origin == "planned"
  assert _analyze_mlp(None).origin != "planned"
  monkeypatch.delenv(plan_cache.ENV_VAR)
  assert _analyze_mlp(None).origin == "planned"   # off: never reads the directory
  monkeypatch.setenv(plan_cache.ENV_VAR, "")
  assert plan_cache.directory(None) is None and plan_cache.directory("") is None
  assert plan_cache.directory(tmp_path) == str(tmp_path)


def test_a_changed_model_constraint_budget_or_version_is_planned_again(tmp_path, monkeypatch):
  d = str(tmp_path)
  assert _analyze_mlp(d).origin == "planned"
  assert _analyze_mlp(d).origin != "planned"
  assert _analyze_mlp(d, width=24).origin == "planned"                          # model
  assert _analyze_mlp(d, constraints=("b <= 8", "s <= 1024")).origin == "planned"  # constraints
  assert _analyze_mlp(d, budget=2**20).origin == "planned"                      # budget
  assert len(_files(d)) == 4
  monkeypatch.setattr(jax_symmem, "__version__", jax_symmem.__version__ + ".post1")
  assert _analyze_mlp(d).origin == "planned"                                    # version
  assert _analyze_mlp(d).origin != "planned"
  monkeypatch.setattr(jax, "__version__", jax.__version__ + ".dev0")
  assert _analyze_mlp(d).origin == "planned"
  assert len(_files(d)) == 6


def test_argument_divisors_are_part_of_the_key():
  jaxprs = [jax.make_jaxpr(lambda x: x * 2)(1.0)]
  keys = {plan_cache.fingerprint(jaxprs, ("b <= 8",), None, divisors)
          for divisors in (None, [[1, 1]], [[2, 1]])}
  assert len(keys) == 3


@pytest.mark.parametrize("switch", ["LAYER_GROUPS", "REVIVE_TRIGGERS", "DROP_STALE_ROUNDS"])
def test_the_planners_switches_are_part_of_the_key(monkeypatch, switch):
  from jax_symmem._src import remat
  jaxprs = [jax.make_jaxpr(lambda x: x * 2)(1.0)]
  monkeypatch.setattr(remat, switch, False)
  off = plan_cache.fingerprint(jaxprs, ("b <= 8",), None, None)
  monkeypatch.setattr(remat, switch, True)
  assert plan_cache.fingerprint(jaxprs, ("b <= 8",), None, None) != off


# --- damaged files -------------------------------------------------------------------------


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno >= py_logging.WARNING
          and "plan cache" in r.getMessage()]


def _reseal(data):
  """`data` with a checksum that matches it again (damage the checksum cannot see)."""
  return dict(data, checksum=plan_cache._checksum(data))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "other_format_version",
                                    "foreign_fingerprint", "bad_ids", "bad_poly",
                                    "bad_ids_resealed", "one_changed_digit"])
def test_a_damaged_file_is_ignored_with_a_warning_and_replanned(tmp_path, caplog, damage):
  d = str(tmp_path)
  first = _analyze_mlp(d)
  (name,) = _files(d)
  path = tmp_path / name
  text = path.read_text()
  data = json.loads(text)
  if damage == "truncate":
    path.write_text(text[: len(text) // 2])
  elif damage == "garbage":
    path.write_bytes(b"\x00\xff garbage \x89PNG")
  elif damage == "empty":
    path.write_text("")
  elif damage == "other_format_version":
    data["format_version"] += 1
    path.write_text(json.dumps(data))
  elif damage == "foreign_fingerprint":
    data["fingerprint"] = "0" * 64
    path.write_text(json.dumps(data))
  elif damage == "bad_ids":   # parses, but names values the trace does not have
    data["rounds"] = [[{**item, "value": 10**6, "consumer": 10**6} for item in items]
                      for items in data["rounds"]] or [[{
                          "kind": "region", "value": 10**6, "consumer": 10**6, "nodes": [],
                          "anchors": [], "saved": [], "cost": [], "source": ""}]]
    data["schedule"]["order"] = data["schedule"]["order"][::-1]
    path.write_text(json.dumps(data))
  elif damage == "bad_ids_resealed":   # the checksum matches: the schedule check catches it
    data["schedule"]["order"] = data["schedule"]["order"][::-1]
    path.write_text(json.dumps(_reseal(data)))
  elif damage == "one_changed_digit":   # still a well-formed plan: only the checksum sees it
    data["remat_stats"] = {k: v + 1 for k, v in data["remat_stats"].items()}
    path.write_text(json.dumps(data))
  elif damage == "bad_poly":
    data["rounds"] = [[{"kind": "region", "value": 0, "consumer": 0, "nodes": [],
                        "anchors": [], "saved": [["x", []]], "cost": [], "source": ""}]]
    path.write_text(json.dumps(data))
  caplog.set_level(py_logging.INFO)
  again = _analyze_mlp(d)
  assert again.origin == "planned"
  assert _warnings(caplog), caplog.text
  _assert_same_plan(first, again, DIMS[:1])
  # The replan rewrote a good file: the next analysis loads it.
  assert _analyze_mlp(d).origin == str(path)


def test_rounds_are_rebuilt_only_when_read(tmp_path):
  cold = _analyze_transformer(str(tmp_path))
  warm = _analyze_transformer(str(tmp_path))
  assert warm.origin != "planned" and warm.rounds.built == 1   # round 0 only, so far
  assert warm.round_peak(0, DIMS[0]) == cold.round_peak(0, DIMS[0])
  # What a call without a budget asks (the step as written), and what compiling round 0 asks.
  assert warm.best_round(DIMS[0], None) == (0, True) and warm.as_written_round == 0
  variants.round_function(warm, 0, DIMS[0])
  assert warm.rounds.built == 1
  last = len(cold.rounds) - 1
  assert warm.round_peak(last, DIMS[-1]) == cold.round_peak(last, DIMS[-1])
  assert warm.rounds.built == len(warm.rounds)   # round k is built on round k - 1
  _assert_same_plan(cold, warm)


def test_a_sealed_round_that_does_not_apply_raises_naming_the_file(tmp_path):
  _analyze_transformer(str(tmp_path))
  (name,) = _files(tmp_path)
  path = tmp_path / name
  data = json.loads(path.read_text())
  assert data["rounds"] and data["rounds"][0]
  data["rounds"][0][0] = {**data["rounds"][0][0], "kind": "region", "value": 10**6,
                          "consumer": 10**6, "nodes": [10**6], "anchors": []}
  path.write_text(json.dumps(_reseal(data)))   # only a bug could write this; no hash sees it
  warm = _analyze_transformer(str(tmp_path))
  assert warm.origin == str(path)
  with pytest.raises(remat.ReplayError, match=name):
    warm.rounds[1]


# --- the program's text in the key -----------------------------------------------------------


def _rich_step(scale=2.0, axis=-1, length=3, dtype=jnp.float32):
  """A step with every kind of sub-program a key must see through: a jit body used
  twice, custom_jvp (relu), custom_vjp, a checkpoint with a policy, scan, cond,
  while, literals."""
  @jax.custom_vjp
  def clip_grad(x):
    return x
  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

  @jax.jit
  def layer(w, x):
    return jax.nn.relu(x @ w) * scale

  @jax.checkpoint
  def block(w, x):
    return clip_grad(layer(w, layer(w, x)))

  def loss(w, x):
    w, x = w.astype(dtype), x.astype(dtype)
    def body(h, _):
      return block(w, h), jnp.sum(h, axis=axis)
    h, sums = jax.lax.scan(body, x, None, length=length)
    h = jax.lax.cond(jnp.sum(sums) > 0, lambda h: h * 3, lambda h: h - 1, h)
    n = jax.lax.while_loop(lambda c: c < jnp.size(h) % 5, lambda c: c + 1, 0)
    h = h * n.astype(h.dtype)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return jax.value_and_grad(loss)


def _rich_key(**variant):
  w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  x = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)
  traced = tracing.trace(_rich_step(**variant), w, x, polymorphic_shapes=(None, "b, s, _"),
                         constraints=("b <= 8",))
  return plan_cache.fingerprint([traced.closed_jaxpr], ("b <= 8",), None, None)


def test_the_key_changes_with_any_detail_of_the_program():
  keys = [_rich_key(), _rich_key(scale=3.0), _rich_key(axis=0), _rich_key(length=4),
          _rich_key(dtype=jnp.bfloat16)]
  assert len(set(keys)) == len(keys)
  assert _rich_key() == keys[0]   # traced again: new objects, the same text


def _set_param_text():
  """The text of a jaxpr whose equation has a set-valued param (string sets iterate in
  an order that depends on the hash seed)."""
  from jax.extend.core import Primitive
  tag = Primitive("tagged")
  tag.def_abstract_eval(lambda x, **_: x)
  jaxpr = jax.make_jaxpr(lambda x: tag.bind(x, names=frozenset("abcdefgh")))(1.0)
  return tracing.program_text(jaxpr)


# Three processes: slow; the restart test below reuses a plan across two hash seeds fast.
@pytest.mark.slow
def test_the_key_is_the_same_in_another_process():
  child = ("import sys; from tests import test_plan_cache as t; "
           "sys.stdout.write('key=' + t._rich_key() + ' ' + t._set_param_text())")
  keys = set()
  for seed in (1, 2, 3):
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED=str(seed), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", child], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    keys.add(out.stdout.rpartition("key=")[2])
  assert keys == {_rich_key() + " " + _set_param_text()}


# --- restart --------------------------------------------------------------------------------


_CHILD = textwrap.dedent("""
    import json, sys, time
    from tests import test_plan_cache as t
    start = time.perf_counter()
    a = t._analyze_mlp(None)
    took = time.perf_counter() - start
    print(json.dumps({"origin": a.origin, "seconds": took,
                      "peaks": [a.round_peak(k, {"b": 3, "s": 100}) for k in range(len(a.rounds))],
                      "orders": [list(r.order) for r in a.rounds]}))
""")


def _child(cache_dir, seed):
  env = dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED=str(seed), JAX_PLATFORMS="cpu")
  env[plan_cache.ENV_VAR] = cache_dir
  out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_restarted_process_reuses_the_plan(tmp_path):
  cold = _child(str(tmp_path), seed=1)
  warm = _child(str(tmp_path), seed=2)   # another hash seed: nothing hash-dependent is stored
  assert cold["origin"] == "planned"
  assert warm["origin"].startswith(str(tmp_path))
  assert warm["peaks"] == cold["peaks"] and warm["orders"] == cold["orders"]
  print(f"analysis in a fresh process: cold {cold['seconds']:.2f} s, "
        f"from the plan cache {warm['seconds']:.2f} s")


# --- loops --------------------------------------------------------------------------------


def _llama_cold_and_warm(tmp_path, remat_policy=None, scan_layers=False):
  """A tiny Llama step analysed twice with one cache directory: planned, then loaded."""
  cfg = llama.PRESETS["tiny"]
  state = jax.eval_shape(lambda: llama.init_state(cfg, scan_layers=scan_layers))
  fn = llama.train_step_fn(llama.Llama(cfg, remat_policy, scan_layers))
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  mask = jax.ShapeDtypeStruct((2, 16), jnp.float32)
  run = lambda: analysis_lib.analyze_function(
      fn, state, tokens, mask, polymorphic_shapes=(None, "b, s", "b, s"),
      constraints=llama.step_constraints(256, 16), plan_cache_dir=str(tmp_path))
  cold, warm = run(), run()
  assert cold.origin == "planned" and warm.origin != "planned"
  return cold, warm


# A scanned Llama planned and replayed: slow; the transformer round trips cover replay fast.
@pytest.mark.slow
def test_a_scanned_llama_round_trips_with_its_loop_evictions(tmp_path):
  cold, warm = _llama_cold_and_warm(tmp_path, scan_layers=True)
  assert any(isinstance(r, loop_remat.LoopEviction) for rnd in warm.rounds for r in rnd.regions)
  _assert_same_plan(cold, warm, ({"b": 1, "s": 2}, {"b": 4, "s": 100}, {"b": 16, "s": 256}))
  for ra, rb in zip(cold.rounds, warm.rounds):
    assert {k: s.evicted for k, s in rb.loops.items()} == {k: s.evicted for k, s in ra.loops.items()}


def test_a_gated_step_round_trips_with_its_cond_evictions(tmp_path):
  # Stochastic depth under lax.cond: rounds that rewrite forward/backward cond pairs.
  def loss(ws, x, key):
    for w, k in zip(ws, jax.random.split(key, len(ws))):
      x = jax.lax.cond(jax.random.bernoulli(k, 0.7), lambda h, w=w: h + jnp.tanh(h @ w),
                       lambda h: h, x)
    return jnp.mean(x ** 2)
  ws = [jnp.eye(8) / (2 + i) for i in range(2)]
  run = lambda: analysis_lib.analyze_function(
      jax.value_and_grad(loss), ws, jnp.ones((2, 4, 8)), jax.random.key(0),
      polymorphic_shapes=(None, "b, s, _", None), constraints=("b <= 8", "s <= 64"),
      plan_cache_dir=str(tmp_path))
  cold, warm = run(), run()
  assert cold.origin == "planned" and warm.origin != "planned"
  assert any(isinstance(r, loop_remat.LoopEviction) for rnd in warm.rounds for r in rnd.regions)
  _assert_same_plan(cold, warm, ({"b": 1, "s": 2}, {"b": 8, "s": 64}))
  for ra, rb in zip(cold.rounds, warm.rounds):
    assert {k: s.evicted for k, s in rb.loops.items()} == {k: s.evicted for k, s in ra.loops.items()}


# --- progress ---------------------------------------------------------------------------------


def test_long_planning_reports_progress_at_info(tmp_path, caplog, monkeypatch):
  monkeypatch.setattr(progress, "AFTER_S", 0.0)
  monkeypatch.setattr(progress, "EVERY_S", 0.0)
  caplog.set_level(py_logging.INFO)
  _analyze_mlp(None)
  text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == py_logging.INFO)
  for stage in ("tracing", "shape graph", "schedule candidates at shape of interest 1 of ",
                "remat round 1 of at most 24, peak", "planned loss in"):
    assert stage in text, text


def test_progress_is_rate_limited(caplog):
  caplog.set_level(py_logging.INFO)
  with progress.planning("f", after=0.0, every=3600.0) as p:
    for k in range(100):
      progress.update("remat round", k + 1, 100)
  assert p.logged == 1
  with progress.planning("g", after=3600.0) as p:
    progress.update("tracing")
  assert p.logged == 0
  progress.update("outside a block")   # no-op


# --- symmem.jit, checkpointed steps ----------------------------------------------------------


def test_symmem_jit_stores_and_reuses_plans(tmp_path):
  ws = tuple(jnp.eye(16, dtype=jnp.float32) * 0.5 for _ in range(3))
  x = jnp.ones((2, 8, 16), jnp.float32)
  make = lambda: jax_symmem.jit(_mlp_step(16), polymorphic_shapes=(None, "b, s, _"),
                                constraints=("b <= 8", "s <= 512"), memory_budget=2**30,
                                plan_cache_dir=str(tmp_path))
  first, second = make(), make()
  assert first.analyze(ws, x).origin == "planned"
  assert second.analyze(ws, x).origin != "planned"
  loss1, _ = first(ws, x)
  loss2, _ = second(ws, x)
  assert float(loss1) == float(loss2)


def test_without_a_budget_the_plan_is_made_and_stored_when_first_read(tmp_path, caplog):
  # symmem.jit without a budget runs each shape as written, which reads no round: its
  # first call plans nothing. Reading the plan makes it (timed, logged, stored), the
  # same plan as one made at once; a checkpointed step is planned at once (its round as
  # written is numbered after the planner's).
  ws = tuple(jnp.eye(16, dtype=jnp.float32) * 0.5 for _ in range(3))
  x = jnp.ones((2, 8, 16), jnp.float32)
  make = lambda fn: jax_symmem.jit(fn, polymorphic_shapes=(None, "b, s, _"),
                                   constraints=("b <= 8", "s <= 512"),
                                   plan_cache_dir=str(tmp_path))
  step = make(_mlp_step(16))
  out = step(ws, x)
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(
      lambda a, b: bool(jnp.array_equal(a, b)), out, jax.jit(_mlp_step(16))(ws, x)))
  lazy = step.analyze(ws, x)
  assert not lazy.planning.done and not _files(tmp_path)
  before = lazy.seconds["plan"]
  with caplog.at_level(py_logging.INFO):
    assert len(lazy.rounds) > 1
  assert lazy.planning.done and len(_files(tmp_path)) == 1 and lazy.seconds["plan"] > before
  assert any("on first use" in r.getMessage() for r in caplog.records)
  eager = _analyze_mlp(None)
  assert eager.planning.done and eager.origin == "planned"
  _assert_same_plan(eager, lazy, ({"b": 1, "s": 1}, {"b": 8, "s": 512}))
  assert make(_mlp_step(16)).analyze(ws, x).origin != "planned"   # the stored plan replays

  def loss(ws, x):
    for w in ws:
      x = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))(x, w)
    return jnp.mean(x ** 2)
  annotated = make(jax.value_and_grad(loss))
  annotated(ws, x)
  assert annotated.analyze(ws, x).planning.done and annotated.last_call["round"] > 0


# Two traces of a checkpointed Llama: slow; the scanned round trip covers the replay fast.
@pytest.mark.slow
def test_a_checkpointed_step_round_trips_with_its_round_as_written(tmp_path):
  cold, warm = _llama_cold_and_warm(tmp_path, remat_policy="layer")
  assert cold.rounds[-1].as_written and warm.rounds[-1].as_written
  _assert_same_plan(cold, warm, ({"b": 1, "s": 2}, {"b": 16, "s": 256}))
