"""Workloads for the real-peak measurements (run in a fresh process by jax_symmem.measure)."""

import functools

import jax
import jax.numpy as jnp

from experiments import _common
import jax_symmem as symmem
from jax_symmem._src import executor
from jax_symmem._src import memory
from jax_symmem._src import schedule
from jax_symmem.examples import transformer

# The benchmark transformer: big enough that activations dominate at long lengths.
CONFIG = transformer.Config(vocab=512, d_model=256, n_heads=4, d_ff=688, n_layers=2)
CONSTRAINTS = ("s >= 2", "s <= 1024", "b <= 16")


@functools.lru_cache(maxsize=None)
def traced_step(cfg: transformer.Config = CONFIG):
  args = transformer.example_args(cfg, 2, 8)
  traced = symmem.trace(transformer.make_train_step(cfg), *args,
                        polymorphic_shapes=(None, "b, s", "b, s"), constraints=CONSTRAINTS)
  return traced, symmem.shape_graph(traced)


def reference_executor(batch: int, seq: int, order: str = "trace"):
  """The transformer step run op by op by the reference executor, in the given order."""
  traced, graph = traced_step()
  sched = None if order == "trace" else schedule.schedule(graph, symbolic=(order != "ablation")).order
  args = transformer.example_args(CONFIG, batch, seq)
  prof = memory.profile(graph, order=sched)
  dims = {"b": batch, "s": seq}
  extra = {"model_peak": prof.peak_bytes(**dims),
           "model_arguments": prof.arguments.evaluate(graph.constraints.complete(dims))}
  def run(*a):
    return executor.execute(traced, a, order=sched).outputs
  return run, args, extra


def compiled_step(batch: int, seq: int, mode: str = "default", min_mib: float = 1.0):
  """The transformer step compiled by XLA: its own schedule, or our order fenced in.

  mode: "default" (XLA:CPU's default scheduler), "memory_optimized"
  (CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED), "trace_fenced" / "schedule_fenced" (the
  trace order / the symbolic schedule imposed with optimization barriers on nodes
  whose results take >= min_mib MiB), "schedule_fenced_memopt" (the latter
  compiled with the memory-optimized scheduler).
  """
  from jax_symmem._src import fence
  traced, graph = traced_step()
  args = transformer.example_args(CONFIG, batch, seq)
  flat = jax.tree_util.tree_leaves(args)
  dims = graph.constraints.complete({"b": batch, "s": seq})
  if mode in ("default", "memory_optimized"):
    opts = ({"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
            if mode == "memory_optimized" else {})
    fn = jax.jit(lambda *a: jax.tree_util.tree_leaves(
        transformer.make_train_step(CONFIG)(*jax.tree_util.tree_unflatten(traced.in_tree, a))))
  else:
    order = (tuple(range(len(traced.program.nodes))) if mode.startswith("trace_fenced")
             else schedule.schedule(graph).order)
    program = traced.specialize(**dims)
    sizes = {v: graph.bytes(v).evaluate(dims) for v in graph.values}
    significant = fence.significant_nodes(sizes, program, int(min_mib * _common.MiB))
    fn = jax.jit(fence.ordered_function(program, order, significant))
    opts = dict(fence.FENCE_COMPILER_OPTIONS)
    if mode.endswith("_memopt"):
      opts["xla_cpu_scheduler_type"] = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
  compiled = fn.lower(*flat).compile(compiler_options=opts)
  return compiled, flat, _common.xla_memory(compiled)


def reference_executor_cached(batch: int, seq: int, order: str = "trace"):
  """`reference_executor` with the program specialized once and reused by every call.

  `executor.execute` specializes the program on each call, and specializing
  re-creates scatter-add's `update_jaxpr` param (a Jaxpr, compared by identity),
  so JAX recompiles every scatter-add in every call, the measured one included.
  Reusing one specialized program keeps the F3 warm-up effective.
  """
  traced, graph = traced_step()
  fn, args, extra = reference_executor(batch, seq, order)
  sched = None if order == "trace" else schedule.schedule(graph, symbolic=(order != "ablation")).order
  program = traced.specialize(**traced.bind_dims(*args))
  flat = [jnp.asarray(a) for a in jax.tree_util.tree_leaves(tuple(args))]
  def run(*_):
    return executor.run_tracked(program, flat, order=sched)[0]
  return run, args, extra


# --- experiments/bench_remat.py: symmem.jit under a budget vs jax.checkpoint -------------------

REMAT_SHAPES = (None, "b, s", "b, s")


def remat_baseline_step(batch: int, seq: int, cfg: dict, policy=None, fenced: bool = True):
  """The transformer step under plain jax.jit: no remat (policy None) or per-layer
  jax.checkpoint ("layer" or a jax.checkpoint_policies name), compiled with
  _common.REMAT_FENCE_OPTIONS when `fenced` (ignored without a policy)."""
  config = transformer.Config(**cfg)
  args = transformer.example_args(config, batch, seq)
  opts = dict(_common.REMAT_FENCE_OPTIONS) if (policy is not None and fenced) else {}
  compiled = jax.jit(transformer.make_train_step(config, remat_policy=policy)).lower(
      *args).compile(compiler_options=opts)
  extra = {"argument_bytes": _common.tree_bytes(args), "xla": _common.xla_memory(compiled),
           "compiler_options": opts}
  return compiled, args, extra


def remat_symmem_step(batch: int, seq: int, cfg: dict, budget: int, constraints):
  """The transformer step under symmem.jit with `memory_budget=budget`.

  Calls it once here (tracing, analysis, compile), so `extra` names the dispatched
  round and XLA's memory_analysis() of its executable; every later call (the warm-up
  and the measured one) appends the cache counters, so the report shows whether the
  measured call was a cache hit of that same executable.
  """
  import logging as py_logging
  import time
  from absl import logging as absl_logging
  compiled_log = []   # symmem.jit logs XLA's footprint of every (dims, round) it compiles

  class _Collect(py_logging.Handler):
    def emit(self, record):
      msg = record.getMessage()
      if "jax_symmem: compiled" in msg:
        compiled_log.append(msg)
  absl_logging.set_verbosity(absl_logging.INFO)
  py_logging.getLogger("absl").addHandler(_Collect())
  config = transformer.Config(**cfg)
  step = symmem.jit(transformer.make_train_step(config), polymorphic_shapes=REMAT_SHAPES,
                    constraints=tuple(constraints), memory_budget=budget)
  args = transformer.example_args(config, batch, seq)
  t0 = time.perf_counter()
  jax.block_until_ready(step(*args))
  first_call_s = time.perf_counter() - t0
  dims = {"b": batch, "s": seq}
  (variant,) = step.compiled(**dims)
  analysis = step.analyze(*args)
  k = variant.round
  extra = {
      "argument_bytes": _common.tree_bytes(args),
      "round": k,
      "model_round": analysis.choose_round(dims, budget),
      "n_rounds": len(analysis.rounds),
      "model_peak_dispatched": analysis.rounds[k].peak_at(dims),
      "xla": _common.xla_memory(variant.executable),
      "first_call_s": first_call_s,
      "cache_info": [step.cache_info()],
      "executables": [[sorted(v.dims.items()), v.round] for v in step.compiled()],
      "compiled_log": compiled_log,
  }

  def run(*a):
    out = step(*a)
    extra["cache_info"].append(step.cache_info())
    return out
  return run, args, extra
