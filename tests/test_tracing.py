"""Tracing with symbolic dims: flattening, numerics, and clear errors on bad input."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_symmem as symmem
from jax_symmem._src import interpret
from jax_symmem._src import executor
from jax_symmem._src import tracing

F32 = jnp.float32


def _run(traced, *args):
  """Runs the program specialized to the arguments' dims, op by op."""
  program = traced.specialize(**traced.bind_dims(*args))
  out = interpret.run(program, jax.tree_util.tree_leaves(args))
  return jax.tree_util.tree_unflatten(traced.out_tree, out)


def test_call_primitives_are_inlined_and_numerics_match_jit():
  @jax.jit
  def inner(x):
    return jax.nn.relu(x) * 2.0   # relu is a custom_jvp

  def f(x, w):
    y = jax.checkpoint(lambda z: jnp.sin(z) @ w)(x)
    c, ys = jax.lax.scan(lambda c, row: (c + row.sum(), row * 2.0), 0.0, y)
    return inner(y).sum() + c + ys.mean()

  grad_f = jax.grad(f, argnums=(0, 1))
  x = np.random.RandomState(0).randn(5, 3).astype(np.float32)
  w = np.random.RandomState(1).randn(3, 3).astype(np.float32)
  traced = symmem.trace(grad_f, x, w, polymorphic_shapes=("n, d", "d, d"))
  names = {n.name for _, n in traced.program.walk()}
  assert not names & {"pjit", "jit", "remat2", "checkpoint", "custom_jvp_call", "closed_call"}
  assert "scan" in names
  got = _run(traced, x, w)
  want = jax.jit(grad_f)(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_call_nested_in_a_loop_body_specializes_without_falling_back():
  # nn.remat_scan's structure: a scan whose body is jax.checkpoint around an inner scan.
  # After AD the forward body holds a closed_call, which binds through get_bind_params
  # (before: KeyError 'subfuns' when specializing, and symmem.jit fell back to jax.jit).
  def loss(ws, x):
    def layer(x, w):
      return jnp.tanh(x @ w), None
    @jax.checkpoint
    def group(x, w_inner):
      return jax.lax.scan(layer, x, w_inner)[0], None
    return jnp.mean(jax.lax.scan(group, x, ws)[0] ** 2)

  def step(ws, x):
    l, g = jax.value_and_grad(loss)(ws, x)
    return l, ws - 0.1 * g

  # NumPy's generator: jax.random.normal of a 4-d shape alone took ~6 s to compile.
  ws = jnp.asarray(np.random.RandomState(1).randn(2, 2, 16, 16) * 0.3, F32)
  x = jnp.asarray(np.random.RandomState(0).randn(4, 8, 16), F32)
  traced = symmem.trace(step, ws, x, polymorphic_shapes=(None, "b, s, _"))
  names = {eqn.primitive.name for body in _raw_bodies(traced) for eqn in body.eqns}
  assert names & {"closed_call", "eval_jaxpr"}   # the case this test is about (jax 0.11's name)
  f = symmem.jit(step, polymorphic_shapes=(None, "b, s, _"), constraints=("s <= 64", "b <= 4"))
  for s in (8, 24):
    xs = jnp.asarray(np.random.RandomState(s).randn(4, s, 16), F32)
    for got, want in zip(f(ws, xs), jax.jit(step)(ws, xs)):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert f.cache_info()["fallback_calls"] == 0 and f.cache_info()["compiles"] == 2


def _raw_bodies(traced):
  """The jaxprs held in the params of the program's nodes, recursively."""
  out, stack = [], [p for _, n in traced.program.walk() for p in n.params.values()]
  while stack:
    p = stack.pop()
    jaxpr = getattr(p, "jaxpr", None)
    if isinstance(p, (list, tuple)):
      stack.extend(p)
    elif jaxpr is not None and hasattr(jaxpr, "eqns"):
      out.append(jaxpr)
      stack.extend(v for e in jaxpr.eqns for v in e.params.values())
  return out


def test_scan_counts_read_both_layouts_of_a_scans_params():
  # The scan's traced params (jax 0.10: num_consts / num_carry), and jax 0.11's layout,
  # where `ft_in` unpacks into the consts, the carries and the scanned inputs.
  w = jnp.ones((3, 3))
  def f(c, xs):
    return jax.lax.scan(lambda c, x: (c @ w + x, jnp.sin(c)), c, xs)
  jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3)))
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  n_consts = len(eqn.invars) - 2   # w (closed over), then the carry and the scanned input
  assert tracing.scan_counts(eqn.params) == (n_consts, 1)

  class Packed:   # jax 0.11's flat tree, as far as scan_counts reads it
    def __init__(self, *parts):
      self.parts = parts
    def unpack(self):
      return self.parts
  assert tracing.scan_counts({"ft_in": Packed((1, 2), (3,), (4, 5, 6))}) == (2, 1)


def test_an_arrays_shard_arrays_share_its_buffers():
  # device.live_bytes counts each buffer once by these (tests/shard_map_steps.py: views
  # of a sharded array's shards on four devices).
  x = jnp.ones((4, 3))
  (shard,) = tracing.shard_arrays(x)
  assert shard.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  assert shard.sharding.device_set == x.sharding.device_set


