"""Evidence: how the symbolic comparisons were decided on real training steps, and what they buy.

For each workload, one trace of the AdamW training step with symbolic dims
(None for the parameters and optimizer state, "b, s" for tokens and mask) under
the constraints `s >= 2, s <= max_len, b <= max_batch`, then the pipeline of
`symmem.analyze` run stage by stage (shape graph -> schedule -> remat rounds, as
`analysis.analyze_traced` does) so each stage is timed and counted:

* decision counts: every comparison of memory impacts made by the scheduler
  (forward and backward list passes at the main shape of interest) and every
  FLOPs-per-byte ranking comparison of the remat planner, split into decided
  for every shape (GE/LE/EQ), DEPENDS (resolved at the largest shape) and
  fallback (UNKNOWN: the size-blind rule);
* modeled peak (MiB) at b = --batch and each length: trace order; the
  ablation (`schedule(graph, symbolic=False)`: every scheduling choice by the
  size-blind fallback); the symbolic schedule (round 0 as dispatched without a
  budget); the forward list schedule, ablation vs symbolic, alone (where the
  comparisons act) and after the local sink pass; the remat floor (smallest peak over the rounds) on the symbolic and on the
  ablation schedule; and the peak dispatched under a budget of
  --budget_fraction of the trace-order peak at the longest length;
* analysis time per stage (wall, and CPU: the machine may be shared), number
  of nodes, the worker's max RSS.

The ablation switches off symbolic comparison in the scheduler only; the remat
ranking has no switch and compares exactly in both pipelines.

Workloads (each runs in its own process, so a slow one can be cut off):
  llama      jax_symmem.examples.llama PRESETS["small"] (AdamW)
  llama_scan the same with scan_layers=True (nn.scan over stacked layers; the remat
             counts include ranking the scan pair's stacked residuals)
  nnx_scan   the same model in Flax NNX (jax_symmem.examples.llama_nnx, nnx.scan over the
             layers, nnx.Optimizer), as its authors' examples write it
  gpt2       jax_symmem.examples.gpt2 PRESETS["small"]
  hf_llama   HuggingFace transformers' FlaxLlamaModule for causal LM (transformers < 5;
             `pip install -e ".[experiments]"`), a random LlamaConfig of the llama
             preset's geometry, no download; the same loss and AdamW step
  llama2_1b  llama PRESETS["llama2_1b"] (1.26 B parameters, bf16 activations), analysis
             only; skipped with a flag when it exceeds --timeout_1b (it needs about 10
             minutes on 2 shared cores; its full run:
             --workloads llama2_1b --timeout_1b 2400 --out experiments/results/decisions_llama2_1b.json)

  python -m experiments.decisions [--workloads llama,llama_scan,nnx_scan,gpt2,hf_llama,llama2_1b] [--batch 4]
                                  [--lengths 64,256,512,1024] [--max_len 1024] [--max_batch 8]
                                  [--budget_fraction 0.5] [--timeout 1800] [--timeout_1b 300]
                                  [--noablation_remat] [--quick]

Prints a table and writes experiments/results/decisions.json. Shapes only: no
parameter is materialized (`jax.eval_shape`), so the 1 B preset needs no 14 GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "decisions.json"
WORKLOADS = ("llama", "llama_scan", "nnx_scan", "gpt2", "hf_llama", "llama2_1b")
SHAPES = (None, "b, s", "b, s")


# --- workloads: (step, state shapes, description) ------------------------------------------


def _llama_workload(preset: str, scan_layers: bool = False):
  import jax
  from jax_symmem.examples import llama
  cfg = llama.PRESETS[preset]
  state = jax.eval_shape(lambda: llama.init_state(cfg, scan_layers=scan_layers))
  return (llama.train_step_fn(llama.Llama(cfg, scan_layers=scan_layers)), state,
          {"model": f"llama.PRESETS[{preset!r}]" + (", scan_layers=True" if scan_layers else ""),
           "config": dataclasses.asdict(cfg)})


def _nnx_scan_workload(preset: str):
  """The llama preset written in Flax NNX with `nnx.scan` over the layers, stepped as
  `llama_nnx.pure_train_step` (nnx.value_and_grad, nnx.Optimizer) over nnx.state."""
  import jax
  from flax import nnx
  from jax_symmem.examples import llama, llama_nnx
  cfg = llama.PRESETS[preset]
  model, optimizer = llama_nnx.init_state(cfg, scan_layers=True)
  state = jax.eval_shape(lambda: nnx.state((model, optimizer)))
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
  return llama_nnx.pure_train_step(model, optimizer), state, {
      "model": f"llama_nnx.Llama(llama.PRESETS[{preset!r}], scan_layers=True)",
      "config": dataclasses.asdict(cfg), "num_params": int(num_params)}


def _gpt2_workload(preset: str):
  import jax
  from jax_symmem.examples import gpt2, llama
  cfg = gpt2.PRESETS[preset]
  state = jax.eval_shape(lambda: gpt2.init_state(cfg))
  return llama.train_step_fn(gpt2.GPT2(cfg)), state, {"model": f"gpt2.PRESETS[{preset!r}]",
                                                      "config": dataclasses.asdict(cfg)}


def _hf_llama_workload(preset: str):
  """transformers' Flax Llama (a third-party implementation) with the llama preset's geometry.

  The HF module takes (input_ids, attention_mask, position_ids): the mask is the
  batch's padding mask, positions are `arange(s)`; it builds the causal mask by
  slicing a (max_position_embeddings,)^2 table and the rotary angles by gathering
  rows of a (max_position_embeddings, d_head) table.
  """
  import jax
  import jax.numpy as jnp
  import optax
  try:
    import transformers
  except ImportError as e:
    raise ImportError('hf_llama needs transformers < 5: pip install -e ".[experiments]"') from e
  from transformers import LlamaConfig
  from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule
  from jax_symmem.examples import llama
  ours = llama.PRESETS[preset]
  cfg = LlamaConfig(vocab_size=ours.vocab, hidden_size=ours.d_model,
                    intermediate_size=ours.d_ff, num_hidden_layers=ours.n_layers,
                    num_attention_heads=ours.n_heads, num_key_value_heads=ours.n_heads,
                    max_position_embeddings=ours.max_len, rms_norm_eps=ours.norm_eps,
                    rope_theta=ours.rope_theta, tie_word_embeddings=False)
  module = FlaxLlamaForCausalLMModule(cfg, dtype=jnp.float32)
  tx = llama.make_optimizer()

  def init(key):
    t = jnp.zeros((1, 2), jnp.int32)
    params = module.init(key, t, jnp.ones_like(t), jnp.arange(2)[None], return_dict=False)["params"]
    return {"params": params, "opt_state": tx.init(params)}
  state = jax.eval_shape(init, jax.random.PRNGKey(0))

  def train_step(state, tokens, mask):
    def loss_fn(params):
      b, s = tokens.shape
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
      logits = module.apply({"params": params}, tokens, mask.astype(jnp.int32), positions,
                            return_dict=False)[0]
      return llama.next_token_loss(logits, tokens, mask)
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

  return train_step, state, {
      "model": "transformers FlaxLlamaForCausalLMModule", "transformers": transformers.__version__,
      "config": {k: getattr(cfg, k) for k in (
          "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
          "rms_norm_eps", "rope_theta", "tie_word_embeddings")}}


def build(name: str, quick: bool):
  small = "tiny" if quick else "small"
  return {"llama": lambda: _llama_workload(small),
          "llama_scan": lambda: _llama_workload(small, scan_layers=True),
          "nnx_scan": lambda: _nnx_scan_workload(small),
          "gpt2": lambda: _gpt2_workload(small),
          "hf_llama": lambda: _hf_llama_workload(small),
          "llama2_1b": lambda: _llama_workload("llama2_1b")}[name]()


# --- the worker: one workload in this process ------------------------------------------------


def _write(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, default=str)
  os.replace(tmp, path)


def _counts(stats) -> dict:
  return {k: int(stats.get(k, 0)) for k in ("comparisons", "decided", "depends", "fallback")}


@contextlib.contextmanager
def _timed(out: dict, key: str):
  """Records the block's wall and CPU (this process, all threads) seconds under `key`."""
  t, c = time.perf_counter(), time.process_time()
  yield
  out["seconds"][key] = round(time.perf_counter() - t, 3)
  out["cpu_seconds"][key] = round(time.process_time() - c, 3)


