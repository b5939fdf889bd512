"""symmem.jit across processes: 2 processes x 4 CPU devices (jax.distributed on 127.0.0.1).

Every process of an SPMD step must dispatch the same variant at the same call.
tests/multiprocess_llama.py makes the processes' local live-memory readings
differ on purpose; here both processes' records are compared.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from jax_symmem._src import device
from tests import host_devices

TIMEOUT_S = 600   # both processes together; ~45 CPU-s each (113-218 s wall at load average 8-13)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch() -> list[dict]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS=host_devices.xla_flags(4), JAX_PLATFORMS="cpu")
  port = _free_port()
  with tempfile.TemporaryDirectory() as tmp:
    procs, logs = [], []
    try:
      for i in range(2):
        out, err = (open(os.path.join(tmp, f"{name}{i}"), "w+") for name in ("out", "err"))
        logs.append((out, err))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.multiprocess_llama", str(i), str(port)],
            cwd=root, env=env, stdout=out, stderr=err, text=True))
      deadline = time.monotonic() + TIMEOUT_S
      # A failed process leaves the other waiting in a collective: stop at the first failure.
      while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
        assert time.monotonic() < deadline, f"no result after {TIMEOUT_S} s"
        time.sleep(0.2)
    finally:
      killed = set()
      for i, p in enumerate(procs):
        if p.poll() is None:
          p.kill()
          p.wait()
          killed.add(i)
    records = []
    # The process that failed on its own first: its error is the cause.
    for i in sorted(range(len(procs)), key=lambda i: i in killed):
      p, (out, err) = procs[i], logs[i]
      out.seek(0), err.seek(0)
      stdout, stderr = out.read(), err.read()
      out.close(), err.close()
      assert p.returncode == 0, (f"process {i} {'was killed' if i in killed else 'exited'} with "
                                 f"{p.returncode}:\n{stderr[-4000:]}")
      for line in stdout.splitlines():
        if line.startswith("{"):
          records.append(json.loads(line))
  return records


# Two processes compiling a step each take about a minute of CPU: the slow tier, which
# .ci/run runs after the fast one. The fast tier checks the agreement's parts below. One
# test, a subtest per layout: both layouts come from one run (host_devices.shared), and as
# two tests on two xdist workers one could wait for the other's run.
@pytest.mark.slow
def test_processes_dispatch_the_same_variants_and_match_jax_jit(subtests):
  # Once per test session, whichever xdist worker asks first.
  records = host_devices.shared("multiprocess_llama", _launch)
  by_process = {(r["layout"], r["process"]): r for r in records}
  for layout in ("data", "tensor"):
    with subtests.test(layout=layout):
      _check_agreement(by_process[layout, 0], by_process[layout, 1])


def _check_agreement(p0, p1):
  decision = lambda c: (c["b"], c["s"], c["round"], c["reserved"], c["budget"], c["xla_bytes"])
  assert [decision(c) for c in p0["calls"]] == [decision(c) for c in p1["calls"]]
  assert p0["variants"] == p1["variants"]     # (b, s, round, XLA bytes, memory options)
  assert p0["cache_info"] == p1["cache_info"]
  assert p0["cache_info"]["fallback_calls"] == 0
  for c0, c1 in zip(p0["calls"], p1["calls"]):
    # The local readings differ (process 1 holds more); both use the larger one.
    assert c1["local_reserved"] > c0["local_reserved"]
    assert c0["reserved"] == c1["reserved"] == c1["local_reserved"]
  # Call 1: round 0 fits either reading; it compiles as jax.jit would, XNNPACK's fusions
  # only where they fit the agreed reading (not the memory-saving options). Calls 2-3:
  # process 0 alone would dispatch round 0 (XLA's figure for it fits); the agreed reading
  # needs a later round.
  first, later = p0["calls"][0], p0["calls"][1:]
  assert first["round"] == 0
  assert p0["variants"][-1][:3] == [16, 64, 0] and not p0["variants"][-1][4]
  for c in later:
    assert c["budget"] - c["local_reserved"] >= 1.2 * c["basis"]
    assert c["round"] > 0
  for p in (p0, p1):
    # Every element of the losses and updated parameters: |d| <= 1e-6 + 1e-5 |jax.jit's|.
    assert p["max_rel_err"] <= 1.0
    for c in p["calls"]:
      assert c["loss"] == pytest.approx(c["loss_ref"], rel=1e-5)


def test_one_process_exchanges_nothing(monkeypatch):
  def fail(_):
    raise AssertionError("no collective with one process")
  monkeypatch.setattr(device.multihost_utils, "process_allgather", fail)
  import jax.numpy as jnp
  x = jnp.ones(4)
  assert device.agreed_reserved(123, 456, [x]) == 123
  assert device.agreed_footprint(789, [x]) == 789
  assert device.agreed_seconds({0: 0.5, 3: 0.25}, [x]) == {0: 0.5, 3: 0.25}


def test_readings_travel_exactly_above_int32(monkeypatch):
  rows = [(5 * 2**40 + 12345, 2**31 - 1), (7, 3 * 2**33)]
  monkeypatch.setattr(device, "spans_processes", lambda args: True)
  def gather(halves):   # what process_allgather returns: one row per process
    assert halves.dtype == np.int32
    mine = [(int(halves[0]) << 30) + int(halves[1]), (int(halves[2]) << 30) + int(halves[3])]
    assert mine == list(rows[0])
    return np.stack([halves, _halves(rows[1])])
  monkeypatch.setattr(device.multihost_utils, "process_allgather", gather)
  assert device.all_processes(rows[0]) == rows
  with pytest.raises(ValueError, match="different bytes across processes"):
    device.agreed_reserved(*rows[0], [])


def _halves(values):
  return np.array([h for v in values for h in (v >> 30, v & (2**30 - 1))], np.int32)


def test_speed_trial_times_agree_on_the_slowest_process(monkeypatch):
  # Each process times its own calls; all must keep the same round, so each round's
  # time is the slowest process's (an SPMD step waits for it).
  monkeypatch.setattr(device, "spans_processes", lambda args: True)
  other = {0: 0.9, 5: 1.3}   # the other process: round 5 slower there
  def gather(halves):
    return np.stack([halves, _halves([round(other[r] * 1e6) for r in sorted(other)])])
  monkeypatch.setattr(device.multihost_utils, "process_allgather", gather)
  mine = {0: 1.0, 5: 0.5}
  agreed = device.agreed_seconds(mine, [])
  assert agreed == {0: 1.0, 5: 1.3}
  from jax_symmem._src.speed_trial import SpeedTrial
  assert SpeedTrial(0, 5).winner(mine) == 5 and SpeedTrial(0, 5).winner(agreed) == 0