def test_the_jax_internals_jit_parity_reads():
  # symmem.jit keys its traces on jax's trace context and raises jax.jit's error for a nan
  # under jax_debug_nans (test_jit.py): both read JAX internals, checked here on each jax.
  outside = tracing.trace_context()
  hash(outside)
  with jax.numpy_rank_promotion("raise"):
    assert tracing.trace_context() != outside
  assert tracing.trace_context() == outside
  e = tracing.InternalFloatingPointError("jit(step)", "nan")
  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError, match=r"invalid value \(nan\) encountered in log"):
      tracing.raise_floating_point_error(e, lambda x: jnp.log(x), (jnp.array(-1.0),), {})


def test_trace_records_dims_constraints_and_trees():
  traced = symmem.trace(lambda d: {"y": d["x"] * 2}, {"x": jax.ShapeDtypeStruct((2, 3), F32)},
                        polymorphic_shapes=({"x": "b, s"},), constraints=("s <= 64",))
  assert traced.dims == ("b", "s")
  assert traced.constraints.bounds_map == {"b": (1, None), "s": (1, 64)}
  assert traced.out_tree == jax.tree_util.tree_structure({"y": 0})
  assert "b, s" in str(traced)


def test_rank_mismatch_names_the_argument():
  with pytest.raises(symmem.ShapeSpecError, match=r"args\[1\].*rank 1.*shape \(2, 3\)"):
    symmem.trace(lambda a, x: x, jnp.zeros(3), jnp.zeros((2, 3)), polymorphic_shapes=(None, "b"))


def test_wrong_pytree_prefix_is_a_spec_error():
  with pytest.raises(symmem.ShapeSpecError, match="has 1 entry for 2 array arguments"):
    symmem.trace(lambda a, b: a, jnp.zeros(3), jnp.zeros(3), polymorphic_shapes=("n",))
  with pytest.raises(symmem.ShapeSpecError, match="do not fit"):   # inside an argument
    symmem.trace(lambda a: a[0], (jnp.zeros(3), jnp.zeros(3)), polymorphic_shapes=(("n",),))


def test_non_array_argument_is_rejected():
  with pytest.raises(symmem.ShapeSpecError, match="str, not an array"):
    symmem.trace(lambda a, b: a, jnp.zeros(3), "hello", polymorphic_shapes=("n", None))


def test_contradictory_constraints_are_rejected_before_tracing():
  with pytest.raises(symmem.ConstraintError, match="contradict"):
    symmem.trace(lambda x: x, jnp.zeros((2,)), polymorphic_shapes="s",
                 constraints=("s >= 8", "s <= 4"))


def test_infeasible_general_constraint_is_rejected():
  with pytest.raises(symmem.ConstraintError):
    symmem.trace(lambda x: x, jnp.zeros((2, 3)), polymorphic_shapes="b, s",
                 constraints=("b <= 64", "s <= 1024", "b*s >= 100000"))


def test_reshape_without_divisible_dim_says_declare_a_multiple():
  def f(x):
    return x.reshape(x.shape[0], -1, 128)
  line = f.__code__.co_firstlineno + 1
  with pytest.raises(symmem.TracingError) as e:
    symmem.trace(f, jnp.zeros((2, 256)), polymorphic_shapes="b, s")
  assert f"test_tracing.py:{line}" in str(e.value)
  assert "128*k" in str(e.value)
  # Declared as a multiple, the same reshape traces.
  traced = symmem.trace(f, jnp.zeros((2, 256)), polymorphic_shapes="b, 128*k")
  assert traced.dims == ("b", "k")


def _blocked(x, block=33):
  """x (b, s, d) through blocks of `block` positions, padded as blocked attention pads
  (transformers' LongT5): the padded length reshaped into blocks, sliced back to s."""
  b, s, d = x.shape
  padded = jnp.pad(x, ((0, 0), (0, -s % block), (0, 0)))
  n = (s + -s % block) // block
  blocks = jnp.tanh(padded.reshape(b, n, block, d))
  return x + blocks.reshape(b, n * block, d)[:, :s]


def test_padding_to_a_multiple_says_declare_the_multiple():
  # Sliced back (the add) and reshaped by -1 (JAX's divisibility check): JAX cannot prove
  # either for any s; declared a multiple of the block, both trace.
  by_minus_one = lambda x: jnp.pad(x, ((0, 0), (0, -x.shape[1] % 33))).reshape(x.shape[0], -1, 33)
  for f, x, spec in ((_blocked, jnp.zeros((2, 40, 8)), "b, s, _"),
                     (by_minus_one, jnp.zeros((2, 40)), "b, s")):
    with pytest.raises(symmem.TracingError) as e:
      symmem.trace(f, x, polymorphic_shapes=spec)
    assert "constraints=('s == 33*k',)" in str(e.value) and "pad_to_multiple_of=33" in str(e.value)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 66, 8), jnp.float32)
  traced = symmem.trace(_blocked, x, polymorphic_shapes="b, s, _", constraints=("s == 33*k",))
  (got,) = jax.jit(lambda a: interpret.run(traced.specialize(b=2, k=2), (a,)))(x)
  np.testing.assert_array_equal(got, jax.jit(_blocked)(x))


