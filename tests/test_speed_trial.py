"""Speed trials: a recurring shape times its dispatched round against its least-memory one."""

from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np

import jax_symmem as symmem
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import speed_trial
from jax_symmem._src.speed_trial import SpeedTrial
from tests import test_jit

SHAPES = (None, "b, s, _")
CONSTRAINTS = ("s <= 64", "b <= 4")


def test_a_trial_warms_the_challenger_then_alternates_and_keeps_the_faster_by_a_margin():
  trial = SpeedTrial(incumbent=0, challenger=5)
  ran = []
  for seconds in [9.0] + [1.0, 0.5] * speed_trial.TIMED_CALLS:
    assert not trial.done()
    k = trial.next_round()
    ran.append(k)
    trial.record(k, seconds if k == 5 or seconds == 9.0 else 1.0)
  assert ran == [5] + [0, 5] * speed_trial.TIMED_CALLS   # the warm-up is untimed
  assert trial.done() and trial.fastest() == {0: 1.0, 5: 0.5} and trial.winner() == 5
  close = SpeedTrial(0, 5, times={0: [1.0] * 3, 5: [1.0 - speed_trial.MARGIN / 2] * 3}, warmed=True)
  assert close.done() and close.winner() == 0   # within the margin: the plan's choice stays


def test_a_trial_judges_by_each_rounds_fastest_call_not_by_calls_slowed_after_a_compile():
  # As measured on the unrolled Llama at b=4, s=128 (speed_trial.py): the calls right
  # after the challenger's compile ran slow; steadily round 0 is the faster.
  times = {0: [0.110, 0.163, 0.055], 20: [0.071, 0.074, 0.083]}
  trial = SpeedTrial(0, 20, times=times, warmed=True)
  assert trial.done() and trial.fastest() == {0: 0.055, 20: 0.071}
  assert trial.winner() == 0


def _scanned_step():
  """A scan over stacked layer weights with attention-like (s, s) residuals."""
  def loss(ws, x):
    def layer(h, w):
      a = jnp.tanh(h @ w[0])
      a = jax.nn.softmax(a @ jnp.swapaxes(a, -1, -2), axis=-1) @ a
      return h + a @ w[1], None
    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.mean(h ** 2)
  return jax.value_and_grad(loss)


def _args(b=2, s=32, n_layers=3, d=16, f=24):
  rng = np.random.RandomState(0)
  ws = (jnp.asarray(rng.randn(n_layers, d, f).astype(np.float32) / 4),
        jnp.asarray(rng.randn(n_layers, f, d).astype(np.float32) / 4))
  return ws, jnp.asarray(rng.randn(b, s, d).astype(np.float32))


def _run_trial(challenger_seconds: float):
  """Calls one shape until its trial settles, the challenger timed at `challenger_seconds`
  and the incumbent at 1 s (the clock is the test's: real timings would make it flaky)."""
  fn = _scanned_step()
  step = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS,
                    memory_budget=2**30, speed_trials=True)
  args = _args()
  want = jax.jit(fn)(*args)
  record = SpeedTrial.record
  def fake(self, k, seconds):
    record(self, k, challenger_seconds if k == self.challenger else 1.0)
  calls, pending = [], []
  with mock.patch.object(SpeedTrial, "record", fake), \
      mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    for _ in range(2 + 2 * speed_trial.TIMED_CALLS + 2):
      chex.assert_trees_all_close(step(*args), want, rtol=1e-5, atol=1e-6)
      calls.append((step.last_call["round"], step.last_call.get("speed_trial", False)))
      pending.append(step.last_call["pending"])
  # Pending from the first call (a trial is due) to the trial's last timed call, and
  # there only if the shape keeps another round than that call ran.
  final = 1 + 2 * speed_trial.TIMED_CALLS   # the first call, the warm-up, the timed calls
  assert pending[:final] == [True] * final and pending[final + 1:] == [False] * 2
  assert pending[final] == (calls[final][0] != calls[-1][0])
  return step, calls


def test_a_recurring_shape_switches_to_its_least_memory_round_when_it_runs_faster():
  step, calls = _run_trial(0.5)
  last = step.analyze(*_args()).floor_round({"b": 2, "s": 32})
  assert last > 0 and calls[0] == (0, False)   # the first call: round 0 fits the budget
  assert [r for r, trial in calls if trial] == [last] + [0, last] * speed_trial.TIMED_CALLS
  assert calls[-2:] == [(last, False), (last, False)]   # kept, and no more trials
  info = step.cache_info()
  assert info["speed_trials"] == 1 and info["compiles"] == 2 and info["executables"] == 1
  (result,) = step.speed_trial_results()
  assert result["dims"] == {"b": 2, "s": 32} and result["kept"] == last
  assert result["fastest_s"] == {0: 1.0, last: 0.5}


def test_a_recurring_shape_keeps_its_round_when_the_challenger_is_not_faster():
  step, calls = _run_trial(1.0)
  assert calls[-2:] == [(0, False), (0, False)]
  info = step.cache_info()
  assert info["speed_trials"] == 1 and info["compiles"] == 2 and info["executables"] == 1
  assert step.speed_trial_results()[0]["kept"] == 0


def test_no_trial_without_the_option_or_when_the_least_memory_round_is_dispatched():
  fn = _scanned_step()
  args = _args()
  plain = symmem.jit(fn, polymorphic_shapes=SHAPES, constraints=CONSTRAINTS, memory_budget=2**30)
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    for _ in range(4):
      plain(*args)
  assert plain.cache_info()["compiles"] == 1 and plain.cache_info()["speed_trials"] == 0
  # A step with nothing to evict has one round, which is both dispatched and last.
  def scale(x):
    return jnp.sin(x) * 2
  step = symmem.jit(scale, polymorphic_shapes=("b, s",), constraints=CONSTRAINTS,
                    memory_budget=2**30, speed_trials=True)
  x = jnp.ones((2, 8))
  assert len(step.analyze(x).rounds) == 1
  with mock.patch.object(jit_lib, "_live_bytes", return_value=0):
    for _ in range(4):
      chex.assert_trees_all_close(step(x), jnp.sin(x) * 2)
  assert step.cache_info()["compiles"] == 1 and step.cache_info()["speed_trials"] == 0
  assert step.speed_trial_results() == [] and "speed_trial" not in step.last_call


def test_the_challenger_is_the_first_round_at_the_least_predicted_footprint():
  # The rounds planned at smaller dims follow those planned at the largest; at the
  # largest they add recomputation and no predicted saving, so the trial's challenger is
  # the first round at the least predicted footprint, not the last (a Flax ResNet's last
  # round at 128 pixels: 2.5 x round 16's FLOPs in 1.9 x its XLA footprint).
  analysis = symmem.analyze(test_jit._mlp_step, *test_jit._mlp_args(8),
                            polymorphic_shapes=(None, "b, _"), constraints=("b <= 512",))
  for b in (8, 64, 512):
    dims = {"b": b}
    figures = [analysis.dispatch_figure(k, dims) for k in range(len(analysis.rounds))]
    floor = analysis.floor_round(dims)
    assert figures[floor] == min(figures) and all(f > figures[floor] for f in figures[:floor])