def _rss_mib() -> float:
  return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def run_workload(name: str, args, progress: str) -> dict:
  """Traces and analyses one workload; writes the result so far to `progress` after each stage."""
  import collections
  import jax
  import jax.numpy as jnp
  import jax_symmem as symmem
  from jax_symmem._src import analysis as analysis_lib
  from jax_symmem._src import compare as compare_lib
  from jax_symmem._src import memory
  from jax_symmem._src import remat
  from jax_symmem._src import schedule as schedule_lib
  from jax_symmem._src.decider import DecisionCounts
  from jax_symmem._src.errors import BudgetError

  out = {"workload": name, "status": "started", "seconds": {}, "cpu_seconds": {}}
  sec = out["seconds"]
  save = lambda: (out.update(max_rss_mib=_rss_mib()), _write(progress, out))

  save()
  with _timed(out, "build"):
    fun, state, info = build(name, args.quick)
  out.update(info)
  if "num_params" not in out:   # linen-style states keep the parameters under "params"
    out["num_params"] = int(sum(x.size for x in jax.tree_util.tree_leaves(state["params"])))
  out["state_bytes"] = int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)))
  max_len = min(args.max_len, out["config"].get("max_len", args.max_len))
  constraints = ("s >= 2", f"s <= {max_len}", f"b <= {args.max_batch}")
  lengths = [L for L in args.lengths if L <= max_len]
  if not lengths:
    raise ValueError(f"no length in {args.lengths} is within s <= {max_len}")
  out.update(constraints=list(constraints), lengths=lengths, batch=args.batch)
  save()

  tokens = jax.ShapeDtypeStruct((args.batch, lengths[0]), jnp.int32)
  mask = jax.ShapeDtypeStruct((args.batch, lengths[0]), jnp.float32)
  out["status"] = "tracing"
  save()
  with _timed(out, "trace"):
    traced = symmem.trace(fun, state, tokens, mask, polymorphic_shapes=SHAPES,
                          constraints=constraints)
  program = traced.program
  out["nodes"] = len(program.nodes)
  out["primitives"] = dict(collections.Counter(n.name for n in program.nodes).most_common())
  with _timed(out, "shape_graph"):
    graph = symmem.shape_graph(traced)
  out["status"] = "scheduling"
  save()

  # The pipeline of analysis.analyze_traced (no sharding), one stage at a time.
  compare_lib.compare_polys.cache_clear()   # cold: every comparison decided from scratch
  with _timed(out, "schedule"):
    sym = schedule_lib.schedule(graph)
  out["schedule"] = dict(_counts(sym.stats), choices=int(sym.stats["choices"]),
                         winner=sym.source, sink_moves=int(sym.stats.get("sink_moves", 0)),
                         candidates=len(sym.candidates))
  # Every list pass (forward and backward at each shape of interest) with its own
  # counts; Schedule.stats holds their sum, so these equal out["schedule"]'s.
  out["schedule_all_points"] = dict(
      _counts(sum(sym.passes.values(), DecisionCounts()).as_dict()), passes=len(sym.passes))
  out["status"] = "remat"
  save()
  with _timed(out, "remat"):
    rounds, rstats = remat.plan_rounds(graph, sym.order)
  analysis = analysis_lib.Analysis(traced, graph, sym, rounds, None, rstats)
  out["remat"] = dict(_counts(rstats), rounds=int(rstats["rounds"]),
                      regions=sum(len(r.regions) for r in rounds),
                      nodes_last_round=len(rounds[-1].program.nodes))
  out["stats"] = {k: int(v) for k, v in analysis.stats.items()}
  for d in (sec, out["cpu_seconds"]):
    d["analysis"] = round(sum(d[k] for k in ("trace", "shape_graph", "schedule", "remat")), 3)
  out["status"] = "ablation"
  save()

  with _timed(out, "ablation_schedule"):
    abl = schedule_lib.schedule(graph, symbolic=False)
  out["ablation"] = dict(_counts(abl.stats), choices=int(abl.stats["choices"]), winner=abl.source,
                         same_order_as_symbolic=abl.order == sym.order)
  for s in (sym, abl):
    assert schedule_lib.is_valid_order(program, s.order), s.mode
  abl_rounds = None
  if args.ablation_remat:
    with _timed(out, "ablation_remat"):
      abl_rounds, abl_rstats = remat.plan_rounds(graph, abl.order)
    out["ablation"]["remat"] = dict(_counts(abl_rstats), rounds=int(abl_rstats["rounds"]))
  out["status"] = "peaks"
  save()

  # --- modeled peaks per length -----------------------------------------------------------
  t, c = time.perf_counter(), time.process_time()
  trace_order = tuple(range(len(program.nodes)))
  top = {"b": args.batch, "s": lengths[-1]}
  budget = None
  if args.budget_fraction > 0:
    budget = int(args.budget_fraction * memory.peak_at(graph, top, order=trace_order))
  out["budget"] = budget
  budgeted = dataclasses.replace(analysis, memory_budget=budget)
  rows = []
  for L in lengths:
    dims = {"b": args.batch, "s": L}
    peak = lambda order: memory.peak_at(graph, dims, order=order)
    sym_rounds = [analysis.round_peak(k, dims) for k in range(len(rounds))]
    row = {
        "seq": L, "batch": args.batch,
        "trace": analysis.baseline_peak_bytes(**dims),
        "ablation": peak(abl.order_for(graph, dims)),
        "symbolic": analysis.peak_bytes(**dims),
        "forward_ablation": peak(abl.candidates["forward"]),
        "forward_symbolic": peak(sym.candidates["forward"]),
        "forward_sink_ablation": peak(abl.candidates["forward+sink"]),
        "forward_sink_symbolic": peak(sym.candidates["forward+sink"]),
        "backward_ablation": peak(abl.candidates["backward"]),
        "backward_symbolic": peak(sym.candidates["backward"]),
        "remat_floor": min(sym_rounds), "remat_floor_round": sym_rounds.index(min(sym_rounds)),
    }
    if abl_rounds is not None:
      abl_peaks = [row["ablation"]] + [r.peak_at(dims) for r in abl_rounds[1:]]
      row["ablation_remat_floor"] = min(abl_peaks)
      row["ablation_remat_floor_round"] = abl_peaks.index(min(abl_peaks))
    if budget is not None:
      try:
        k = budgeted.choose_round(dims, budget)
        row["budget_round"], row["budget_peak"] = k, budgeted.round_peak(k, dims)
      except BudgetError:
        row["budget_round"], row["budget_peak"] = None, None
      if abl_rounds is not None:
        fits = [k for k, p in enumerate(abl_peaks) if p <= budget]
        row["ablation_budget_round"] = fits[0] if fits else None
        row["ablation_budget_peak"] = abl_peaks[fits[0]] if fits else None
    rows.append(row)
  sec["peaks"] = round(time.perf_counter() - t, 3)
  out["cpu_seconds"]["peaks"] = round(time.process_time() - c, 3)
  out["rows"] = rows
  out["status"] = "done"
  save()
  return out