def test_python_if_on_a_dim_says_add_a_constraint():
  def f(x):
    if x.shape[0] > 128:
      return x * 2
    return x
  with pytest.raises(symmem.TracingError, match="constraint") as e:
    symmem.trace(f, jnp.zeros(4), polymorphic_shapes="s")
  assert f"test_tracing.py:{f.__code__.co_firstlineno + 1}" in str(e.value)
  # A constraint that decides the comparison makes it traceable.
  symmem.trace(f, jnp.zeros(200), polymorphic_shapes="s", constraints=("s >= 129",))


def test_a_comparison_of_a_dim_plus_a_constant_is_advised_as_a_bound_on_the_dim():
  def frames(x):   # as optax's CTC loss reads the last two frames of k - 1
    n = x.shape[0] - 1
    return x[:n].sum() if n >= 1 else x.sum()
  with pytest.raises(symmem.TracingError) as e:
    symmem.trace(frames, jnp.zeros(8), polymorphic_shapes="s")
  assert "'s >= 2' if s - 1 >= 1 holds" in str(e.value) and "'s <= 1' if it never" in str(e.value)
  symmem.trace(frames, jnp.zeros(8), polymorphic_shapes="s", constraints=("s >= 2",))


def test_data_dependent_shape_says_give_a_static_size():
  with pytest.raises(symmem.TracingError, match="size="):
    symmem.trace(lambda x: jnp.nonzero(x), jnp.zeros(4), polymorphic_shapes="s")


def test_float_arithmetic_on_a_dim_says_keep_sizes_in_integers():
  def f(x):   # a capacity factor written with floats: an array, not a dim, under tracing
    return jnp.zeros((int(1.25 * x.shape[0] / 4),)).sum() + x.sum()
  with pytest.raises(symmem.TracingError, match=r"keep size arithmetic in integers"):
    symmem.trace(f, jnp.zeros(64), polymorphic_shapes="s")


@pytest.mark.parametrize("constraint, match", [("s % 8 == 0", "s == 8\\*k"), ("s <= ", "s <= ")])
def test_an_unparsable_constraint_is_a_constraint_error(constraint, match):
  # jax.export parses shapes and constraints together; the error names the constraint.
  with pytest.raises(symmem.ConstraintError, match=match):
    symmem.trace(lambda x: x * 2, jnp.zeros((2, 64)), polymorphic_shapes="b, s",
                 constraints=(constraint,))


def _strided(x, stages=2, kernels=(3, 3)):
  for k in kernels[:stages]:
    w = jnp.ones((k, k, x.shape[-1], 3))
    x = jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jnp.sum(x ** 2)


def test_strided_convolutions_say_declare_a_multiple_of_the_stride():
  x = jnp.ones((2, 16, 16, 3))
  # Undecidable padding (no divisibility declared), and jax.export recursing without end
  # (h == 2*k for two stride-2 stages): both a TracingError with the same advice.
  for constraints in (("h <= 128",), ("h <= 128", "h == 2*k")):
    with pytest.raises(symmem.TracingError, match=r"multiple of\s+the total stride"):
      symmem.trace(jax.grad(_strided), x, polymorphic_shapes="b, h, h, 3",
                   constraints=constraints)
  symmem.trace(jax.grad(_strided), x, polymorphic_shapes="b, h, h, 3",
               constraints=("h <= 128", "h == 4*k"))   # declared: traces
  # A Python `if` on a floordiv size is control flow, not a stride to declare.
  with pytest.raises(symmem.TracingError, match="Python control flow"):
    symmem.trace(lambda x: x * 2 if x.shape[0] // 2 > 3 else x, jnp.zeros(16),
                 polymorphic_shapes="s")


def _feature_extractor(x):
  """Wav2Vec2's feature extractor in small: 'VALID' convolutions of kernel 10 / stride 5,
  then kernel 3 / stride 2 twice, over raw audio (b, n, 1)."""
  for kernel, stride in ((10, 5), (3, 2), (3, 2)):
    w = jnp.ones((kernel, x.shape[-1], 4))
    x = jax.nn.gelu(jax.lax.conv_general_dilated(x, w, (stride,), "VALID",
                                                 dimension_numbers=("NWC", "WIO", "NWC")))
  return jnp.sum(x ** 2)


