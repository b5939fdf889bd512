"""One of 2 processes x 4 CPU devices running a sharded Llama step; run by tests/test_multiprocess.py.

`python -m tests.multiprocess_llama PROCESS_ID PORT` with
XLA_FLAGS=--xla_force_host_platform_device_count=4: joins `jax.distributed` on
127.0.0.1:PORT, then for a data-parallel (8-way batch) and a 2-way data x 4-way
tensor-parallel layout runs the same calls under `symmem.jit` (with a memory
budget) and `jax.jit` (same shardings). Before each call both processes hold
"ballast" arrays that set the other live bytes the step reads; process 1 holds
more, so the LOCAL readings differ and, without agreement, process 0 would
compile other options (call 1) and dispatch another round (call 2) than
process 1. Prints one JSON line per layout with what the test compares.
"""

import gc
import json
import math
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_symmem as symmem
from jax_symmem._src import device
from jax_symmem._src import variants
from jax_symmem.examples import llama
from tests.sharded_llama import _tensor_parallel_spec

# A one-layer Llama (RMSNorm, rotary attention, SwiGLU, AdamW): compiles in seconds.
CONFIG = llama.LlamaConfig(vocab=128, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_len=64)
BUDGET = 64 * 2**20   # per device; the ballast sets how much of it the step may use
# (b, s, free bytes process 1 leaves, free bytes process 0 leaves), as multiples of
# `basis` (below). Call 1: between the round-0 model and twice it for process 1, above
# twice it for process 0. Calls 2-3: 5 % under XLA's own figure for round 0 at that shape
# for process 1, so round 0 does not fit and the recompile loop moves on to a later round
# (those that fit there save 7-17 % by XLA's figure); 25 % above it for process 0, where
# round 0 fits. By XLA's figures, not the model's: a budget placed by the model moves with
# it (the per-device model's gather and scatter rules moved one below every round).
CALLS = ((16, 64, 1.5, 2.2), (16, 48, 0.95, 1.25), (16, 48, 0.95, 1.25))


def _global(x, sharding):
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _per_device_bytes(a) -> int:
  return math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize


def _reserved(args) -> int:
  """The other live bytes per device, as symmem.jit reads them before agreeing."""
  flat = jax.tree_util.tree_leaves(args)
  return max(0, device.live_bytes() - sum(_per_device_bytes(a) for a in flat))


def _max_rel_err(got, ref) -> float:
  """max |d| / (1e-6 + 1e-5 |ref|) over this process's shards (<= 1: within tolerance)."""
  worst = 0.0
  for a, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    for sa, sr in zip(a.addressable_shards, r.addressable_shards):
      x, y = np.asarray(sa.data, np.float64), np.asarray(sr.data, np.float64)
      worst = max(worst, float(np.max(np.abs(x - y) / (1e-6 + 1e-5 * np.abs(y)), initial=0.0)))
  return worst


def run(layout: str, state: dict) -> dict:
  devices = np.array(jax.devices())   # process 0's 4 devices, then process 1's
  if layout == "data":
    mesh = Mesh(devices.reshape(8), ("data",))
    state_sharding = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
  else:   # data across the processes, tensor within each
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
    state_sharding = jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, _tensor_parallel_spec(p, x)), state)
  batch_sharding = NamedSharding(mesh, P("data", None))
  shardings = dict(in_shardings=(state_sharding, batch_sharding, batch_sharding),
                   out_shardings=(state_sharding, NamedSharding(mesh, P())))
  step = llama.train_step_fn(llama.Llama(CONFIG), learning_rate=1e-3)
  ref = jax.jit(step, **shardings)
  sym = symmem.jit(step, polymorphic_shapes=(None, "b, s", "b, s"),
                   constraints=("s >= 2", "s <= 64", "b <= 16"), memory_budget=BUDGET,
                   **shardings)
  state = jax.tree_util.tree_map(_global, state, state_sharding)
  s_ref = s_sym = state
  out = {"layout": layout, "process": jax.process_index(), "calls": [], "max_rel_err": 0.0}
  analysis = None
  round0_xla = {}   # (b, s) -> bytes
  cpu0 = time.process_time()
  for i, (b, s, free1, free0) in enumerate(CALLS):
    tokens, mask = (_global(x, batch_sharding)
                    for x in llama.example_batch(CONFIG, b, s, seed=b + s))
    if analysis is None:
      analysis = sym.analyze(s_sym, tokens, mask)
    dims = {"b": b, "s": s}
    model0 = analysis.round_peak(0, dims)
    if i == 0:
      basis = model0
    else:   # XLA's footprint of round 0 at these dims, compiled with the budget's options
      if (b, s) not in round0_xla:
        round0_xla[b, s] = variants.footprint(ref.lower(s_ref, tokens, mask).compile(
            compiler_options=variants.FAST_PATH_CPU_OPTIONS))
      basis = round0_xla[b, s]
    s_ref, loss_ref = ref(s_ref, tokens, mask)
    gc.collect()   # no array freed by the collector between this reading and the step's
    free = free1 if jax.process_index() == 1 else free0
    target = BUDGET - int(free * basis)   # other live bytes per device this process holds
    need = target - _reserved((s_sym, tokens, mask))
    assert need >= 0, (need, target)
    ballast = [jax.device_put(np.zeros(need, np.uint8), d) for d in jax.local_devices()]
    local = _reserved((s_sym, tokens, mask))
    s_sym, loss_sym = sym(s_sym, tokens, mask)
    del ballast
    err = max(_max_rel_err(s_sym, s_ref), _max_rel_err(loss_sym, loss_ref))
    out["max_rel_err"] = max(out["max_rel_err"], err)
    call = dict(sym.last_call, local_reserved=local, loss=float(loss_sym.addressable_data(0)),
                loss_ref=float(loss_ref.addressable_data(0)),
                model_round0=model0, basis=int(basis))
    call.pop("dims")
    out["calls"].append(dict(call, b=b, s=s))
  out["variants"] = sorted((v["dims"]["b"], v["dims"]["s"], v["round"], v["xla_bytes"],
                            v["memory_options"]) for v in sym.variants())
  out["cache_info"] = sym.cache_info()
  out["cpu_s"] = time.process_time() - cpu0
  # What agreeing costs per call, devices idle: one all-gather of 4 int32 per process.
  flat = jax.tree_util.tree_leaves((s_sym, tokens, mask))
  device.agreed_reserved(0, BUDGET, flat)
  start, n = time.perf_counter(), 20
  for _ in range(n):
    device.agreed_reserved(0, BUDGET, flat)
  out["agree_us"] = (time.perf_counter() - start) / n * 1e6
  return out


if __name__ == "__main__":
  process_id, port = int(sys.argv[1]), int(sys.argv[2])
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=60)
  assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
  state = llama.init_state(CONFIG)   # the same values in every process (seed 0)
  for layout in sys.argv[3:] or ("data", "tensor"):
    print(json.dumps(run(layout, state)), flush=True)
