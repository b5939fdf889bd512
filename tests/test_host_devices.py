"""The test session's shared subprocess results (tests/host_devices.py: `shared`)."""

import threading
import time

import pytest

from tests import host_devices


def test_a_shared_result_is_computed_once_and_a_failure_is_not_stored(tmp_path, monkeypatch):
  monkeypatch.setenv(host_devices.SHARED_DIR_ENV, str(tmp_path))
  calls = []

  def compute():
    calls.append(1)
    time.sleep(0.2)   # the other caller arrives while this one computes: it must wait
    return [{"layout": "data", "value": len(calls)}]

  results = [None, None]
  def ask(i):
    results[i] = host_devices.shared("run", compute)
  threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(calls) == 1 and results[0] == results[1] == [{"layout": "data", "value": 1}]

  def fail():
    calls.append(1)
    raise AssertionError("subprocess failed")
  for _ in range(2):   # each caller sees the failure again: nothing was stored
    with pytest.raises(AssertionError, match="subprocess failed"):
      host_devices.shared("failing", fail)
  assert len(calls) == 3


def test_without_a_shared_directory_every_call_computes(monkeypatch):
  monkeypatch.delenv(host_devices.SHARED_DIR_ENV, raising=False)
  calls = []
  for _ in range(2):
    assert host_devices.shared("run", lambda: calls.append(1) or len(calls)) == len(calls)
  assert len(calls) == 2


def test_a_subprocess_keeps_the_sessions_xla_flags_with_its_own_device_count(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                  "--xla_force_host_platform_device_count=2")
  assert host_devices.xla_flags(8, "--x=1").split() == [
      "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=8", "--x=1"]
  monkeypatch.delenv("XLA_FLAGS")
  assert host_devices.xla_flags(4) == "--xla_force_host_platform_device_count=4"