# Shapes, not arrays: an array made at collection would stay live for the whole session
# (tests of budgets count the live arrays).
@pytest.mark.parametrize("fn, shape, spec, declared, advised", [
    # 'SAME' stride-2 convolutions, h and w: the backward adds a floor division the forward
    # does not need, and h == 4*k suffices (as traced above), not 8.
    (_strided, (2, 16, 16, 3), "b, h, w, 3", (), ("h == 4*k", "w == 4*m")),
    # 'VALID' strides 5, 2, 2: the total stride; and a declared multiple that is too small.
    (_feature_extractor, (2, 400, 1), "b, n, 1", (), ("n == 20*k",)),
    (_feature_extractor, (2, 400, 1), "b, n, 1", ("n == 5*k",), ("n == 20*k",)),
])
def test_strided_convolutions_name_the_least_multiples_that_trace(fn, shape, spec, declared,
                                                                  advised):
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  long_enough = ("n >= 40",) if "n" in spec else ()   # three 'VALID' stages leave a frame
  with pytest.raises(symmem.TracingError) as e:
    symmem.trace(jax.grad(fn), x, polymorphic_shapes=spec, constraints=long_enough + declared)
  assert f"constraints=({', '.join(map(repr, advised))},)" in str(e.value)
  if declared:
    assert f"in place of {declared[0]!r}" in str(e.value)
  # What it advises traces, and half of any of its multiples does not.
  symmem.trace(jax.grad(fn), x, polymorphic_shapes=spec, constraints=long_enough + advised)
  for i, c in enumerate(advised):
    dim, n, k = re.fullmatch(r"(\w+) == (\d+)\*(\w+)", c).groups()
    smaller = advised[:i] + (f"{dim} == {int(n) // 2}*{k}",) + advised[i + 1:]
    with pytest.raises(symmem.TracingError):
      symmem.trace(jax.grad(fn), x, polymorphic_shapes=spec, constraints=long_enough + smaller)


def test_a_shape_check_in_the_steps_own_code_says_keep_the_axis_static():
  def encoder(features):   # as Whisper's encoder checks its input length
    if features.shape[1:] != (16, 400):
      raise ValueError(f"features must be of shape (16, 400), got {features.shape[1:]}")
    return features.sum()
  spec = jax.ShapeDtypeStruct((2, 16, 400), jnp.float32)
  with pytest.raises(symmem.TracingError, match=r"own code.*keep that axis static") as e:
    symmem.trace(encoder, spec, polymorphic_shapes="b, _, f")
  assert f"test_tracing.py:{encoder.__code__.co_firstlineno + 2}" in str(e.value)
  symmem.trace(encoder, spec, polymorphic_shapes="b, _, _")   # as advised


@pytest.mark.parametrize("fn, advised, spec, constraints", [
    # Python and NumPy want a number: the advice names the jax.numpy and lax ways.
    (lambda x: sum(x[i] for i in range(x.shape[0])), "Python or NumPy needed a concrete number",
     None, None),
    (lambda x: x + np.zeros(x.shape, np.float32), "jnp.zeros(x.shape)", None, None),
    (lambda x: x + np.arange(x.shape[0]), "jnp.arange(s)", None, None),
    (lambda x: jnp.split(x, 2)[0].sum(), "constraints=('s == 2*k',)", "s", ("s == 2*k",)),
    (lambda x: x[jax.random.permutation(jax.random.PRNGKey(0), x.shape[0])],
     "keep that axis static", "_", ()),
])
def test_common_ways_a_step_needs_a_concrete_size_say_what_to_write(fn, advised, spec, constraints):
  x = jax.ShapeDtypeStruct((16,), jnp.float32)
  with pytest.raises(symmem.TracingError) as e:
    symmem.trace(fn, x, polymorphic_shapes="s")
  assert advised in str(e.value)
  if spec is not None:   # as advised, it traces
    symmem.trace(fn, x, polymorphic_shapes=spec, constraints=constraints)


def test_bind_dims_solves_and_checks_shapes():
  spec = jax.ShapeDtypeStruct((2, 256), F32)
  traced = symmem.trace(lambda x, y: x.sum() + y.sum(), spec, jax.ShapeDtypeStruct((4,), F32),
                        polymorphic_shapes=("b, 128*k", "2*b"), constraints=("k <= 8",))
  assert traced.bind_dims(jnp.zeros((3, 384)), jnp.zeros(6)) == {"b": 3, "k": 3}
  with pytest.raises(symmem.ShapeError, match=r"args\[1\] has size 5 where the spec says 2\*b"):
    traced.bind_dims(jnp.zeros((3, 384)), jnp.zeros(5))
  with pytest.raises(symmem.ShapeError, match=r"k = 9 is outside \[1, 8\].*k <= 8"):
    traced.bind_dims(jnp.zeros((3, 128 * 9)), jnp.zeros(6))
  with pytest.raises(symmem.ShapeError, match="cannot solve"):
    traced.bind_dims(jnp.zeros((3, 100)), jnp.zeros(6))


def test_specialize_matches_the_symbolic_program():
  traced = symmem.trace(lambda x: jnp.tanh(x @ x.T).sum(0), jnp.zeros((3, 4)),
                        polymorphic_shapes="b, d")
  program = traced.specialize(b=5, d=7)
  assert [n.name for n in program.nodes] == [n.name for n in traced.program.nodes]
  assert program.avals[program.nodes[1].outputs[0]].shape == (5, 5)
  # Only where the constraints allow, at every dim, integers (as Analysis's figures).
  bounded = symmem.trace(traced.fun, jnp.zeros((3, 4)), polymorphic_shapes="b, d",
                         constraints=("d <= 64",))
  with pytest.raises(symmem.ShapeError, match=r"d = 1000 is outside \[1, 64\]"):
    bounded.specialize(b=2, d=1000)
  with pytest.raises(symmem.ShapeError, match=r"b = 0 is outside"):
    bounded.specialize(b=0, d=8)
  with pytest.raises(ValueError, match="unknown dims z"):
    bounded.specialize(b=2, d=8, z=1)
  with pytest.raises(TypeError, match="d=8.5 is not an integer"):
    bounded.specialize(b=2, d=8.5)


