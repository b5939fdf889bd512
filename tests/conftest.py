"""Test-session setup: XLA:CPU compiles the tests' programs without LLVM's optimizations.

XLA's backend optimization level is LLVM's level for each kernel's machine code. XLA's
HLO passes, buffer assignment and so memory_analysis(), the optimized HLO text (the
barriers and conditionals these tests look for) and executables' footprints are the
same at every level: checked on the transformer step's rounds 0, 5 and 10 under a
budget and on jax.jit's step, identical optimized HLO and memory analysis at level 0 and
at XLA's default. The values differ in the last bits (LLVM's code for tanh, exp, fused
multiply-adds), and every comparison in the tests compiles both sides in this process.
At level 0, XLA:CPU compiles a train step ~2.5x faster (~1.3 vs ~3.3 s on 2 cores), and
compiling is most of the tests' time on CPU: the fast tier's CPU time 433 -> 233 s.

Set before JAX creates its backend (this file is imported before any test module, and by
pytest-xdist's controller before it starts the workers, which inherit the environment).
Only where the tests run on CPU alone (JAX_PLATFORMS=cpu, or no GPU/TPU plugin
installed), and not where XLA_FLAGS already sets the level; set
JAX_SYMMEM_TEST_XLA_DEFAULT_OPT=1 to compile as XLA does by default.

The session also gets a directory for the results of subprocess runs that several tests
read (tests/host_devices.py: `shared`), removed at its end.

After each test module JAX's caches are cleared: the programs a module traced and compiled
are not needed by the next, and kept they grew a worker's heap to ~1.7 M objects by the
end of the slow tier, which every full garbage collection walks (symmem.jit's under a
budget among them).
"""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

import pytest

_FLAG = "--xla_backend_optimization_level"


def _cpu_only() -> bool:
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
  # jax[cuda] and TPU installs add PJRT plugins (jax_plugins.*) or jax_cuda*_plugin.
  return not any(importlib.util.find_spec(m) for m in
                 ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


if (_cpu_only() and not os.environ.get("JAX_SYMMEM_TEST_XLA_DEFAULT_OPT")
    and _FLAG not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=0".strip()

if "JAX_SYMMEM_TEST_SHARED_DIR" not in os.environ and not os.environ.get("PYTEST_XDIST_WORKER"):
  _shared = tempfile.mkdtemp(prefix="jax_symmem_tests_shared_")
  atexit.register(shutil.rmtree, _shared, ignore_errors=True)
  os.environ["JAX_SYMMEM_TEST_SHARED_DIR"] = _shared


@pytest.fixture
def own_arrays_only(monkeypatch):
  """symmem.jit counts only the live bytes this test added against its budget: arrays that
  earlier tests on this xdist worker left alive (garbage not yet collected, module-level
  arrays) would eat budgets of a few KiB to 1 MiB, and the test would depend on what ran
  before it (0.1 MiB of them refused every round of the contrastive step with pytest's
  --dist loadfile)."""
  from jax_symmem._src import device
  from jax_symmem._src import jit as jit_lib
  before = device.live_bytes()
  monkeypatch.setattr(jit_lib, "_live_bytes", lambda: max(0, device.live_bytes() - before))


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_the_module():
  yield
  import jax   # imported here: the XLA_FLAGS above must be set before JAX starts
  jax.clear_caches()
  gc.collect()
