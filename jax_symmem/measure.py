"""Real peak memory of a JAX call, measured in a fresh process.

On the CPU (DESIGN.md F3), the only protocol that gave repeatable figures here:
a fresh subprocess with `MALLOC_MMAP_THRESHOLD_=65536` set before Python starts
(so freed buffers go back to the OS instead of being recycled), compile and one
warm-up call, drop the warm-up's outputs and `gc.collect()`, reset the high-water
mark (`echo 5 > /proc/self/clear_refs`), read VmRSS, run the call to completion,
read VmHWM. The peak the call adds is VmHWM - VmRSS (the arguments are already
resident); repeats agree within about 0.5 MiB.

On a GPU or TPU the device allocator counts: `memory_stats()`'s `bytes_in_use`
before the measured call and `peak_bytes_in_use` after it (the child runs with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`). The allocator's peak cannot be reset, so it
also covers compilation (autotuning) and the warm-up call, which runs the same
program: the figure is an upper bound on the call's peak, exact whenever the call
itself is the largest thing the process ran.

A workload is named as "module:function" plus JSON-able keyword arguments; the
function runs in the subprocess and returns `(fn, args)`: `fn(*args)` is the call
to measure. Use it from benchmark scripts, never from tests.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import subprocess
import sys
from typing import Any, Mapping

_MARKER = "JAX_SYMMEM_MEASUREMENT "


@dataclasses.dataclass(frozen=True)
class Measurement:
  rss_before: int      # bytes resident (a device: in use) before the measured call
  hwm: int             # high-water mark during the call (a device: the allocator's peak)
  extra: Mapping[str, Any]   # what the workload reported (e.g. argument bytes)

  @property
  def peak_delta(self) -> int:
    """Bytes the call added at its peak, above what was resident before it."""
    return self.hwm - self.rss_before


MMAP_THRESHOLD = "65536"   # MALLOC_MMAP_THRESHOLD_: freed buffers go back to the OS (F3)


def proc_status(field: str) -> int:
  """A /proc/self/status field in bytes (VmRSS, VmHWM, ...)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"{field} not in /proc/self/status")


def reset_high_water_mark() -> bool:
  """Sets VmHWM to the current VmRSS; False where the kernel does not allow it."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _block(x):
  import jax
  return jax.block_until_ready(x)


def _child(spec: str, kwargs: Mapping[str, Any]) -> None:
  import jax
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  module, name = spec.split(":")
  setup = getattr(importlib.import_module(module), name)
  fn, args, *rest = setup(**kwargs)
  extra = rest[0] if rest else {}
  device = jax.local_devices()[0]
  out = _block(fn(*args))          # compile + warm up
  del out
  gc.collect()
  if device.memory_stats():   # a device allocator (None on the CPU): its own counters
    before = device.memory_stats()["bytes_in_use"]
    out = _block(fn(*args))
    hwm = device.memory_stats()["peak_bytes_in_use"]
  else:
    if not reset_high_water_mark():
      raise OSError("/proc/self/clear_refs is not writable: VmHWM cannot be reset")
    before = proc_status("VmRSS")
    out = _block(fn(*args))
    hwm = proc_status("VmHWM")
  del out
  print(_MARKER + json.dumps({"rss_before": before, "hwm": hwm, "extra": extra}), flush=True)


def measure(spec: str, timeout: float = 600, **kwargs) -> Measurement:
  """Runs workload `spec` ("module:function") in a fresh process and measures its peak."""
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
  # The protocol's malloc: without huge pages (a timing parent may ask for them).
  tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":")
              if t and not t.startswith("glibc.malloc.hugetlb")]
  env["GLIBC_TUNABLES"] = ":".join(tunables)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # a device allocator grows as used
  env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p])
  code = ("import json, sys\nfrom jax_symmem import measure\n"
          "measure._child(sys.argv[1], json.loads(sys.argv[2]))")
  proc = subprocess.run([sys.executable, "-c", code, spec, json.dumps(kwargs)], env=env,
                        capture_output=True, text=True, timeout=timeout)
  for line in proc.stdout.splitlines():
    if line.startswith(_MARKER):
      data = json.loads(line[len(_MARKER):])
      return Measurement(data["rss_before"], data["hwm"], data["extra"])
  raise RuntimeError(f"measurement of {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