def test_specialize_returns_the_same_objects_so_jax_caches_hit():
  # JAX compares jaxpr-valued params (scatter's update_jaxpr) by identity: a fresh
  # copy per call recompiled every scatter on every call.
  traced = symmem.trace(lambda x, i: x.at[i].add(1.0), jnp.zeros((8, 4)), jnp.arange(3),
                        polymorphic_shapes=("n, 4", None))
  p1, p2 = traced.specialize(n=8), traced.specialize(n=8)
  assert p1 is p2
  assert traced.specialize(n=9) is not p1


def test_sources_point_at_the_users_line_and_name_the_flax_module():
  import flax.linen as nn
  from jax_symmem._src.ir import source_label

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.LayerNorm()(x)   # flax's own ops run in normalization.py

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(2):
        x = Block()(x)
      return x.sum()

  model = Model()
  params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
  traced = symmem.trace(jax.grad(model.apply), params, jnp.ones((2, 8)),
                        polymorphic_shapes=(None, "b, _"))
  labels = {source_label(n.source, n.name) for _, n in traced.program.walk()
            if n.name == "rsqrt"}
  marker = "return x + nn.LayerNorm()(x)   # flax's own ops"
  line = next(k for k, text in enumerate(open(__file__), 1) if marker in text)
  assert len(labels) == 2, labels
  for k in (0, 1):   # one per layer, told apart by the module's scope
    assert any(re.fullmatch(rf"test_tracing\.py:{line}:\d+ \(.*Block\.__call__\) "
                            rf"@ Block_{k}/LayerNorm_0", label) for label in labels), labels
  assert source_label(" [recomputed]", "mul") == "mul (no user source line) [recomputed]"


def test_ops_of_library_jits_are_named_by_the_line_that_called_them():
  # jax.nn.silu and jnp.take are jitted inside JAX: the ops of their bodies carry
  # tracebacks without a user frame, so they are named by the call's line.
  from jax_symmem._src.ir import source_label

  def f(x, idx):
    h = jax.nn.silu(x)             # silu's line
    return jnp.take(h, idx, axis=0).sum()   # take's line

  lines = {m: next(k for k, text in enumerate(open(__file__), 1) if f"# {m}'s line" in text)
           for m in ("silu", "take")}
  traced = symmem.trace(jax.value_and_grad(f), jnp.ones((8, 4)), jnp.zeros((3,), jnp.int32),
                        polymorphic_shapes=("s, _", "_"))
  labels = {n.name: source_label(n.source, n.name) for _, n in traced.program.walk()}
  assert f"test_tracing.py:{lines['silu']}" in labels["logistic"], labels["logistic"]
  assert f"test_tracing.py:{lines['take']}" in labels["gather"], labels["gather"]


def test_ops_of_library_jits_are_named_by_the_layer_that_called_them():
  # A jit traces its body under an empty name stack: jax.nn.silu's ops (a jit inside JAX)
  # would name no layer, and a layer's activation would join no layer group. They take
  # the scope of the call, forward and backward; a jit inside a jit, the outermost named.
  import flax.linen as nn
  from jax_symmem._src.ir import layer_scope

  @jax.jit
  def outer_jit(x):
    return jax.nn.silu(x) * 2.0   # the jit of silu inside another jit

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8)(outer_jit(nn.Dense(8)(x)))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Block(name=f"layer_{i}")(x)
      return jax.nn.silu(x).sum()   # outside any layer

  model = Model()
  params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
  traced = symmem.trace(jax.grad(model.apply), params, jnp.ones((2, 8)),
                        polymorphic_shapes=(None, "b, _"))
  scopes = [layer_scope(n.source) for _, n in traced.program.walk() if n.name == "logistic"]
  assert sorted(map(str, scopes)) == ["None", "layer_0", "layer_1"], scopes
  line = next(k for k, text in enumerate(open(__file__), 1) if "# the jit of silu inside" in text)
  inside = [(n.name, layer_scope(n.source)) for _, n in traced.program.walk()
            if f"test_tracing.py:{line}:" in n.source]
  # silu's forward and backward ops in both layers (its derivative's sub and muls), each
  # named by its layer
  for layer in ("layer_0", "layer_1"):
    assert {"logistic", "sub", "mul"} <= {name for name, sc in inside if sc == layer}, inside
  assert {sc for _, sc in inside} == {"layer_0", "layer_1"}, inside


def test_a_table_sliced_by_a_length_asks_for_the_bound_that_makes_it_trace():
  # GPT-2 / GPT-Neo style: a causal mask sliced from a fixed table. Without a bound,
  # jax.export sizes the slice min(16, s), which is not s; the advice names the
  # constraint, and with it the same step traces.
  table = jnp.tril(jnp.ones((16, 16), bool))

  def f(x):
    s = x.shape[1]
    return jnp.where(table[None, :s, :s], x[:, :, None] * x[:, None, :], 0.0).sum()

  x = jnp.ones((2, 8))
  with pytest.raises(symmem.TracingError, match=r"constraints=\('s <= 16',\)"):
    symmem.trace(f, x, polymorphic_shapes=("b, s",))
  traced = symmem.trace(f, x, polymorphic_shapes=("b, s",), constraints=("s <= 16",))
  assert traced.program.nodes


