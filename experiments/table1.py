"""The paper's Table 1 in JAX: a Llama fine-tuned on CodeAlpaca lengths, four ways.

For each batch size, the same AdamW Llama step runs over length-bucketed batches
of the real CodeAlpaca length distribution (experiments/data), as

  (a) static   every batch padded to the longest bucket; one shape, planned by
               jax_symmem on exact shapes (symmem.jit without symbolic dims);
  (b) jit      dynamic shapes under jax.jit, no rematerialization;
  (c) ckpt     dynamic shapes under jax.jit, per-layer jax.checkpoint (compiled
               with cse_barrier_expander disabled, or XLA:CPU undoes it: F1);
  (d) symmem   dynamic shapes under symmem.jit with the memory budget.

The budget is set per batch size halfway between the real peaks of (b) and (c)
at the longest bucket, so (b) exceeds it: on a device with that much memory it
is the paper's OOM. Reported per variant: the real peak (fresh process, DESIGN.md
F3: VmHWM - VmRSS around one warm call, plus the resident argument bytes) at the
longest bucket (for (d) also the median one) and the memory model's; throughput
(real tokens/s over the same batches, after compiling every shape, and the ratio
to (b)); compiles; and planning time, once for all shapes (d) vs per shape (the
static planner at every distinct shape).

  python -m experiments.table1            # the main job: small embedded default, ~5 min
  python -m experiments.table1 --full     # Llama "small" preset, batch sizes 2 and 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_symmem as symmem
from jax_symmem import measure
from jax_symmem.examples import batching
from jax_symmem.examples import llama

MiB = 2**20
VARIANTS = ("static", "jit", "ckpt", "symmem")
LABELS = {"static": "(a) static, padded", "jit": "(b) jax.jit", "ckpt": "(c) per-layer ckpt",
          "symmem": "(d) symmem.jit"}
REMAT_FENCE_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}   # F1
# The main job's embedded default: small enough for 2 CPU cores in a few minutes.
DEMO_CONFIG = llama.LlamaConfig(vocab=2048, d_model=128, n_layers=2, n_heads=4, d_ff=344,
                                max_len=768)


class PerShapeJit:
  """`jax.jit(fn)` compiled once per argument shape with fixed XLA options."""

  def __init__(self, fn, compiler_options=None):
    self._jitted = jax.jit(fn)
    self._options = dict(compiler_options or {})
    self._compiled = {}

  def __call__(self, *args):
    key = tuple(np.shape(x) for x in jax.tree_util.tree_leaves(args))
    exe = self._compiled.get(key)
    if exe is None:
      exe = self._compiled[key] = self._jitted.lower(*args).compile(
          compiler_options=self._options)
    return exe(*args)

  @property
  def compiles(self) -> int:
    return len(self._compiled)


def pad_to(tokens, mask, length):
  """Pads a batch with masked positions up to `length` (the static variant's shape)."""
  extra = length - tokens.shape[1]
  return (np.pad(tokens, ((0, 0), (0, extra))), np.pad(mask, ((0, 0), (0, extra))))


def build(variant: str, cfg: llama.LlamaConfig, batch: int, budget: int | None, max_len: int):
  """(step, prepare): `step(state, *prepare(tokens, mask))` runs one training step."""
  model = llama.Llama(cfg, "layer" if variant == "ckpt" else None)
  step_fn = llama.train_step_fn(model)
  same = lambda t, m: (t, m)
  if variant == "jit":
    return PerShapeJit(step_fn), same
  if variant == "ckpt":
    return PerShapeJit(step_fn, REMAT_FENCE_OPTIONS), same
  if variant == "symmem":
    return symmem.jit(step_fn, polymorphic_shapes=(None, "b, s", "b, s"),
                      constraints=llama.step_constraints(max_len, batch),
                      memory_budget=budget), same
  if variant == "static":
    return (symmem.jit(step_fn, polymorphic_shapes=(None, None, None), memory_budget=budget),
            lambda t, m: pad_to(t, m, max_len))
  raise ValueError(f"unknown variant {variant!r}")


def workload(variant: str, cfg: dict, batch: int, seq: int, budget: int | None, max_len: int):
  """One warm step at (batch, seq) for jax_symmem.measure (runs in a fresh process)."""
  config = llama.LlamaConfig(**cfg)
  step, prepare = build(variant, config, batch, budget, max_len)
  state = llama.init_state(config)
  tokens, mask = prepare(*map(np.asarray, llama.example_batch(config, batch, seq)))
  args = (state, jnp.asarray(tokens), jnp.asarray(mask))
  extra = {"argument_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(args))}

  def call(*a):
    out = step(*a)
    if isinstance(step, symmem.SymmemFunction):
      extra["round"] = step.last_call["round"]
      extra["xla_bytes"] = step.last_call["xla_bytes"]
      extra["cache_info"] = step.cache_info()
    return out
  return call, args, extra


def measure_real(variant, cfg, batch, seq, budget, max_len) -> dict:
  m = measure.measure("experiments.table1:workload", variant=variant, cfg=cfg, batch=batch,
                      seq=seq, budget=budget, max_len=max_len)
  return dict(m.extra, seq=seq, real=m.peak_delta + m.extra["argument_bytes"])


class Progress:
  """A one-line text progress bar on stderr."""

  def __init__(self, total: int, width: int = 30):
    self.total, self.done, self.width, self.t0 = total, 0, width, time.perf_counter()

  def step(self, label: str) -> None:
    self.done += 1
    filled = self.width * self.done // max(1, self.total)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                     f"{time.perf_counter() - self.t0:6.0f}s  {label:<48.48}")
    if self.done >= self.total:
      sys.stderr.write("\n")
    sys.stderr.flush()


def run_batch_size(cfg: llama.LlamaConfig, batch: int, lengths: np.ndarray, steps: int,
                   pad_multiple: int, progress: Progress) -> dict:
  cfg_kw = dataclasses.asdict(cfg)
  batches = batching.bucket_batches(lengths, batch, pad_multiple, vocab=cfg.vocab, seed=0)
  shapes = sorted({t.shape[1] for t, _ in batches})
  longest, median = shapes[-1], shapes[len(shapes) // 2]
  max_len = longest
  row: dict = {"batch": batch, "buckets": shapes, "batches": len(batches)}

  # Real peaks of (b) and (c) at the longest bucket set the budget.
  real = {}
  for v in ("jit", "ckpt"):
    real[v] = measure_real(v, cfg_kw, batch, longest, None, max_len)
    progress.step(f"b={batch} real peak {LABELS[v]} at s={longest}")
  budget = (real["jit"]["real"] + real["ckpt"]["real"]) // 2
  row["budget"] = budget
  for v in ("static", "symmem"):
    real[v] = measure_real(v, cfg_kw, batch, longest, budget, max_len)
    progress.step(f"b={batch} real peak {LABELS[v]} at s={longest}")
  real["symmem_median"] = measure_real("symmem", cfg_kw, batch, median, budget, max_len)
  progress.step(f"b={batch} real peak {LABELS['symmem']} at s={median}")
  row["real"] = real

  # Throughput over the same batches, every shape compiled first (compile time apart).
  state0 = llama.init_state(cfg)
  # One batch of every bucket first (so every shape is compiled and timed), then in order.
  firsts = list({t.shape[1]: (t, m) for t, m in reversed(batches)}.values())
  run = (firsts + [batches[i % len(batches)] for i in range(steps)])[:max(steps, len(firsts))]
  real_tokens = sum(float(m.sum()) for _, m in run)
  row["variants"] = {}
  for v in VARIANTS:
    step, prepare = build(v, cfg, batch, budget, max_len)
    prepared = [tuple(map(jnp.asarray, prepare(t, m))) for t, m in run]
    t0 = time.perf_counter()
    state, seen = state0, set()
    for t, m in prepared:
      if t.shape not in seen:
        seen.add(t.shape)
        state, loss = step(state, t, m)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t0
    state = state0
    t0 = time.perf_counter()
    for t, m in prepared:
      state, loss = step(state, t, m)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    info = {"compile_and_first_calls_s": compile_s, "seconds": seconds,
            "tokens_per_s": real_tokens / seconds, "final_loss": float(loss),
            "padded_tokens": int(sum(t.size for t, _ in prepared))}
    if isinstance(step, symmem.SymmemFunction):
      info["cache_info"] = step.cache_info()
      info["compiles"] = info["cache_info"]["compiles"]
      info["rounds"] = sorted({(v_["dims"].get("s"), v_["round"]) for v_ in step.variants()},
                              key=lambda x: (x[0] or 0, x[1]))
      info["analysis"] = step.analyze(state0, *prepared[0])
    else:
      info["compiles"] = step.compiles
    row["variants"][v] = info
    progress.step(f"b={batch} {steps} steps {LABELS[v]}")

  # The memory model, and planning once vs per shape.
  sym = row["variants"]["symmem"].pop("analysis")
  static = row["variants"]["static"].pop("analysis")
  dims_long = {"b": batch, "s": longest}
  t0 = time.perf_counter()
  per_shape = {s: sym.static_peak_bytes(b=batch, s=s) for s in shapes}
  row["planning_per_shape_s"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  symmem.analyze(llama.train_step_fn(llama.Llama(cfg)), state0, *map(jnp.asarray, batches[0]),
                 polymorphic_shapes=(None, "b, s", "b, s"),
                 constraints=llama.step_constraints(max_len, batch), memory_budget=budget)
  row["planning_once_s"] = time.perf_counter() - t0
  ckpt = symmem.analyze(llama.train_step_fn(llama.Llama(cfg, "layer")), state0,
                        *map(jnp.asarray, batches[0]), polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=llama.step_constraints(max_len, batch))
  row["model"] = {
      "static": static.peak_bytes(),
      "jit": sym.baseline_peak_bytes(**dims_long),
      "ckpt": ckpt.baseline_peak_bytes(**dims_long),
      "symmem": sym.peak_bytes(**dims_long),
      "symmem_median": sym.peak_bytes(b=batch, s=median),
      "static_planner_at_longest": per_shape[longest],
  }
  row["model_round_per_bucket"] = {s: sym.choose_round({"b": batch, "s": s}, budget)
                                   for s in shapes}
  row["model_curves"] = {s: {"jit": sym.baseline_peak_bytes(b=batch, s=s),
                             "ckpt": ckpt.baseline_peak_bytes(b=batch, s=s),
                             "symmem": sym.peak_bytes(b=batch, s=s),
                             "static_planner": per_shape[s]} for s in shapes}
  progress.step(f"b={batch} model and planning times")
  return row


def checks(rows) -> list[tuple[str, bool, str]]:
  out = []
  for r in rows:
    b, budget, real, model = r["batch"], r["budget"], r["real"], r["model"]
    slack = budget * 1.05 + 8 * MiB
    out.append((f"b={b}: (b) jax.jit over the budget at the longest bucket",
                real["jit"]["real"] > budget, f"{real['jit']['real'] / MiB:.1f} > {budget / MiB:.1f}"))
    for k in ("symmem", "symmem_median"):
      out.append((f"b={b}: (d) symmem.jit within budget x1.05 + 8 MiB at s={real[k]['seq']}",
                  real[k]["real"] <= slack, f"{real[k]['real'] / MiB:.1f} <= {slack / MiB:.1f}"))
    ratio = model["symmem"] / model["static_planner_at_longest"]
    out.append((f"b={b}: model (d)/(a)-planner at the longest shape <= 1.01", ratio <= 1.01,
                f"{ratio:.4f}"))
    out.append((f"b={b}: losses of (a), (c), (d) agree with (b) (rtol 1e-4 after the run)",
                all(abs(r["variants"][v]["final_loss"] - r["variants"]["jit"]["final_loss"])
                    <= 1e-4 * abs(r["variants"]["jit"]["final_loss"]) for v in ("ckpt", "symmem")),
                ", ".join(f"{v} {r['variants'][v]['final_loss']:.5f}" for v in VARIANTS)))
  return out


def print_table(cfg, rows, out=sys.stdout):
  p = lambda *a: print(*a, file=out)
  p(f"\nLlama {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab}, f32, AdamW; "
    f"CodeAlpaca lengths; jax {jax.__version__} on {jax.devices()[0].platform}, "
    f"{os.cpu_count()} CPUs")
  for r in rows:
    jit_tps = r["variants"]["jit"]["tokens_per_s"]
    p(f"\nbatch {r['batch']}: {r['batches']} batches, buckets {r['buckets'][0]}..{r['buckets'][-1]} "
      f"({len(r['buckets'])}), budget {r['budget'] / MiB:.1f} MiB")
    p(f"  {'variant':<20} {'real peak':>10} {'model':>8} {'vs budget':>10} {'tokens/s':>9} "
      f"{'vs (b)':>7} {'compiles':>8}")
    for v in VARIANTS:
      real, model, info = r["real"][v]["real"], r["model"][v], r["variants"][v]
      verdict = "OOM" if real > r["budget"] * 1.05 + 8 * MiB else "fits"
      p(f"  {LABELS[v]:<20} {real / MiB:>8.1f}Mi {model / MiB:>6.1f}Mi {verdict:>10} "
        f"{info['tokens_per_s']:>9.0f} {info['tokens_per_s'] / jit_tps:>7.2f} {info['compiles']:>8}")
    med = r["real"]["symmem_median"]
    p(f"  (d) at the median bucket s={med['seq']}: real {med['real'] / MiB:.1f} MiB, "
      f"model {r['model']['symmem_median'] / MiB:.1f} MiB")
    p(f"  (d) vs (a) at s={r['buckets'][-1]}: real {r['real']['symmem']['real'] / r['real']['static']['real']:.3f}")
    p(f"  (d) rounds per bucket (model): {r['model_round_per_bucket']}")
    p(f"  planning: once {r['planning_once_s']:.1f} s for every shape vs per shape "
      f"{r['planning_per_shape_s']:.1f} s for {len(r['buckets'])} shapes; "
      f"(d)/(a)-planner model at s={r['buckets'][-1]}: "
      f"{r['model']['symmem'] / r['model']['static_planner_at_longest']:.4f}")


def plot(cfg, rows, path) -> bool:
  """Modeled peak per bucket length and the real peaks measured, per batch size (PNG)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:   # the main job installs jax_symmem without matplotlib
    return False
  fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), squeeze=False)
  for ax, r in zip(axes[0], rows):
    xs = sorted(r["model_curves"], key=int)
    curve = lambda k: [r["model_curves"][x][k] / MiB for x in xs]
    x = [int(v) for v in xs]
    ax.plot(x, curve("jit"), "o-", color="tab:red", label="(b) jax.jit, model")
    ax.plot(x, curve("ckpt"), "o-", color="tab:green", label="(c) per-layer ckpt, model")
    ax.plot(x, curve("symmem"), "o-", color="tab:blue", label="(d) symmem.jit, model")
    ax.axhline(r["budget"] / MiB, color="black", ls="--", label="budget")
    for v, marker, color in (("jit", "x", "tab:red"), ("ckpt", "x", "tab:green"),
                             ("symmem", "x", "tab:blue"), ("static", "s", "tab:purple"),
                             ("symmem_median", "x", "tab:blue")):
      m = r["real"][v]
      ax.plot([m["seq"]], [m["real"] / MiB], marker, color=color, ms=9,
              label="(a) static padded, real" if v == "static" else (
                  None if v == "symmem_median" else f"{LABELS[v][:3]} real"))
    ax.set_title(f"batch {r['batch']}")
    ax.set_xlabel("padded sequence length (bucket)")
    ax.set_ylabel("peak memory (MiB)")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"Llama {cfg.n_layers}x{cfg.d_model}, CodeAlpaca buckets: peak memory per step "
               f"({jax.devices()[0].platform}, {os.cpu_count()} CPUs)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--full", action="store_true", help="Llama 'small' preset, batches 2 and 4")
  parser.add_argument("--preset", default=None, help="a llama.PRESETS name (default: embedded)")
  parser.add_argument("--batch_sizes", default=None, help="comma-separated (default 2; full 2,4)")
  parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
  parser.add_argument("--pad_multiple", type=int, default=None, help="default 128; full 64")
  parser.add_argument("--out", default=None)
  a = parser.parse_args(argv)
  cfg = llama.PRESETS[a.preset] if a.preset else (llama.PRESETS["small"] if a.full else DEMO_CONFIG)
  batch_sizes = [int(x) for x in (a.batch_sizes or ("2,4" if a.full else "2")).split(",")]
  steps = a.steps or (48 if a.full else 24)
  out_path = a.out or f"experiments/results/table1{'' if a.full else '_demo'}.json"
  a.pad_multiple = a.pad_multiple or (64 if a.full else 128)
  lengths = batching.load_codealpaca_lengths()
  print(f"CodeAlpaca lengths: {len(lengths)} examples, mean {lengths.mean():.0f}, "
        f"max {lengths.max()}; padding to multiples of {a.pad_multiple}", flush=True)
  progress = Progress(len(batch_sizes) * 10)
  t0 = time.perf_counter()
  rows = [run_batch_size(cfg, b, lengths, steps, a.pad_multiple, progress) for b in batch_sizes]
  print_table(cfg, rows)
  results = checks(rows)
  print()
  for name, ok, detail in results:
    print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
  print(f"\ntotal {time.perf_counter() - t0:.0f} s")
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump({"config": dataclasses.asdict(cfg), "rows": rows, "steps": steps,
               "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in results],
               "jax": jax.__version__, "cpus": os.cpu_count()}, f, indent=1, default=str)
  print(f"wrote {out_path}")
  png = out_path.rsplit(".", 1)[0] + ".png"
  if plot(cfg, rows, png):
    print(f"wrote {png}")
  else:
    print("no plot: matplotlib is not installed (pip install matplotlib)")
  return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
  sys.exit(main())
