"""Running a test module in a fresh process with several host (CPU) devices.

The device count is fixed when JAX starts, so a test that needs more devices than the
test process has runs `python -m <module>` with
XLA_FLAGS=--xla_force_host_platform_device_count=N and reads the JSON lines it prints.

Host devices share this machine's cores: a collective waits for the device that is
still computing, and XLA:CPU ends the process when one waits 40 s (seen with 8 devices on
2 busy cores, jax 0.12.0.1); the subprocess allows 10 minutes instead. It keeps the rest
of the test process's XLA_FLAGS (conftest.py's LLVM level 0: two of the 8-device Llama's
four layouts took 46 s at XLA's default level, 35 s at 0).

The tests that read one such run may land on different pytest-xdist workers; the first
to ask runs it and the others wait for its result (`shared`), so it runs once per test
session, not once per worker (two 8-device runs at once had each take 110 s of 2 cores).
"""

import fcntl
import json
import os
import subprocess
import sys
from typing import Callable

# A directory the test session's processes share (tests/conftest.py makes it).
SHARED_DIR_ENV = "JAX_SYMMEM_TEST_SHARED_DIR"


def shared(name: str, compute: Callable[[], object]):
  """`compute()`'s JSON-able result, computed once per test session: under a lock on a
  file in the session's shared directory, the first caller computes and stores it and
  later callers, in any worker, read it back. A failure stores nothing (the next caller
  computes again). Without the shared directory, computes every time."""
  directory = os.environ.get(SHARED_DIR_ENV)
  if not directory:
    return compute()
  path = os.path.join(directory, f"{name}.json")
  with open(path + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
    if os.path.exists(path):
      with open(path) as f:
        return json.load(f)
    result = compute()
    with open(path + ".tmp", "w") as f:
      json.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def run_json(module: str, devices: int, timeout: int = 900) -> list[dict]:
  """The JSON objects `python -m module` prints (one per line) on `devices` host devices;
  run once per test session (`shared`)."""
  return shared(f"{module}-{devices}", lambda: _run_json(module, devices, timeout))


def xla_flags(devices: int, *extra: str) -> str:
  """This process's XLA_FLAGS with `devices` host devices instead of its own count."""
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}", *extra])


def _run_json(module: str, devices: int, timeout: int) -> list[dict]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(
      devices, "--xla_cpu_collective_call_terminate_timeout_seconds=600"))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", module], cwd=root, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