def test_an_op_jax_cannot_trace_symbolically_is_a_tracing_error_with_advice():
  # jax.export itself refuses lax.associative_scan over a symbolic axis
  # (NotImplementedError); the user is told where and what to do instead.
  def f(a, b):
    _, h = jax.lax.associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]), (a, b),
                                    axis=1)
    return jnp.sum(h)
  x = jnp.ones((2, 16))
  with pytest.raises(symmem.TracingError, match=r"run the recurrence with lax.scan") as e:
    symmem.trace(jax.grad(f), x, x, polymorphic_shapes=("b, s", "b, s"),
                 constraints=("s <= 512",))
  assert "test_tracing.py" in str(e.value)


def test_jaxs_own_code_compile_time_evaluation_and_remainders_say_what_to_do():
  x = jax.ShapeDtypeStruct((2, 16), jnp.float32)
  # An option of a JAX function that needs a concrete size (Python's range inside JAX).
  def windowed(q):
    q = q[:, :, None, None] * jnp.ones(4)
    return jax.nn.dot_product_attention(q, q, q, is_causal=True, local_window_size=(2, 0),
                                        implementation="xla").sum()
  with pytest.raises(symmem.TracingError,
                     match=r"JAX's own code \(jax[/\\]_src[/\\]\S+:\d+ \(\w+\)\) needed a "
                           r"concrete number.*mask from jnp.arange") as e:
    symmem.trace(windowed, x, polymorphic_shapes="b, s", constraints=("s <= 64",))
  assert "test_tracing.py" in str(e.value)
  # A slice of a symbolic size under compile-time evaluation (equinox's rotary embedding):
  # jax.export's UnexpectedDimVar, which named no line and gave no advice.
  table = jnp.arange(128.0)
  def rotary(x):
    with jax.ensure_compile_time_eval():
      t = table[:x.shape[1]]
    return (x * t).sum()
  with pytest.raises(symmem.TracingError, match=r"ran eagerly.*ensure_compile_time_eval"):
    symmem.trace(rotary, x, polymorphic_shapes="b, s", constraints=("s <= 128",))
  # A batch in chunks of 2 (lax.map's batch_size) whose leftover chunk decides a shape:
  # the advice is the multiple, and as advised it traces.
  def chunked(x, y):
    def one(xy):
      xi, yi = xy
      logits = jnp.tanh(xi)[:, None] * jnp.arange(4.0)
      return jnp.take_along_axis(logits, yi[:, None] % 4, axis=-1).sum()
    return jax.lax.map(one, (x, y), batch_size=2).sum()
  y = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  with pytest.raises(symmem.TracingError,
                     match=r"remainder of b by 2 .* constraints=\('b == 2\*k',\)"):
    symmem.trace(chunked, x, y, polymorphic_shapes=("b, s", "b, s"), constraints=("b <= 8",))
  symmem.trace(chunked, x, y, polymorphic_shapes=("b, s", "b, s"),
               constraints=("b <= 8", "b == 2*k"))


def test_constraints_read_as_symmem_jit_reads_them_and_clear_errors_for_mistakes():
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  f = lambda x: jnp.sum(x * x)
  # Strict inequalities, which jax.export does not parse ('b < 64' is 'b <= 63').
  traced = symmem.trace(f, x, polymorphic_shapes="b, _", constraints=("b < 64", "b > 1"))
  assert traced.bind_dims(jnp.ones((63, 8))) == {"b": 63}
  with pytest.raises(symmem.ShapeError, match=r"b = 64 is outside \[2, 63\]"):
    traced.bind_dims(jnp.ones((64, 8)))
  with pytest.raises(symmem.ShapeError, match=r"expected 1 array leaves .* got 2 in"):
    traced.bind_dims(jnp.ones((4, 8)), jnp.ones(3))
  with pytest.raises(TypeError, match="shape_graph takes a TracedProgram"):
    symmem.shape_graph(traced.specialize(b=4))
  # One string, read letter by letter before; two multiples of one dim.
  with pytest.raises(symmem.ConstraintError, match=r"write constraints=\('b <= 64',\)"):
    symmem.trace(f, x, polymorphic_shapes="b, _", constraints="b <= 64")
  with pytest.raises(symmem.ConstraintError, match=r"least common multiple once, 'b == 12\*k'"):
    symmem.trace(f, x, polymorphic_shapes="b, _", constraints=("b == 4*k", "b == 6*j"))
  # One spec string for several arguments applies to each (as in jax.export): the weights
  # got b too, and the error came from the step's dot with only JAX's generic advice.
  with pytest.raises(symmem.TracingError, match=r"is one spec, which applies to every argument"):
    symmem.trace(lambda w, x: jnp.sum(x @ w), jax.ShapeDtypeStruct((8, 8), jnp.float32), x,
                 polymorphic_shapes="b, _")


