"""symmem.nnx_jit: an NNX step that updates its model and optimizer in place, as nnx.jit runs it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_symmem as symmem

SHAPES = (None, None, "b, s", "b, s")
CONSTRAINTS = ("b <= 4", "s <= 64", "s >= 2")


class TinyLM(nnx.Module):
  """Embedding, a GELU MLP with dropout, a head: enough state to update in place
  (parameters, AdamW moments and step, the dropout Rngs' counter)."""

  def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 32):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens, mask):
    x = self.embed(tokens) * mask[..., None]
    x = x + self.drop(self.down(nnx.gelu(self.up(self.norm(x)))))
    return self.head(x)


def train_step(model, optimizer, tokens, mask):
  def loss_fn(model):
    logits = model(tokens, mask)[:, :-1]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    m = mask[:, 1:]
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _make():
  model = TinyLM(nnx.Rngs(params=0, dropout=1))
  return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def _raw(x):
  """A state leaf as a NumPy array (a typed PRNG key as its key data)."""
  x = jnp.asarray(x)
  return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _batch(b, s, seed):
  # NumPy's generator: jax.random.randint compiles once per shape (~0.5 s each here).
  rng = np.random.RandomState(seed)
  tokens = jnp.asarray(rng.randint(0, 64, (b, s)), jnp.int32)
  lengths = rng.randint(s // 2, s + 1, b)
  return tokens, jnp.asarray(np.arange(s)[None] < lengths[:, None], jnp.float32)


# Three steps at one shape in the fast tier (a compile, then two hits); at two shapes, the
# second compiling a variant of the same graph definition's step, in the slow tier
# (nnx.jit's and symmem.nnx_jit's compiles of this step take ~3 s apiece). symmem.jit's
# compile per shape is covered fast by test_jit's no-budget test.
@pytest.mark.parametrize("shapes", [
    pytest.param(((4, 32), (4, 32), (4, 32)), id="one_shape"),
    pytest.param(((4, 32), (2, 64), (4, 32)), id="two_shapes", marks=pytest.mark.slow)])
def test_updates_the_objects_in_place_as_nnx_jit_does(shapes):
  ref_model, ref_opt = _make()
  model, opt = _make()
  ref_step = nnx.jit(train_step)
  step = symmem.nnx_jit(train_step, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS)
  for seed, (b, s) in enumerate(shapes):
    batch = _batch(b, s, seed)
    want = ref_step(ref_model, ref_opt, *batch)
    # The second call passes its arguments by keyword (each goes to its position).
    got = (step(model, opt, *batch) if seed != 1 else
           step(model, optimizer=opt, tokens=batch[0], mask=batch[1]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Parameters, optimizer moments and step, and the dropout Rngs' counter all moved as
  # under nnx.jit (a plain jax.jit or symmem.jit of this step would leave them unchanged).
  want_state, got_state = nnx.state((ref_model, ref_opt)), nnx.state((model, opt))
  for w, g in zip(*(map(_raw, jax.tree_util.tree_leaves(t)) for t in (want_state, got_state))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert int(opt.step[...]) == len(shapes)
  info = step.cache_info()
  assert info["fallback_calls"] == 0 and info["compiles"] == len(set(shapes))
  assert info["hits"] == len(shapes) - info["compiles"]
  assert step.last_call["dims"] == {"b": 4, "s": 32}
  # What was compiled, as symmem.jit lists it (one step per graph definition seen).
  assert sorted(tuple(v["dims"].values()) for v in step.variants()) == sorted(set(shapes))
  assert step.variants() == step.jitted.variants() and step.speed_trial_results() == []
  assert [v.round for v in step.compiled(b=4, s=32)] == [0] and len(step.calibration()) == 1
  step.clear_cache()   # as jax.jit's: the next call compiles anew
  step(model, opt, *_batch(4, 32, 0))
  assert step.cache_info()["compiles"] == info["compiles"] + 1


class _Trainer(nnx.Module):
  """The step as a method of a module that holds the model and its optimizer."""

  def __init__(self):
    self.model, self.optimizer = _make()

  @functools.partial(symmem.nnx_jit, polymorphic_shapes=(None,) + SHAPES[2:],
                     constraints=CONSTRAINTS)
  def step(self, tokens, mask):
    return train_step(self.model, self.optimizer, tokens, mask)


# ~8 s (nnx.jit's compile, ours, an eager step); fast cover: test_jit's method binding and
# disable_jit tests.
@pytest.mark.slow
def test_a_method_binds_its_module_as_nnx_jit_does():
  ref_model, ref_opt = _make()
  trainer = _Trainer()
  for seed in range(2):
    batch = _batch(4, 32, seed)
    np.testing.assert_allclose(trainer.step(*batch), nnx.jit(train_step)(ref_model, ref_opt, *batch),
                               rtol=1e-5, atol=1e-6)
  assert int(trainer.optimizer.step[...]) == 2
  assert trainer.step.cache_info()["compiles"] == 1
  with jax.disable_jit():   # as nnx.jit: the step runs as Python and still updates in place
    trainer.step(*_batch(4, 32, 2))
  assert int(trainer.optimizer.step[...]) == 3 and trainer.step.cache_info()["compiles"] == 1


def test_nnx_objects_take_no_shape_spec_and_a_pure_step_is_pointed_to_symmem_jit():
  model, opt = _make()
  batch = _batch(2, 32, 0)
  with pytest.raises(symmem.ShapeSpecError, match=r"arguments \[0\] are NNX objects"):
    symmem.nnx_jit(train_step, polymorphic_shapes=("b", None, "b, s", "b, s"))(model, opt, *batch)
  with pytest.raises(TypeError, match="use symmem.jit for pure steps"):
    symmem.nnx_jit(lambda t, m: t, polymorphic_shapes=("b, s", "b, s"))(*batch)
  with pytest.raises(TypeError, match="in_shardings"):
    symmem.nnx_jit(train_step, polymorphic_shapes=SHAPES, in_shardings=None)


def _linear_and_sgd():
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _dict_step(objs, x, scale=1.0):
  """Objects in a dict, a static keyword, the model returned."""
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2) * scale)(objs["model"])
  objs["opt"].update(objs["model"], grads)
  return loss, objs["model"]


def test_objects_anywhere_in_the_arguments_donated_static_and_returned_as_nnx_jit():
  ref_model, ref_opt = _linear_and_sgd()
  model, opt = _linear_and_sgd()
  ref = nnx.jit(_dict_step, static_argnames="scale", donate_argnums=0)
  step = symmem.nnx_jit(_dict_step, polymorphic_shapes=(None, "b, s, _"),
                        static_argnames="scale", donate_argnums=0)
  x = jnp.asarray(np.random.RandomState(0).randn(2, 5, 4), jnp.float32)
  for scale in (1.0, 2.0, 2.0):
    old = model.kernel[...]
    want_loss, want_model = ref({"model": ref_model, "opt": ref_opt}, x, scale=scale)
    loss, back = step({"model": model, "opt": opt}, x, scale=scale)
    assert want_model is ref_model and back is model   # the object itself, not a copy
    assert old.is_deleted()   # donated, as nnx.jit donates it
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  np.testing.assert_allclose(model.kernel[...], ref_model.kernel[...], rtol=1e-6)
  assert int(opt.step[...]) == 3 and step.cache_info()["compiles"] == 2   # one per scale
  # Specs per parameter (the static one's too) or per dynamic argument; the static one
  # passed by position or by keyword, as symmem.jit reads them.
  for specs in ((None, "b, s, _", None), (None, "b, s, _")):
    g = symmem.nnx_jit(_dict_step, polymorphic_shapes=specs, static_argnames="scale")
    for call in (lambda: g({"model": model, "opt": opt}, x, 2.0),
                 lambda: g({"model": model, "opt": opt}, x, scale=2.0)):
      before = 2.0 * float(jnp.mean(model(x) ** 2))
      assert float(call()[0]) == pytest.approx(before, rel=1e-6)
  # A tuple of objects; the objects' state donated with some of them only: refused.
  pair = symmem.nnx_jit(lambda mo, x: _dict_step(dict(zip(("model", "opt"), mo)), x)[0],
                        polymorphic_shapes=(None, "b, s, _"))
  before = float(jnp.mean(model(x) ** 2))
  assert float(pair((model, opt), x)) == pytest.approx(before, rel=1e-6)
  assert int(opt.step[...]) == 8
  partly = symmem.nnx_jit(lambda m, o, x: _dict_step({"model": m, "opt": o}, x)[0],
                          polymorphic_shapes=(None, None, "b, s, _"), donate_argnums=0)
  with pytest.raises(TypeError, match="donated together"):
    partly(model, opt, x)
