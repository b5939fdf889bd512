"""Running a test module in a fresh process with several host (CPU) devices.

The device count is fixed when JAX starts, so a test that needs more devices than the
test process has runs `python -m <module>` with
XLA_FLAGS=--xla_force_host_platform_device_count=N and reads the JSON lines it prints.

Host devices share this machine's cores: a collective waits for the device that is
still computing, and XLA:CPU ends the process when one waits 40 s (seen with 8 devices on
2 busy cores, jax 0.12.0.1); the subprocess allows 10 minutes instead.
"""

import json
import os
import subprocess
import sys


def run_json(module: str, devices: int, timeout: int = 900) -> list[dict]:
  """The JSON objects `python -m module` prints (one per line) on `devices` host devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=600")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", module], cwd=root, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