def test_symbolic_dims_canonicalize_as_jax_does_and_leave_no_cycles():
  # tracing._canonicalize_dimension stands in for JAX's private one while symmem traces
  # (if JAX renames or drops it, this fails here): the same answers, fewer cycles.
  from jax._src import core as jax_core
  jax_canonicalize = tracing._JAX_CANONICALIZE_DIMENSION
  assert jax_core._canonicalize_dimension is jax_canonicalize   # restored after every trace
  (dim,) = jax.export.symbolic_shape("2*b")
  for d in (3, np.int64(4), dim):
    assert tracing._canonicalize_dimension(d) == jax_canonicalize(d)
  for bad in (2.5, "b"):
    with pytest.raises(TypeError):
      tracing._canonicalize_dimension(bad)

  def f(x, w):
    for _ in range(8):
      x = jnp.tanh(x @ w).reshape(x.shape)
    return jnp.sum(x * x)

  args = (jnp.ones((4, 16)), jnp.ones((16, 16)))
  specs = jax.export.symbolic_args_specs(args, ("b, _", None))
  gc.collect()
  gc.disable()
  try:
    jax.make_jaxpr(jax.grad(f))(*specs)
    cyclic_jax = gc.collect()
    symmem.trace(jax.grad(f), *args, polymorphic_shapes=("b, _", None))
    cyclic_symmem = gc.collect()
  finally:
    gc.enable()
  assert jax_core._canonicalize_dimension is jax_canonicalize
  assert cyclic_symmem < cyclic_jax / 2, (cyclic_symmem, cyclic_jax)


def test_saving_everything_is_confined_to_the_thread_that_asked_for_it():
  # While one thread traces a step without its checkpoints (annotated models' variant),
  # another thread's plain JAX trace keeps its `jax.checkpoint` policy (the patched
  # `bind` is process-wide; before, it rewrote every thread's policy), and the
  # primitive's own `bind` is back once no thread needs the patch (before, JAX's
  # `_remat_bind` was deleted by the first such trace, for the rest of the process).
  import threading
  from jax._src import ad_checkpoint
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

  def annotated(w, x):
    return jnp.sum(jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w, policy=policy)(x))

  def policies(closed):
    return [e.params["policy"] for e in jax.make_jaxpr(jax.grad(annotated))(*closed).eqns
            if e.primitive.name in tracing.CHECKPOINT_PRIMITIVES]

  jax_bind = vars(ad_checkpoint.remat_p).get("bind")   # jax 0.10 has its own
  args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
  inside, done = threading.Event(), threading.Event()
  seen = {}

  def trace_saving_everything():
    with tracing._SAVE_EVERYTHING.active():
      seen["asked"] = policies(args)
      inside.set()
      done.wait(timeout=60)

  thread = threading.Thread(target=trace_saving_everything)
  thread.start()
  try:
    assert inside.wait(timeout=60)
    assert vars(ad_checkpoint.remat_p)["bind"] is tracing._bind_checkpoint   # meanwhile
    seen["other"] = policies(args)
  finally:
    done.set()
    thread.join()
  assert seen["asked"] == [jax.checkpoint_policies.everything_saveable]
  assert seen["other"] == [policy]
  assert vars(ad_checkpoint.remat_p).get("bind") is jax_bind
  traced = symmem.trace(jax.grad(annotated), *args, polymorphic_shapes=(None, "b, _"),
                        save_everything=True)
  assert tracing.has_checkpoints(traced.closed_jaxpr)
  assert vars(ad_checkpoint.remat_p).get("bind") is jax_bind


def _layers_under_scopes(names, model=None):
  """A 3-layer loss whose layers run under `jax.named_scope(names[i])`, all inside
  `jax.named_scope(model)` where given: how plain JAX code, Haiku (module calls named by
  the module alone) and a wrapping model module name their layers."""
  def loss(ws, x):
    def body(x):
      for name, w in zip(names, ws):
        with jax.named_scope(name):
          x = x + jnp.tanh(x @ w)
      return jnp.sum(x ** 2)
    if model is None:
      return body(x)
    with jax.named_scope(model):
      return body(x)
  return jax.grad(loss)


def test_layer_calls_split_a_scope_only_where_its_forward_repeats():
  import types
  from jax_symmem._src.layers import layer_calls
  def nodes(*ops):   # (primitive, scope) pairs, one source line each
    return [types.SimpleNamespace(name=p, source=f"m.py:{k} (f) @ {scope}")
            for p, scope, k in ops]
  call = [("dot_general", "enc/group/0/attn", 1), ("exp", "enc/group/0/attn", 2),
          ("dot_general", "enc/group/0/mlp", 3)]
  backward = [("transpose", "enc/group/0/mlp", 3), ("mul", "enc/group/0/attn", 2)] * 3
  program = nodes(*call * 3, *backward)
  calls = layer_calls(program, set(range(9)))
  assert [calls[i] for i in range(9)] == [f"enc/group/0 (call {k})" for k in range(3) for _ in range(3)]
  # The backward's nodes are in none.
  assert set(calls) == set(range(9))
  # A last call cut short by the peak (its tail is backward) is still a call.
  assert layer_calls(program[:8], set(range(8)))[7] == "enc/group/0 (call 2)"
  # Layers with scopes of their own stay as they are, and so does a layer whose forward
  # merely starts with a repeat: its forward runs past the repeated run.
  distinct = nodes(("dot_general", "h_0", 1), ("tanh", "h_0", 2), ("dot_general", "h_1", 1),
                   ("tanh", "h_1", 2))
  assert layer_calls(distinct, set(range(4))) == {}
  starts_twice = nodes(("reshape", "h_0", 1), ("reshape", "h_0", 1), ("dot_general", "h_0", 2),
                       ("tanh", "h_0", 3))
  assert layer_calls(starts_twice, set(range(4))) == {}