# --- the driver: one process per workload, a table, the JSON ----------------------------------


def _run_child(name: str, argv: list[str], timeout: float) -> dict:
  fd, progress = tempfile.mkstemp(prefix=f"decisions_{name}_", suffix=".json")
  os.close(fd)
  cmd = [sys.executable, "-m", "experiments.decisions", "--worker", name, "--progress", progress,
         *argv]
  t = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=pathlib.Path(__file__).resolve().parents[1],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    log, _ = proc.communicate(timeout=timeout)
    timed_out = False
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)   # the worker's own session: only what we started
    log, _ = proc.communicate()
    timed_out = True
  wall = round(time.perf_counter() - t, 1)
  try:
    with open(progress) as f:
      res = json.load(f)
  except (OSError, ValueError):
    res = {"workload": name, "status": "no result"}
  for p in (progress, progress + ".tmp"):
    if os.path.exists(p):
      os.remove(p)
  res["wall_seconds"] = wall
  if timed_out:
    res["skipped"] = True
    res["skip_reason"] = (f"exceeded the {timeout:.0f} s limit at stage '{res.get('status')}' "
                          f"(after {wall:.0f} s)")
  elif proc.returncode != 0 or res.get("status") != "done":
    res["failed"] = True
    res["returncode"] = proc.returncode
    res["error"] = "\n".join(log.strip().splitlines()[-25:])
  return res


