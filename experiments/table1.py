"""The paper's Table 1 in JAX: a Llama fine-tuned on CodeAlpaca lengths, four ways.

For each batch size, the same AdamW Llama step runs over length-bucketed batches
of the real CodeAlpaca length distribution (experiments/data), as

  (a) static   every batch padded to the longest bucket; one shape, planned by
               jax_symmem on exact shapes (symmem.jit without symbolic dims);
  (b) jit      dynamic shapes under jax.jit, no rematerialization;
  (c) ckpt     dynamic shapes under jax.jit, per-layer jax.checkpoint (compiled
               with cse_barrier_expander disabled, or XLA:CPU undoes it: F1);
  (d) symmem   dynamic shapes under symmem.jit with the memory budget.

The budget is set per batch size at the longest bucket, halfway between the real
peak of (c) and the lower of (b)'s real peak and the modeled round-0 (no eviction)
peak of (d) (`choose_budget`): (b) exceeds it, so on a device with that much memory
it is the paper's OOM, and (d) must evict there. Reported per variant: the real
peak (fresh process, DESIGN.md F3: VmHWM - VmRSS around one warm call, plus the
resident argument bytes) at the longest bucket (for (d) also the median one) and
the memory model's; throughput (real tokens/s over the same batches after
compiling every shape: several passes, each running the variants in turn, each
batch's median step time per variant, and the ratio to (b)); the rounds (d) ran per bucket
(`step.last_call`); compiles; and planning time, once for all shapes (d) vs per
shape (the static planner at every distinct shape).

  python -m experiments.table1            # the main job: small embedded default, ~3 min
  python -m experiments.table1 --full     # Llama "small" preset, batch sizes 2 and 4
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _common
from experiments._common import MiB
import jax_symmem as symmem
from jax_symmem.examples import batching
from jax_symmem.examples import llama

VARIANTS = ("static", "jit", "ckpt", "symmem")
LABELS = {"static": "(a) static, padded", "jit": "(b) jax.jit", "ckpt": "(c) per-layer ckpt",
          "symmem": "(d) symmem.jit"}
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
    return PerShapeJit(step_fn, _common.REMAT_FENCE_OPTIONS), same
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
  extra = {"argument_bytes": _common.tree_bytes(args)}

  def call(*a):
    out = step(*a)
    if isinstance(step, symmem.SymmemFunction):
      extra["round"] = step.last_call["round"]
      extra["xla_bytes"] = step.last_call["xla_bytes"]
      extra["cache_info"] = step.cache_info()
    return out
  return call, args, extra


def measure_real(variant, cfg, batch, seq, budget, max_len) -> dict:
  return dict(_common.real_peak("experiments.table1:workload", variant=variant, cfg=cfg,
                                batch=batch, seq=seq, budget=budget, max_len=max_len), seq=seq)


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


def choose_budget(real_jit: int, real_ckpt: int, model_round0: int) -> int:
  """The budget: halfway between (c)'s real peak and the lower of (b)'s real peak and
  the modeled round-0 peak of (d), all at the longest bucket.

  Below (b)'s real peak, so `jax.jit` without remat is over it (the paper's OOM);
  below what the model says (d) needs without evictions, so (d) must run a remat
  round there; above (c)'s, so a step that fits exists.
  """
  return _common.budget_between(real_ckpt, min(real_jit, model_round0))


def format_rounds(counts: dict) -> str:
  """{round: batches} -> '0:5 1:2'."""
  return " ".join(f"{k}:{n}" for k, n in sorted(counts.items())) or "-"


def time_interleaved(steps: dict, prepared: dict, buckets: list, state0, passes: int) -> dict:
  """Each pass runs every variant in turn over the same batches, from the same state;
  the order of the variants rotates between passes (so none always follows the same
  other). Every step is timed to completion. Returns per variant: the seconds of each
  step in each pass, the last loss and, for symmem.jit variants, the rounds dispatched
  per bucket in each pass (from `step.last_call`)."""
  out = {v: {"step_seconds": [], "rounds": []} for v in steps}
  names = list(steps)
  for p in range(passes):
    for v in names[p % len(names):] + names[:p % len(names)]:
      step, batches = steps[v], prepared[v]
      symbolic = isinstance(step, symmem.SymmemFunction)
      rounds, seconds = [], []
      state = state0
      for t, m in batches:
        t0 = time.perf_counter()
        state, loss = step(state, t, m)
        jax.block_until_ready((state, loss))
        seconds.append(time.perf_counter() - t0)
        if symbolic:
          rounds.append(step.last_call["round"])
      out[v]["step_seconds"].append(seconds)
      out[v]["final_loss"] = float(loss)
      if symbolic:
        per_bucket: dict = {}
        for s, k in zip(buckets, rounds):
          per_bucket.setdefault(s, {}).setdefault(k, 0)
          per_bucket[s][k] += 1
        out[v]["rounds"].append(per_bucket)
      del state
  return out


def run_batch_size(cfg: llama.LlamaConfig, batch: int, lengths: np.ndarray, steps: int,
                   passes: int, pad_multiple: int, progress: Progress) -> dict:
  cfg_kw = dataclasses.asdict(cfg)
  batches = batching.bucket_batches(lengths, batch, pad_multiple, vocab=cfg.vocab, seed=0)
  shapes = sorted({t.shape[1] for t, _ in batches})
  longest, median = shapes[-1], shapes[len(shapes) // 2]
  max_len = longest
  dims_long = {"b": batch, "s": longest}
  row: dict = {"batch": batch, "buckets": shapes, "batches": len(batches)}
  state0 = llama.init_state(cfg)
  example = tuple(map(jnp.asarray, batches[0]))

  # Real peaks of (b) and (c) at the longest bucket, and (d)'s plan (made once for
  # every shape; it does not depend on the budget), set the budget.
  real = {}
  for v in ("jit", "ckpt"):
    real[v] = measure_real(v, cfg_kw, batch, longest, None, max_len)
    progress.step(f"b={batch} real peak {LABELS[v]} at s={longest}")
  t0 = time.perf_counter()
  plan = symmem.analyze(llama.train_step_fn(llama.Llama(cfg)), state0, *example,
                        polymorphic_shapes=(None, "b, s", "b, s"),
                        constraints=llama.step_constraints(max_len, batch))
  row["planning_once_s"] = time.perf_counter() - t0
  row["model_round0_at_longest"] = plan.round_peak(0, dims_long)
  budget = choose_budget(real["jit"]["real"], real["ckpt"]["real"],
                         row["model_round0_at_longest"])
  row["budget"] = budget
  row["budget_rule"] = ("(real (c) + min(real (b), modeled round-0 peak of (d))) / 2 "
                        "at the longest bucket")
  progress.step(f"b={batch} plan once for every shape; budget")
  for v in ("static", "symmem"):
    real[v] = measure_real(v, cfg_kw, batch, longest, budget, max_len)
    progress.step(f"b={batch} real peak {LABELS[v]} at s={longest}")
  real["symmem_median"] = measure_real("symmem", cfg_kw, batch, median, budget, max_len)
  progress.step(f"b={batch} real peak {LABELS['symmem']} at s={median}")
  row["real"] = real

  # Throughput over the same batches, every shape compiled first (compile time apart).
  # One batch of every bucket first (so every shape is compiled and timed), then in order.
  firsts = list({t.shape[1]: (t, m) for t, m in reversed(batches)}.values())
  run = (firsts + [batches[i % len(batches)] for i in range(steps)])[:max(steps, len(firsts))]
  buckets = [t.shape[1] for t, _ in run]
  real_tokens = sum(float(m.sum()) for _, m in run)
  built, prepared, compile_s = {}, {}, {}
  for v in VARIANTS:
    step, prepare = build(v, cfg, batch, budget, max_len)
    built[v] = step
    prepared[v] = [tuple(map(jnp.asarray, prepare(t, m))) for t, m in run]
    t0 = time.perf_counter()
    state, seen = state0, set()
    for t, m in prepared[v]:
      if t.shape not in seen:
        seen.add(t.shape)
        state, loss = step(state, t, m)
    jax.block_until_ready(state)
    del state
    compile_s[v] = time.perf_counter() - t0
    progress.step(f"b={batch} compile every shape {LABELS[v]}")
  timed = time_interleaved(built, prepared, buckets, state0, passes)
  progress.step(f"b={batch} {passes} interleaved passes x {len(run)} steps")
  row["variants"] = {}
  for v in VARIANTS:
    step, t = built[v], timed[v]
    # Each batch's median over the passes, summed: a burst of other load that slows
    # one pass of a batch does not move it.
    seconds = float(np.sum(np.median(np.array(t["step_seconds"]), axis=0)))
    per_pass = [float(sum(x)) for x in t["step_seconds"]]
    info = {"compile_and_first_calls_s": compile_s[v], "seconds": seconds,
            "seconds_per_pass": per_pass, "step_seconds": t["step_seconds"],
            "tokens_per_s": real_tokens / seconds,
            "tokens_per_s_per_pass": [real_tokens / x for x in per_pass],
            "final_loss": t["final_loss"],
            "padded_tokens": int(sum(x.size for x, _ in prepared[v]))}
    if isinstance(step, symmem.SymmemFunction):
      info["cache_info"] = step.cache_info()
      info["compiles"] = info["cache_info"]["compiles"]
      info["variants"] = step.variants()
      info["rounds_per_pass"] = t["rounds"]
      info["analysis"] = step.analyze(state0, *prepared[v][0])
    else:
      info["compiles"] = step.compiles
    row["variants"][v] = info
  row["steps_per_pass"], row["passes"] = len(run), passes

  # The memory model, and planning once vs per shape.
  sym = row["variants"]["symmem"].pop("analysis")
  static = row["variants"]["static"].pop("analysis")
  t0 = time.perf_counter()
  per_shape = {s: sym.static_peak_bytes(b=batch, s=s) for s in shapes}
  row["planning_per_shape_s"] = time.perf_counter() - t0
  ckpt = symmem.analyze(llama.train_step_fn(llama.Llama(cfg, "layer")), state0, *example,
                        polymorphic_shapes=(None, "b, s", "b, s"),
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


def rounds_run(info: dict) -> dict:
  """{bucket: {round: batches}} of one timed pass when every pass agrees, else summed
  over the passes (with 'passes' > 1 in the result)."""
  per_pass = info["rounds_per_pass"]
  if all(p == per_pass[0] for p in per_pass):
    return {"passes": 1, "per_bucket": per_pass[0]}
  total: dict = {}
  for p in per_pass:
    for s, counts in p.items():
      for k, n in counts.items():
        total.setdefault(s, {}).setdefault(k, 0)
        total[s][k] += n
  return {"passes": len(per_pass), "per_bucket": total}


def checks(rows) -> list[tuple[str, bool, str]]:
  out = []
  for r in rows:
    b, budget, real, model = r["batch"], r["budget"], r["real"], r["model"]
    longest = r["buckets"][-1]
    slack = _common.budget_limit(budget)
    out.append((f"b={b}: (b) jax.jit over the budget at the longest bucket",
                real["jit"]["real"] > budget, f"{real['jit']['real'] / MiB:.1f} > {budget / MiB:.1f}"))
    for k in ("symmem", "symmem_median"):
      out.append((f"b={b}: (d) symmem.jit within budget x1.05 + 8 MiB at s={real[k]['seq']}",
                  real[k]["real"] <= slack, f"{real[k]['real'] / MiB:.1f} <= {slack / MiB:.1f}"))
    long_rounds = [k for p in r["variants"]["symmem"]["rounds_per_pass"]
                   for k, n in p.get(longest, {}).items() for _ in range(n)]
    ran = rounds_run(r["variants"]["symmem"])["per_bucket"].get(longest, {})
    out.append((f"b={b}: (d) runs a remat round > 0 at s={longest} (every timed batch there)",
                bool(long_rounds) and min(long_rounds) > 0, f"rounds {format_rounds(ran)}"))
    ratio = model["symmem"] / model["static_planner_at_longest"]
    out.append((f"b={b}: model (d)/(a)-planner at the longest shape <= 1.01", ratio <= 1.01,
                f"{ratio:.4f}"))
    out.append((f"b={b}: losses of (c), (d) agree with (b) (rtol 1e-4 after the run)",
                all(abs(r["variants"][v]["final_loss"] - r["variants"]["jit"]["final_loss"])
                    <= 1e-4 * abs(r["variants"]["jit"]["final_loss"]) for v in ("ckpt", "symmem")),
                ", ".join(f"{v} {r['variants'][v]['final_loss']:.5f}" for v in VARIANTS)))
  return out


def print_table(cfg, rows, out=sys.stdout):
  p = lambda *a: print(*a, file=out)
  p(f"\nLlama {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab}, f32, AdamW; "
    f"CodeAlpaca lengths; jax {jax.__version__} on {jax.devices()[0].platform}, "
    f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
  for r in rows:
    jit_tps = r["variants"]["jit"]["tokens_per_s"]
    p(f"\nbatch {r['batch']}: {r['batches']} batches, buckets {r['buckets'][0]}..{r['buckets'][-1]} "
      f"({len(r['buckets'])}), budget {r['budget'] / MiB:.1f} MiB = {r['budget_rule']} "
      f"(modeled round-0 peak {r['model_round0_at_longest'] / MiB:.1f} MiB)")
    p(f"  tokens/s: {r['passes']} interleaved passes over the same {r['steps_per_pass']} batches, "
      f"each batch's median step time over the passes; rounds: batches per round in one pass")
    p(f"  {'variant':<20} {'real peak':>10} {'model':>8} {'vs budget':>10} {'tokens/s':>9} "
      f"{'vs (b)':>7} {'compiles':>8}  rounds")
    for v in VARIANTS:
      real, model, info = r["real"][v]["real"], r["model"][v], r["variants"][v]
      verdict = "OOM" if real > _common.budget_limit(r["budget"]) else "fits"
      rounds = "-"
      if "rounds_per_pass" in info:
        run = rounds_run(info)
        total: dict = {}
        for counts in run["per_bucket"].values():
          for k, n in counts.items():
            total[k] = total.get(k, 0) + n
        rounds = format_rounds(total) + (f" (sum of {run['passes']} passes)"
                                         if run["passes"] > 1 else "")
      p(f"  {LABELS[v]:<20} {real / MiB:>8.1f}Mi {model / MiB:>6.1f}Mi {verdict:>10} "
        f"{info['tokens_per_s']:>9.0f} {info['tokens_per_s'] / jit_tps:>7.2f} "
        f"{info['compiles']:>8}  {rounds}")
    ratios = [d / b_ for d, b_ in zip(r["variants"]["symmem"]["tokens_per_s_per_pass"],
                                      r["variants"]["jit"]["tokens_per_s_per_pass"])]
    p(f"  (d)/(b) tokens/s per pass: {' '.join(f'{x:.2f}' for x in ratios)}")
    sym = r["variants"]["symmem"]
    run = rounds_run(sym)
    xla = {}
    for v_ in sym["variants"]:
      xla.setdefault(v_["dims"]["s"], []).append(f"r{v_['round']} {v_['xla_bytes'] / MiB:.1f}")
    summed = " (summed over passes)" if run["passes"] > 1 else ""
    p(f"  (d) per bucket: s, batches per round run{summed}, round the model picks, "
      f"XLA MiB of each compiled round:")
    for s_ in r["buckets"]:
      p(f"    s={s_:<5} {format_rounds(run['per_bucket'].get(s_, {})):<12} "
        f"model r{r['model_round_per_bucket'][s_]}   XLA {', '.join(xla.get(s_, []))}")
    med = r["real"]["symmem_median"]
    p(f"  (d) real peak in a fresh process: s={r['buckets'][-1]} round "
      f"{r['real']['symmem']['round']}, s={med['seq']} round {med['round']}: {med['real'] / MiB:.1f} MiB "
      f"(model {r['model']['symmem_median'] / MiB:.1f} MiB)")
    p(f"  (d) vs (a) at s={r['buckets'][-1]}: real {r['real']['symmem']['real'] / r['real']['static']['real']:.3f}")
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
  except ImportError:   # a main dependency; absent only from a hand-made environment
    return False
  fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.2), squeeze=False)
  for ax, r in zip(axes[0], rows):
    xs = sorted(r["model_curves"], key=int)
    curve = lambda k: [r["model_curves"][x][k] / MiB for x in xs]
    x = [int(v) for v in xs]
    ax.plot(x, curve("jit"), "o-", color="tab:red", label="(b) jax.jit, model")
    ax.plot(x, curve("ckpt"), "o-", color="tab:green", label="(c) per-layer ckpt, model")
    ax.plot(x, curve("symmem"), "o-", color="tab:blue", label="(d) symmem.jit, model")
    if "rounds_per_pass" in r["variants"]["symmem"]:   # the rounds (d) ran, per bucket
      ran = rounds_run(r["variants"]["symmem"])["per_bucket"]
      for xi, yi, s_ in zip(x, curve("symmem"), xs):
        label = "round " + "/".join(str(k) for k in sorted(ran.get(s_, ran.get(int(s_), {}))))
        ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(0, -13),
                    ha="center", fontsize=7, color="tab:blue")
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
  parser.add_argument("--steps", type=int, default=None, help="batches per timed pass")
  parser.add_argument("--passes", type=int, default=9,
                      help="interleaved timed passes (per batch: the median step time)")
  parser.add_argument("--pad_multiple", type=int, default=None, help="default 128; full 64")
  parser.add_argument("--out", default=None)
  a = parser.parse_args(argv)
  cfg = llama.PRESETS[a.preset] if a.preset else (llama.PRESETS["small"] if a.full else DEMO_CONFIG)
  batch_sizes = [int(x) for x in (a.batch_sizes or ("2,4" if a.full else "2")).split(",")]
  steps = a.steps or (48 if a.full else 12)
  out_path = a.out or f"experiments/results/table1{'' if a.full else '_demo'}.json"
  a.pad_multiple = a.pad_multiple or (64 if a.full else 128)
  lengths = batching.load_codealpaca_lengths()
  print(f"CodeAlpaca lengths: {len(lengths)} examples, mean {lengths.mean():.0f}, "
        f"max {lengths.max()}; padding to multiples of {a.pad_multiple}", flush=True)
  progress = Progress(len(batch_sizes) * 12)
  t0 = time.perf_counter()
  rows = [run_batch_size(cfg, b, lengths, steps, a.passes, a.pad_multiple, progress)
          for b in batch_sizes]
  print_table(cfg, rows)
  results = checks(rows)
  print()
  for name, ok, detail in results:
    print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
  usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
  cpu = sum(u.ru_utime + u.ru_stime for u in usage)
  print(f"\ntotal {time.perf_counter() - t0:.0f} s wall, {cpu:.0f} s CPU (this process and its "
        f"measurement processes), load average {os.getloadavg()[0]:.1f}")
  _common.write_results(out_path, {
      "config": dataclasses.asdict(cfg), "rows": rows, "steps": steps, "passes": a.passes,
      "load_average": os.getloadavg(),
      "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in results],
      "jax": jax.__version__, "cpus": os.cpu_count()})
  print(f"wrote {out_path}")
  png = out_path.rsplit(".", 1)[0] + ".png"
  if plot(cfg, rows, png):
    print(f"wrote {png}")
  else:
    print("no plot: matplotlib is not importable (pip install -e . installs it)")
  return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
  sys.exit(main())
