"""Models as people write them: model vs XLA, reach, and symmem.jit under a budget.

For each training step (AdamW, masked loss) and three shapes up to the longest,
this prints and writes to experiments/results/bench_models.json:

1. model vs XLA: the modeled peak of round 0 against XLA's `memory_analysis()`
   footprint of the same step compiled as symmem.jit compiles it under a budget
   (jax.jit's options with XNNPACK for single dots only, so XLA sees every buffer, DESIGN.md F2;
   also recorded: with the memory-optimized scheduler); goal: within 10 % + 8 MiB;
   beside it the footprint symmem.jit decides by (`Analysis.round_footprint`);
2. reach: the smallest real peak the planner reaches (its last round's, or that of its
   least-memory round at the length, `Analysis.floor_round`, where that is another)
   against that of the model with `jax.checkpoint` (`nn.remat`) on each layer
   (compiled with barriers kept, F1); goal <= 1.05;
3. under a budget of 1.25 x the per-layer checkpoint's real peak at the longest
   shape: symmem.jit's real peak (goal: <= budget x 1.05 + 8 MiB), the round it
   dispatched, its compiles, step time vs per-layer checkpointing (goal <= 1.00 at
   the longest shape, lower at the shorter; also against per-layer checkpointing
   compiled with the budget's options, XNNPACK for single dots only) and vs jax.jit where
   jax.jit's real peak fits (goal <= 1.05), and losses / updated parameters vs jax.jit's
   (where they differ, how far: `_common.deviation`, beside per-layer checkpointing's own
   distance from jax.jit).

Real peaks follow DESIGN.md F3 (jax_symmem.measure: a fresh process per figure,
peak above resident memory plus the argument bytes). Step times are measured in
one process, interleaved: each pass runs every variant once on the same batch;
the median over passes is reported, and beside it the ratio of the fastest
passes (`*_min`: on a shared machine other processes only add time). On the CPU the
timing process restarts itself with glibc's malloc on transparent huge pages
(`_common.restart_with_huge_pages`: with 4 KiB pages the kernel's zeroing of each
step's fresh temporaries makes time grow with memory); `--nohuge_pages` times as
before 2026-12-03 (night).

    python -m experiments.bench_models                 # every workload
    python -m experiments.bench_models --workloads=llama_scan,t5 --passes=5
    python -m experiments.bench_models --workloads=eqx_scan --speed_trials   # symmem.jit's
        # speed_trials=True: each shape also times the last round and keeps the faster

On a GPU (the device check of DEVELOPERS.md), the same script with `--geometry=gpu`
(4x wider, 2x deeper, 2x the batch, 4x the lengths) runs the same rows: per-layer
checkpointing and every variant compile with XLA's GPU defaults (barriers survive
there until after scheduling, and there are no XNNPACK fusions), real peaks come from
the device allocator (`jax_symmem.measure`), and the fresh processes reuse the
parent's plans and compiled executables through a plan cache and JAX's compilation
cache in a temporary directory:

    python -m experiments.bench_models --geometry=gpu --workloads=llama_scan,t5 --passes=5 \
        --out=$OUT/bench_models_gpu.json

`experiments/gpu_check.sh` runs it one workload per time-limited stage (the device's
15 minutes) and writes each workload's JSON and log under $OUT.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Callable

from absl import app
from absl import flags
import jax

from experiments import _common
from experiments._common import MiB
import jax_symmem as symmem
from jax_symmem._src import variants

FENCE = _common.REMAT_FENCE_OPTIONS   # keep jax.checkpoint on the CPU (F1)
BUDGET_XNNPACK = variants.FAST_PATH_CPU_OPTIONS   # what every budgeted variant adds on CPU


@dataclasses.dataclass(frozen=True)
class Geometry:
  """How big each step is: width, depth (T5: half encoder, half decoder), heads, vocabulary,
  batch (gradient accumulation: two microbatches of half) and the three lengths."""
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  vocab: int = 2048
  batch: int = 4
  lengths: tuple[int, ...] = (128, 256, 512)


GEOMETRIES = {
    "cpu": Geometry(),   # this 2-core machine: the README's tables
    "gpu": Geometry(d_model=1024, n_layers=8, n_heads=8, vocab=8192, batch=8,
                    lengths=(512, 1024, 2048)),
}
WORKLOADS_FLAG = flags.DEFINE_list("workloads", None, "subset of workloads (default: all)")
HUGE_PAGES = flags.DEFINE_bool(
    "huge_pages", True, "on the CPU, time in a process whose malloc asks for transparent huge "
    "pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; real peaks are measured without)")
GEOMETRY = flags.DEFINE_enum("geometry", "cpu", list(GEOMETRIES), "the steps' sizes")
PASSES = flags.DEFINE_integer("passes", 3, "interleaved timing passes per shape")
QUICK = flags.DEFINE_bool("quick", False, "smoke run: lengths divided by 4")
SPEED_TRIALS = flags.DEFINE_bool(
    "speed_trials", False, "symmem.jit(speed_trials=True): a recurring shape times its round "
    "against the last round and keeps the faster")
OUT = flags.DEFINE_string("out", "experiments/results/bench_models.json", "results file")


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  step: Callable          # remat_policy (None / "layer") -> pure (state, *batch) -> (state, loss)
  state: Callable         # () -> state
  batch: Callable         # (length) -> batch arrays at this workload's batch size
  dims: Callable          # (length) -> {dim: size}
  shapes: tuple           # polymorphic shapes of (state, *batch)
  constraints: tuple
  lengths: tuple          # three lengths, the last the longest allowed


def _llama_config(g: Geometry):
  from jax_symmem.examples import llama
  d_ff = -(-8 * g.d_model // 3 // 16) * 16   # 8/3 d_model, a multiple of 16 (688 at 256)
  return llama.LlamaConfig(vocab=g.vocab, d_model=g.d_model, n_layers=g.n_layers,
                           n_heads=g.n_heads, d_ff=d_ff, max_len=g.lengths[-1])


def _token_workload(name, g: Geometry, step, state, batch, shapes=(None, "b, s", "b, s")):
  from jax_symmem.examples import llama
  return Workload(name, step, state, batch, lambda s: {"b": g.batch, "s": s}, shapes,
                  llama.step_constraints(g.lengths[-1], g.batch), g.lengths)


def _llama(scan: bool, annotated: bool = False, g: Geometry = Geometry()) -> Workload:
  from jax_symmem.examples import llama
  cfg = _llama_config(g)
  name = "llama" + ("_scan" if scan else "") + ("_remat" if annotated else "")
  return _token_workload(
      name, g, lambda policy: llama.train_step_fn(llama.Llama(cfg, policy or (
          "layer" if annotated else None), scan)),
      lambda: llama.init_state(cfg, scan_layers=scan),
      lambda s: llama.example_batch(cfg, g.batch, s))


def _llama_accum(scan: bool = False, g: Geometry = Geometry()) -> Workload:
  # Gradient accumulation: the step scans over m = 2 microbatches of half the batch (the
  # same sequences per update as the other workloads); per-layer checkpointing is
  # nn.remat on each layer inside the microbatch's forward pass. With `scan`, the layers
  # are an nn.scan inside each microbatch's pass (a scan pair inside the body).
  from jax_symmem.examples import llama
  cfg = _llama_config(g)
  half = g.batch // 2
  def batch(s):
    return tuple(x.reshape(2, half, s) for x in llama.example_batch(cfg, g.batch, s))
  return Workload(
      "llama_scan_accum" if scan else "llama_accum",
      lambda policy: llama.accumulating_train_step_fn(llama.Llama(cfg, policy, scan)),
      lambda: llama.init_state(cfg, scan_layers=scan), batch,
      lambda s: {"m": 2, "b": half, "s": s}, (None, "m, b, s", "m, b, s"),
      llama.step_constraints(g.lengths[-1], g.batch) + ("m <= 4",), g.lengths)


def _moe_scan(g: Geometry = Geometry()) -> Workload:
  # A sparse Mixture-of-Experts decoder (GShard / Switch top-2 routing, 4 SwiGLU experts of
  # the Llama MLP's width, capacity factor 1.25: dispatch tensors b * s * 4 * ceil(5s/8))
  # with its layers under nn.scan; per-layer checkpointing is nn.remat on the scanned layer.
  from jax_symmem.examples import moe
  cfg = moe.MoEConfig(**dataclasses.asdict(_llama_config(g)))
  return _token_workload(
      "moe_scan", g, lambda policy: moe.train_step_fn(moe.MoE(cfg, policy, scan_layers=True)),
      lambda: moe.init_state(cfg, scan_layers=True),
      lambda s: moe.example_batch(cfg, g.batch, s))


def _gpt2_config(g: Geometry):
  from jax_symmem.examples import gpt2
  return gpt2.GPT2Config(vocab=g.vocab, d_model=g.d_model, n_layers=g.n_layers,
                         n_heads=g.n_heads, d_ff=4 * g.d_model, max_len=g.lengths[-1])


def _gpt2(g: Geometry = Geometry()) -> Workload:
  from jax_symmem.examples import gpt2, llama
  cfg = _gpt2_config(g)
  return _token_workload(
      "gpt2", g, lambda policy: llama.train_step_fn(gpt2.GPT2(cfg, policy)),
      lambda: gpt2.init_state(cfg), lambda s: gpt2.example_batch(cfg, g.batch, s))


def _gpt2_layerdrop(g: Geometry = Geometry()) -> Workload:
  # LayerDrop (p = 0.2): each GPT-2 layer runs under nn.cond on its own draw, so AD makes
  # a forward/backward cond pair per layer; per-layer checkpointing is nn.remat on each
  # layer inside its cond. The key is part of the batch (one per length): every variant
  # skips the same layers.
  from jax_symmem.examples import gpt2
  cfg = _gpt2_config(g)
  return _token_workload(
      "gpt2_layerdrop", g,
      lambda policy: gpt2.layer_drop_train_step_fn(gpt2.GPT2(cfg, policy, layer_drop=0.2)),
      lambda: gpt2.init_state(cfg),
      lambda s: (*gpt2.example_batch(cfg, g.batch, s), jax.random.key(s)),
      (None, "b, s", "b, s", None))


def _gpt2_dropout(g: Geometry = Geometry()) -> Workload:
  # Dropout 0.1 where GPT-2 has it (embeddings, attention probabilities, residual
  # branches), as fine-tuning recipes keep it; per-layer checkpointing is nn.remat on each
  # layer, which draws the same masks again in the backward pass. The key is part of
  # the batch (one per length): every variant draws the same masks.
  from jax_symmem.examples import gpt2
  cfg = dataclasses.replace(_gpt2_config(g), dropout=0.1)
  return _token_workload(
      "gpt2_dropout", g,
      lambda policy: gpt2.dropout_train_step_fn(gpt2.GPT2(cfg, policy)),
      lambda: gpt2.init_state(cfg),
      lambda s: (*gpt2.example_batch(cfg, g.batch, s), jax.random.key(s)),
      (None, "b, s", "b, s", None))


def _gpt2_scan_dropout(g: Geometry = Geometry()) -> Workload:
  # The dropout GPT-2 with its layers under nn.scan (the dropout stream split per layer,
  # so each layer draws its own masks inside the scan body); per-layer checkpointing is
  # nn.remat on the scanned layer.
  from jax_symmem.examples import gpt2
  cfg = dataclasses.replace(_gpt2_config(g), dropout=0.1)
  return _token_workload(
      "gpt2_scan_dropout", g,
      lambda policy: gpt2.dropout_train_step_fn(gpt2.GPT2(cfg, policy, scan_layers=True)),
      lambda: gpt2.init_state(cfg, scan_layers=True),
      lambda s: (*gpt2.example_batch(cfg, g.batch, s), jax.random.key(s)),
      (None, "b, s", "b, s", None))


def _nnx_scan(g: Geometry = Geometry()) -> Workload:
  from flax import nnx
  from jax_symmem.examples import llama, llama_nnx
  cfg = _llama_config(g)
  def step(policy):
    return llama_nnx.pure_train_step(*llama_nnx.init_state(cfg, scan_layers=True,
                                                           remat_policy=policy))
  return _token_workload(
      "nnx_scan", g, step, lambda: nnx.state(llama_nnx.init_state(cfg, scan_layers=True)),
      lambda s: llama.example_batch(cfg, g.batch, s))


def _nnx_loop(g: Geometry = Geometry()) -> Workload:
  # NNX's layers in a Python loop (`nnx.List`), as Flax's NNX examples write them: NNX
  # pushes no name scopes, so the planner reads the layers from the repeated code.
  from flax import nnx
  from jax_symmem.examples import llama, llama_nnx
  cfg = _llama_config(g)
  def step(policy):
    return llama_nnx.pure_train_step(*llama_nnx.init_state(cfg, remat_policy=policy))
  return _token_workload(
      "nnx_loop", g, step, lambda: nnx.state(llama_nnx.init_state(cfg)),
      lambda s: llama.example_batch(cfg, g.batch, s))


def _eqx_scan(g: Geometry = Geometry()) -> Workload:
  # Equinox's scan over layers (eqx.filter_vmap-built layers under lax.scan, modules on one
  # sequence, the model vmapped over the batch); per-layer checkpointing is
  # eqx.filter_checkpoint on the scanned layer.
  from jax_symmem.examples import gpt_equinox
  cfg = gpt_equinox.GPTConfig(vocab=g.vocab, d_model=g.d_model, n_layers=g.n_layers,
                              n_heads=g.n_heads, d_ff=4 * g.d_model, max_len=g.lengths[-1])
  return _token_workload(
      "eqx_scan", g, lambda policy: gpt_equinox.train_step_fn(cfg, remat_policy=policy),
      lambda: gpt_equinox.init_state(cfg), lambda s: gpt_equinox.example_batch(cfg, g.batch, s))


def _eqx_loop(g: Geometry = Geometry()) -> Workload:
  # The same Equinox GPT with its blocks in a list called in a Python loop (Equinox pushes
  # no name scopes: the planner reads the layers from the repeated code); per-layer
  # checkpointing is eqx.filter_checkpoint on each call.
  from jax_symmem.examples import gpt_equinox
  cfg = gpt_equinox.GPTConfig(vocab=g.vocab, d_model=g.d_model, n_layers=g.n_layers,
                              n_heads=g.n_heads, d_ff=4 * g.d_model, max_len=g.lengths[-1])
  return _token_workload(
      "eqx_loop", g,
      lambda policy: gpt_equinox.train_step_fn(cfg, remat_policy=policy, scan_layers=False),
      lambda: gpt_equinox.init_state(cfg, scan_layers=False),
      lambda s: gpt_equinox.example_batch(cfg, g.batch, s))


def _t5(g: Geometry = Geometry()) -> Workload:
  from jax_symmem.examples import t5
  cfg = t5.PRESETS["small"]   # the CPU tables' T5 (its own vocabulary and head width)
  if g != Geometry():
    cfg = dataclasses.replace(
        cfg, vocab=g.vocab, d_model=g.d_model, n_heads=g.n_heads, d_kv=g.d_model // g.n_heads,
        d_ff=4 * g.d_model, n_enc_layers=g.n_layers // 2, n_dec_layers=g.n_layers // 2,
        max_src_len=g.lengths[-1], max_tgt_len=g.lengths[-1] // 2)
  # Target half the source length, as in summarization-style fine-tuning.
  return Workload(
      "t5", lambda policy: t5.train_step_fn(t5.T5(cfg, policy)), lambda: t5.init_state(cfg),
      lambda s: t5.example_batch(cfg, g.batch, s, s // 2),
      lambda s: {"b": g.batch, "s": s, "t": s // 2}, t5.POLYMORPHIC_SHAPES,
      t5.step_constraints(g.lengths[-1], g.lengths[-1] // 2, g.batch), g.lengths)


def _images(name: str, module, model, cfg, g: Geometry) -> Workload:
  """An image model of `jax_symmem.examples` (resnet, vit, unet: the same batches and
  shapes) on square images of 32, 64 and 128 pixels (its "lengths" are the image side, 8 *
  h = 8 * w pixels), at 4x the geometry's batch; per-layer checkpointing is nn.remat on
  each block (`model(cfg, remat_policy)`)."""
  batch, sides = 4 * g.batch, (32, 64, 128)
  return Workload(
      name, lambda policy: module.train_step_fn(model(cfg, policy)),
      lambda: module.init_state(cfg), lambda side: module.example_batch(cfg, batch, side),
      lambda side: {"b": batch, "h": side // 8, "w": side // 8}, module.POLYMORPHIC_SHAPES,
      module.step_constraints(sides[-1], batch), sides)


def _resnet(g: Geometry = Geometry()) -> Workload:
  # A Flax ResNet with batch norm.
  from jax_symmem.examples import resnet
  return _images("resnet", resnet, resnet.ResNet, resnet.PRESETS["small"], g)


def _unet(g: Geometry = Geometry()) -> Workload:
  # A diffusion UNet (transposed convolutions up, skips, noise drawn in the step).
  from jax_symmem.examples import unet
  return _images("unet", unet, unet.UNet, unet.PRESETS["small"], g)


def _vit(g: Geometry = Geometry()) -> Workload:
  # A Vision Transformer as big_vision writes it (nn.scan over its blocks), 8-pixel
  # patches: 16 to 256 tokens, attention b * heads * (h*w)**2.
  from jax_symmem.examples import vit
  return _images("vit", vit, vit.ViT, vit.PRESETS["small"], g)


# name -> (geometry = the CPU tables') -> Workload
WORKLOADS = {
    "llama": lambda g=Geometry(): _llama(False, g=g),
    "llama_scan": lambda g=Geometry(): _llama(True, g=g),
    "llama_scan_remat": lambda g=Geometry(): _llama(True, annotated=True, g=g),
    "nnx_scan": _nnx_scan, "nnx_loop": _nnx_loop, "eqx_scan": _eqx_scan, "eqx_loop": _eqx_loop, "gpt2": _gpt2,
    "gpt2_layerdrop": _gpt2_layerdrop, "gpt2_dropout": _gpt2_dropout,
    "gpt2_scan_dropout": _gpt2_scan_dropout, "t5": _t5,
    "llama_accum": lambda g=Geometry(): _llama_accum(g=g),
    "llama_scan_accum": lambda g=Geometry(): _llama_accum(scan=True, g=g),
    "resnet": _resnet, "vit": _vit, "unet": _unet, "moe_scan": _moe_scan,
}


# --- one figure per fresh process (jax_symmem.measure calls these) --------------------------


def _footprint(exe) -> int:
  return _common.xla_memory(exe)["footprint"]


def _platform() -> str:
  return jax.devices()[0].platform


def _state(w: Workload):
  """The workload's initial state, built on the host and then put on the device: eager
  initialization on a GPU compiles one kernel per op in every measuring process (about
  50 s for the GPU geometry's T5), and jitting it whole compiled for 2 min 34 s there
  (H200, jax 0.11.2, 2026-12-04)."""
  if _platform() == "cpu":
    return w.state()
  with jax.default_device(jax.devices("cpu")[0]):
    state = w.state()
  return jax.device_put(state, jax.devices()[0])


def _per_layer_options() -> dict:
  """Per-layer checkpointing's XLA options: barriers kept on the CPU (F1); XLA's GPU and
  TPU pipelines drop them only after scheduling, so there they compile as jax.jit does."""
  return dict(FENCE) if _platform() == "cpu" else {}


def measured(workload: str, variant: str, length: int, budget: int = 0, geometry: str = "cpu",
             speed_trials: bool = False):
  """(fn, args, extra) for jax_symmem.measure: `variant` is "jit" (jax.jit), "per_layer"
  (nn.remat on each layer, barriers kept), "last_round" (the planner's last round,
  compiled as symmem.jit compiles it), "floor_round" (its least-memory round at this
  length, `Analysis.floor_round`, compiled the same way) or "symmem" (symmem.jit under
  `budget`, with `speed_trials` as given)."""
  w = WORKLOADS[workload](GEOMETRIES[geometry])
  state = _state(w)
  args = (state, *w.batch(length))
  extra = {"argument_bytes": _common.tree_bytes(args)}
  if variant in ("jit", "per_layer"):
    exe = jax.jit(w.step("layer" if variant == "per_layer" else None)).lower(*args).compile(
        compiler_options=_per_layer_options() if variant == "per_layer" else {})
    return exe, args, dict(extra, xla=_footprint(exe))
  analysis = _analysis(w, state)
  if variant in ("last_round", "floor_round"):
    k = (len(analysis.rounds) - 1 if variant == "last_round"
         else analysis.floor_round(w.dims(length)))
    exe, k = _compile_round(analysis, k, w.dims(length), args)
    flat = jax.tree_util.tree_leaves(args)
    return (lambda *a: exe(*flat)), args, dict(extra, xla=_footprint(exe), round=k)
  step = symmem.jit(w.step(None), polymorphic_shapes=w.shapes, constraints=w.constraints,
                    memory_budget=budget, speed_trials=speed_trials)
  first = _common.settle(step, args)   # the measured call runs the round every later call runs
  info = step.cache_info()
  return step, args, dict(extra, **{k: step.last_call[k]
                                    for k in ("round", "xla_bytes", "xnnpack_fusions")},
                          compiles=first["compiles"], first_round=first["round"],
                          refinements=info["refinements"], total_compiles=info["compiles"])


def _analysis(w: Workload, state=None):
  """The step's analysis, traced on `state` (default: a fresh `w.state()`) and the
  shortest batch."""
  state = w.state() if state is None else state
  return symmem.analyze(w.step(None), state, *w.batch(w.lengths[0]),
                        polymorphic_shapes=w.shapes, constraints=w.constraints)


def _compile_round(analysis, k, dims, args, options=None):
  """Round k at dims, compiled as symmem.jit compiles it under a budget (or with `options`)."""
  if options is None:
    options = variants.round_options(analysis, k, _platform())
  exe = jax.jit(variants.round_function(analysis, k, dims)).lower(
      *jax.tree_util.tree_leaves(args)).compile(compiler_options=options)
  return exe, k


def _real(workload, variant, length, budget=0) -> dict:
  return _common.real_peak("experiments.bench_models:measured", workload=workload,
                           variant=variant, length=length, budget=budget,
                           geometry=GEOMETRY.value, speed_trials=SPEED_TRIALS.value)


# --- the run --------------------------------------------------------------------------------


def run_workload(w: Workload, passes: int) -> dict:
  cpu = _platform() == "cpu"
  state = _state(w)
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  analysis = _analysis(w, state)   # trace and plan (the batch's arrays too)
  plan_s = time.perf_counter() - t0
  longest = w.lengths[-1]
  per_layer_long = _real(w.name, "per_layer", longest)
  budget = int(1.25 * per_layer_long["real"])
  print(f"{w.name}: planned in {plan_s:.1f} s ({len(analysis.rounds) - 1} rounds); budget "
        f"{budget / MiB:.1f} MiB = 1.25 x per-layer checkpoint's real peak at the longest shape",
        flush=True)
  step = symmem.jit(w.step(None), polymorphic_shapes=w.shapes, constraints=w.constraints,
                    memory_budget=budget, speed_trials=SPEED_TRIALS.value)
  ref = jax.jit(w.step(None))
  per_layer = jax.jit(w.step("layer"))
  rows = []
  for length in w.lengths:
    dims = w.dims(length)
    args = (state, *w.batch(length))
    exe0, _ = _compile_round(analysis, 0, dims, args)
    model0, xla0 = analysis.round_peak(0, dims), _footprint(exe0)
    predicted0 = analysis.round_footprint(0, dims)   # what symmem.jit decides by
    xla0_memopt = None
    if cpu:   # the same round with the memory-optimized scheduler (what round 0 compiled
      # with before it took jax.jit's options less XNNPACK): XLA sees every buffer either way
      exe0, _ = _compile_round(analysis, 0, dims, args, variants.CPU_COMPILER_OPTIONS)
      xla0_memopt = _footprint(exe0)
    del exe0
    jit_real = _real(w.name, "jit", length)
    ckpt_real = per_layer_long if length == longest else _real(w.name, "per_layer", length)
    last_real = _real(w.name, "last_round", length)
    # The smallest real peak the planner reaches: its last round's, or its least-memory
    # round's at this length where that is another (rounds planned at smaller dims follow).
    floor = analysis.floor_round(dims)
    floor_real = (last_real if floor == len(analysis.rounds) - 1
                  else _real(w.name, "floor_round", length))
    reach_real = min(last_real["real"], floor_real["real"])
    row = {
        "dims": dims, "model_round0_mib": model0 / MiB, "xla_round0_mib": xla0 / MiB,
        "xla_round0_memopt_mib": xla0_memopt / MiB if cpu else None,
        "model_ok": _common.model_near_xla(model0, xla0),
        "predicted_round0_mib": predicted0 / MiB,
        "predicted_ok": _common.model_near_xla(predicted0, xla0),
        "jit_real_mib": jit_real["real"] / MiB, "per_layer_real_mib": ckpt_real["real"] / MiB,
        "last_round_real_mib": last_real["real"] / MiB,
        "floor_round": floor, "floor_round_real_mib": floor_real["real"] / MiB,
        "reach": reach_real / ckpt_real["real"], "budget_mib": budget / MiB}
    rows.append(row)
    try:
      sym_real = _real(w.name, "symmem", length, budget)
    except RuntimeError as e:   # symmem.jit refused the budget (BudgetError in the child)
      row["symmem_refused"] = str(e).strip().splitlines()[-1]
      print(f"  {dims}: symmem.jit refused: {row['symmem_refused']}; last round real "
            f"{last_real['real'] / MiB:.1f} MiB, per-layer {ckpt_real['real'] / MiB:.1f}",
            flush=True)
      continue
    # Interleaved timing, in this process (per-layer compiled with barriers kept).
    ckpt_exe = per_layer.lower(*args).compile(compiler_options=_per_layer_options())
    fns = {"symmem": step, "per_layer": ckpt_exe}
    if cpu:   # also with the budget's compile options (XNNPACK for single dots only, F2): the
      # planner's choice of what to recompute, apart from what those options cost on CPU
      fns["per_layer_same_options"] = per_layer.lower(*args).compile(
          compiler_options={**FENCE, **BUDGET_XNNPACK})
    if jit_real["real"] <= budget:
      fns["jit"] = ref
    times, fastest = _common.time_interleaved(fns, args, passes)
    timed = dict(step.last_call)   # the round this process ran (its live arrays count)
    # Numerics against jax.jit compiled with the XLA options of the variant that ran: the
    # memory-saving options change reduction order, and AdamW amplifies that on tiny
    # gradients (DESIGN.md; tests/test_loop_remat.py does the same).
    (variant,) = [v for v in step.variants()
                  if v["dims"] == dims and v["round"] == step.last_call["round"]]
    got = step(*args)   # first: a held output would count as other live arrays
    want = ref.lower(*args).compile(compiler_options=variant["compiler_options"])(*args)
    same = _common.trees_close(got, want)
    # Where they differ: how far, beside how far per-layer checkpointing (as timed) is
    # from plain jax.jit: on a GPU, where both compile with XLA's defaults, recomputed ops
    # fuse and round differently, and AdamW's first step turns rounding into sign flips.
    deviation = _common.deviation(got, want)
    del got, want
    ckpt_deviation = _common.deviation(ckpt_exe(*args), ref(*args))
    row.update({
        "symmem_real_mib": sym_real["real"] / MiB,
        "symmem_round": sym_real["round"], "symmem_compiles": sym_real["compiles"],
        # round 0 compiled as jax.jit compiles it, XNNPACK's fusions and all (variants.py)
        "symmem_xnnpack_fusions": sym_real["xnnpack_fusions"],
        "timed_xnnpack_fusions": timed["xnnpack_fusions"],
        "symmem_first_round": sym_real["first_round"],
        "symmem_refinements": sym_real["refinements"],
        "symmem_total_compiles": sym_real.get("total_compiles"),
        "within_budget": sym_real["real"] <= _common.budget_limit(budget),
        "time_vs_per_layer": times["symmem"] / times["per_layer"],
        "time_vs_jit": times["symmem"] / times["jit"] if "jit" in times else None,
        "time_vs_per_layer_min": fastest["symmem"] / fastest["per_layer"],
        "time_vs_per_layer_same_options": (times["symmem"] / times["per_layer_same_options"]
                                           if cpu else None),
        "time_vs_per_layer_same_options_min": (fastest["symmem"]
                                               / fastest["per_layer_same_options"]
                                               if cpu else None),
        "time_vs_jit_min": fastest["symmem"] / fastest["jit"] if "jit" in fastest else None,
        "step_s": times, "step_s_min": fastest, "equal_to_jax_jit": same,
        "deviation_vs_jit": deviation, "per_layer_deviation_vs_jit": ckpt_deviation,
        "timed_round": timed["round"], "timed_reserved_mib": timed["reserved"] / MiB,
        "speed_trials": [t for t in step.speed_trial_results() if t["dims"] == dims]})
    vs_jit = (f"{row['time_vs_jit']:.2f} ({row['time_vs_jit_min']:.2f})" if row["time_vs_jit"]
              else "(jax.jit over)")
    memopt = f" (memory-optimized scheduler {xla0_memopt / MiB:.1f})" if cpu else ""
    same_options = (f"; with the budget's options {row['time_vs_per_layer_same_options']:.2f} "
                    f"({row['time_vs_per_layer_same_options_min']:.2f})" if cpu else "")
    print(f"  {dims}: model {model0 / MiB:.1f} vs XLA {xla0 / MiB:.1f} MiB{memopt} "
          f"[{'ok' if row['model_ok'] else 'OFF'}], predicted {predicted0 / MiB:.1f} "
          f"[{'ok' if row['predicted_ok'] else 'OFF'}]; real: jax.jit {row['jit_real_mib']:.1f}, "
          f"per-layer {row['per_layer_real_mib']:.1f}, last round {row['last_round_real_mib']:.1f} "
          f"(round {floor}: {row['floor_round_real_mib']:.1f}; reach {row['reach']:.2f}), "
          f"symmem {row['symmem_real_mib']:.1f} round "
          f"{row['symmem_round']}{' (XNNPACK fusions)' if row['symmem_xnnpack_fusions'] else ''} "
          f"[{'fits' if row['within_budget'] else 'OVER'}], compiles "
          f"{row['symmem_compiles']} (first call's round {row['symmem_first_round']}, "
          f"{row['symmem_refinements']} refinement compiles on later calls); timed round {row['timed_round']} (other live arrays "
          f"{row['timed_reserved_mib']:.1f} MiB); time vs per-layer {row['time_vs_per_layer']:.2f} "
          f"(fastest passes {row['time_vs_per_layer_min']:.2f}{same_options}), "
          f"vs jax.jit {vs_jit}; equal to jax.jit: {same}"
          + ("" if same else f" (worst leaf {deviation['worst_leaf']:.1e} of its largest, "
             f"{deviation['elements_off']} elements off, first moments "
             f"{deviation['first_moment_worst_leaf'] or 0:.1e}; per-layer checkpointing vs "
             f"jax.jit: {ckpt_deviation['worst_leaf']:.1e}, {ckpt_deviation['elements_off']}, "
             f"{ckpt_deviation['first_moment_worst_leaf'] or 0:.1e})")
          + "".join(f"; speed trial: kept round {t['kept']} (fastest call, s " + ", ".join(
              f"round {r} {v:.3f}" for r, v in sorted(t["fastest_s"].items())) + ")"
                    for t in row["speed_trials"]), flush=True)
  return {"workload": w.name, "plan_s": plan_s, "rounds": len(analysis.rounds) - 1,
          "budget_mib": budget / MiB, "rows": rows}


def main(argv):
  del argv
  if HUGE_PAGES.value and _platform() == "cpu":
    _common.restart_with_huge_pages()   # step times without page faults (see there)
  names = WORKLOADS_FLAG.value or list(WORKLOADS)
  # The fresh measuring processes replay this one's plans (and, off the CPU, where
  # compiling is slow, its executables) instead of planning and compiling again.
  scratch = tempfile.mkdtemp(prefix="bench_models_")
  os.environ.setdefault("JAX_SYMMEM_PLAN_CACHE", os.path.join(scratch, "plans"))
  if _platform() != "cpu":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(scratch, "xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  out = {"results": [], "platform": _platform(), "device": str(jax.devices()[0]),
         "geometry": dataclasses.asdict(GEOMETRIES[GEOMETRY.value])}
  for n in names:   # written after each workload: a long run keeps what it measured
    w = WORKLOADS[n](GEOMETRIES[GEOMETRY.value])
    if QUICK.value:
      w = dataclasses.replace(w, lengths=tuple(s // 4 for s in w.lengths))
    out["results"].append(dict(run_workload(w, PASSES.value), load=os.getloadavg()))
    _common.write_results(OUT.value, out)
  print(f"wrote {OUT.value}")


if __name__ == "__main__":
  app.run(main)