def _pct(part: int, whole: int) -> str:
  return f"{part:>7} ({part / whole:5.1%})" if whole else f"{part:>7} (   - )"


def _header(caption: str, hdr: str) -> None:
  print()
  print(caption)
  print(hdr)
  print("-" * len(hdr))


def _print(results: list[dict], args) -> None:
  print(f"AdamW training steps traced with symbolic (b, s); batch {args.batch}; jax "
        f"{results[0].get('jax', '')}; {os.cpu_count()} CPUs, load average at start "
        f"{args.load_start}")
  _header("decision counts: decided for every shape / DEPENDS (resolved at the largest shape) / "
          "fallback (UNKNOWN: size-blind rule). schedule: as Analysis.stats reports it (the list "
          "passes at the main shape of interest); sched all: every pass, at every shape of interest; "
          "remat: ranking comparisons over all rounds; ablation: symbolic=False schedule",
          f"{'workload':<10}{'nodes':>7}{'params':>9}{'analysis s':>11} | {'kind':<9}"
          f"{'comparisons':>12}{'decided':>17}{'depends':>17}{'fallback':>17}")
  for r in results:
    name = r["workload"]
    if "schedule" not in r:
      params = f"{r['num_params'] / 1e6:.1f}M" if "num_params" in r else "-"
      done = ", ".join(f"{k} {v:.1f} s" for k, v in r.get("seconds", {}).items())
      why = r.get("skip_reason") or ((r.get("error") or "no output").splitlines() or [""])[-1]
      print(f"{name:<10}{r.get('nodes', '-'):>7}{params:>9}  "
            f"{'SKIPPED' if r.get('skipped') else 'FAILED'}: {why}" + (f" ({done})" if done else ""))
      continue
    params = f"{r['num_params'] / 1e6:.1f}M"
    analysis_s = r["seconds"].get("analysis")   # wall: trace + graph + schedule + remat
    head = (f"{name:<10}{r['nodes']:>7}{params:>9}"
            f"{(f'{analysis_s:.1f}' if analysis_s is not None else '-'):>11} | ")
    kinds = [("schedule", r["schedule"]), ("sched all", r.get("schedule_all_points")),
             ("remat", r.get("remat")), ("ablation", r.get("ablation"))]
    for k, (kind, c) in enumerate(kinds):
      lead = head if k == 0 else " " * (len(head) - 2) + "| "
      if c is None:
        print(lead + f"{kind:<9}{'(not reached: ' + r.get('skip_reason', '') + ')'}")
        continue
      n = c["comparisons"]
      print(lead + f"{kind:<9}{n:>12}{_pct(c['decided'], n):>17}{_pct(c['depends'], n):>17}"
            f"{_pct(c['fallback'], n):>17}")
  print()
  print("seconds per stage, wall (CPU of the worker): trace / shape graph / symbolic schedule / "
        "remat rounds; ablation schedule / ablation remat; the worker's max RSS")
  for r in results:
    s, c = r.get("seconds", {}), r.get("cpu_seconds", {})
    f = lambda k: f"{s[k]:.1f} ({c[k]:.1f})" if k in s else "-"
    print(f"  {r['workload']:<10} {f('trace')} / {f('shape_graph')} / {f('schedule')} / "
          f"{f('remat')}; {f('ablation_schedule')} / {f('ablation_remat')}; "
          f"max RSS {r.get('max_rss_mib', '-')} MiB; wall {r.get('wall_seconds')} s")
    if "ablation" in r:
      print(f"  {'':<10} schedule winner '{r['schedule']['winner']}' of "
            f"{r['schedule']['candidates']} candidates ({r['schedule']['sink_moves']} sink moves); "
            f"ablation winner '{r['ablation']['winner']}'; same order: "
            f"{r['ablation']['same_order_as_symbolic']}; remat: {r['remat']['rounds']} rounds, "
            f"{r['remat']['regions']} regions, {r['remat']['nodes_last_round']} nodes in the last")
  _header("modeled peak, MiB (lower is better): trace order | ablation = symbolic=False schedule | "
          "symbolic schedule (round 0) | forward list schedule alone and after the sink pass, "
          "ablation vs symbolic | remat floor (smallest over the rounds, round) on the ablation / "
          "symbolic schedule | dispatched under the budget (round)",
          f"{'workload':<10}{'seq':>6} | {'trace':>8}{'ablation':>10}{'symbolic':>10}{'sym/tr':>8} | "
          f"{'fwd abl':>9}{'fwd sym':>9}{'f+s abl':>9}{'f+s sym':>9} | {'floor abl':>14}"
          f"{'floor sym':>14} | {'budget':>14}")
  m = lambda x: "-" if x is None else f"{x / MiB:.1f}"
  for r in results:
    for row in r.get("rows", []):
      fa = (f"{m(row['ablation_remat_floor'])} ({row['ablation_remat_floor_round']})"
            if "ablation_remat_floor" in row else "-")
      fs = f"{m(row['remat_floor'])} ({row['remat_floor_round']})"
      bud = (f"{m(row['budget_peak'])} ({row['budget_round']})" if row.get("budget_round") is not None
             else ("over" if "budget_round" in row else "-"))
      print(f"{r['workload']:<10}{row['seq']:>6} | {m(row['trace']):>8}{m(row['ablation']):>10}"
            f"{m(row['symbolic']):>10}{row['symbolic'] / row['trace']:>8.3f} | "
            f"{m(row['forward_ablation']):>9}{m(row['forward_symbolic']):>9}"
            f"{m(row['forward_sink_ablation']):>9}{m(row['forward_sink_symbolic']):>9} | "
            f"{fa:>14}{fs:>14} | {bud:>14}")
    if r.get("budget"):
      print(f"{'':<10}{'':>6}   budget {r['budget'] / MiB:.1f} MiB = {args.budget_fraction} x trace-order "
            f"peak at b={args.batch}, s={r['lengths'][-1]}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workloads", default=",".join(WORKLOADS),
                      help=f"comma-separated, from {', '.join(WORKLOADS)}")
  parser.add_argument("--lengths", default="64,256,512,1024",
                      help="comma-separated sequence lengths (at most --max_len)")
  parser.add_argument("--batch", type=int, default=4, help="batch size of the reported peaks")
  parser.add_argument("--max_len", type=int, default=1024, help="constraint s <= max_len")
  parser.add_argument("--max_batch", type=int, default=8, help="constraint b <= max_batch")
  parser.add_argument("--budget_fraction", type=float, default=0.5,
                      help="budget = this x trace-order peak at (batch, longest length); 0: none")
  _common.add_bool_flag(parser, "ablation_remat", True,
                        "also plan remat rounds on the ablation's schedule")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per workload")
  parser.add_argument("--timeout_1b", type=float, default=300,
                      help="seconds for llama2_1b (skipped with a flag past it)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: tiny presets, s <= 256, lengths 16,64,256, batch 2")
  parser.add_argument("--out", default=str(RESULTS))
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--progress", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.quick and not args.worker:
    args.lengths, args.batch, args.max_len = "16,64,256", 2, 256
  args.lengths = sorted(int(x) for x in str(args.lengths).split(",") if x.strip())

  if args.worker:
    run_workload(args.worker, args, args.progress)
    return 0

  import jax
  names = [w.strip() for w in args.workloads.split(",") if w.strip()]
  unknown = set(names) - set(WORKLOADS)
  if unknown:
    parser.error(f"unknown workloads {sorted(unknown)}")
  args.load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
  child_argv = ["--batch", str(args.batch), "--lengths", ",".join(map(str, args.lengths)),
                "--max_len", str(args.max_len), "--max_batch", str(args.max_batch),
                "--budget_fraction", str(args.budget_fraction),
                "--ablation_remat" if args.ablation_remat else "--noablation_remat"]
  child_argv += ["--quick"] if args.quick else []
  t_start = time.perf_counter()
  results = []
  for name in names:
    timeout = args.timeout_1b if name == "llama2_1b" else args.timeout
    print(f"[{name}] running (limit {timeout:.0f} s) ...", flush=True)
    res = _run_child(name, child_argv, timeout)
    res["jax"] = jax.__version__
    results.append(res)
    state = ("skipped: " + res["skip_reason"]) if res.get("skipped") else (
        "FAILED" if res.get("failed") else "done")
    print(f"[{name}] {state} in {res['wall_seconds']} s", flush=True)
  print()
  _print(results, args)
  runtime = time.perf_counter() - t_start
  print(f"\ntotal runtime: {runtime:.1f} s; load average at end "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()))

  out = {
      "benchmark": "decisions",
      "config": {"workloads": names, "batch": args.batch, "lengths": args.lengths,
                 "max_len": args.max_len, "max_batch": args.max_batch,
                 "budget_fraction": args.budget_fraction, "ablation_remat": args.ablation_remat,
                 "timeout": args.timeout, "timeout_1b": args.timeout_1b, "quick": args.quick,
                 "polymorphic_shapes": ["None", "b, s", "b, s"]},
      "environment": {"transformers": _common.package_version("transformers"),
                      "load_average_start": args.load_start},
      "results": results,
      "runtime_seconds": round(runtime, 1),
  }
  print(f"wrote {_common.write_results(args.out, out)}")
  return 1 if any(r.get("failed") for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