def test_layer_calls_without_scopes_read_the_layers_from_the_repeated_run():
  import types
  from jax_symmem._src.layers import layer_calls
  def nodes(*ops):   # (primitive, source line) pairs, no scope: NNX and Equinox modules
    return [types.SimpleNamespace(name=p, source=f"m.py:{k} (f)") for p, k in ops]
  layer = [("dot_general", 10), ("tanh", 11), ("dot_general", 12), ("add", 13)]
  program = nodes(("gather", 1), ("add", 2), *layer * 3, ("reduce_sum", 20),
                  ("transpose", 12), ("mul", 11))   # the last two: backward
  forward = set(range(len(program) - 2))
  calls = layer_calls(program, forward)
  assert calls == {2 + k: f"repeated layer (call {k // 4})" for k in range(12)}
  # Where a scope names a layer, scopes decide and repeated code is not read.
  scoped = program[:]
  scoped[2] = types.SimpleNamespace(name="dot_general", source="m.py:10 (f) @ h_0")
  assert layer_calls(scoped, forward) == {}


def test_tandem_repeat_equals_brute_force():
  from jax_symmem._src.layers import _tandem_repeat
  def brute(seq):
    best = (0, 0, 1)
    for p in range(1, len(seq) // 2 + 1):
      for start in range(len(seq) - p):
        if start and seq[start - 1] == seq[start - 1 + p]:
          continue   # not where a run starts
        r = 0
        while start + r + p < len(seq) and seq[start + r] == seq[start + r + p]:
          r += 1
        if r >= p and r + p > best[1]:
          best = (start, r + p, p)
    return best
  rng = np.random.RandomState(0)
  for _ in range(200):
    layer = rng.randint(0, 3, rng.randint(1, 6))
    seq = np.concatenate([rng.randint(0, 4, rng.randint(0, 5)),
                          np.tile(layer, rng.randint(1, 4)), rng.randint(0, 4, rng.randint(0, 5))])
    seq = seq.astype(np.int64)
    assert _tandem_repeat(seq.tobytes()) == brute(seq.tolist()), seq


@pytest.mark.parametrize("names, model, layers", [
    # Haiku's naming: the first call of a module is unindexed.
    (("block", "block_1", "block_2"), None, ["block_0", "block_1", "block_2"]),
    (("layer_0", "layer_1", "layer_2"), None, ["layer_0", "layer_1", "layer_2"]),
    # The model's own scope (whose name may end in a digit) is not a layer.
    (("h_0", "h_1", "h_2"), "GPT2", ["h_0", "h_1", "h_2"]),
    (("block", "block_1", "block_2"), "transformer", ["block_0", "block_1", "block_2"]),
])
def test_layer_scopes_from_plain_named_scopes_haiku_names_and_a_model_scope(names, model, layers):
  from jax_symmem._src.ir import layer_scope
  ws = [jnp.ones((8, 8)) / 8] * 3
  traced = symmem.trace(_layers_under_scopes(names, model), ws, jnp.ones((2, 8)),
                        polymorphic_shapes=(None, "b, _"))
  tanh_layers = [layer_scope(n.source) for n in traced.program.nodes if n.name == "tanh"]
  assert tanh_layers == layers
  # Without a family of indexed scopes the outermost scope is the model's: dropped.
  single = symmem.trace(_layers_under_scopes(("attention",) * 3, "Llama2"), ws,
                        jnp.ones((2, 8)), polymorphic_shapes=(None, "b, _"))
  assert {n.source.partition(" @ ")[2] for n in single.program.nodes
          if n.name == "tanh"} == {"attention"}


def test_dead_code_goes_but_effects_and_everything_read_stay():
  """The traced program drops top-level nodes whose results nothing reads (XLA removes
  them too), with the nodes only they read; a node with effects stays; nodes are
  renumbered in order and the program still computes the step."""
  seen = []

  def f(x):
    unused = jnp.exp(jnp.sin(x))                     # dead, and so is the sin feeding it
    jax.debug.callback(lambda v: seen.append(v), x.sum())   # effects: kept
    return jnp.cos(x) * 2.0

  traced = symmem.trace(f, jnp.ones((4,)), polymorphic_shapes="n")
  names = [n.name for n in traced.program.nodes]
  assert "sin" not in names and "exp" not in names
  assert "debug_callback" in names and "cos" in names
  assert [n.index for n in traced.program.nodes] == list(range(len(names)))
  run = executor.execute(traced, (np.arange(4, dtype=np.float32),))
  np.testing.assert_allclose(np.asarray(run.outputs), np.cos(np.arange(4)) * 2.0, rtol=1e-6)
