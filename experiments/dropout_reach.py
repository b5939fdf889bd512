"""Dropout on models nobody here wrote: transformers' Flax BERT and T5, every round's XLA footprint.

`--model bert` (the default): `FlaxBertForMaskedLMModule` (2 layers, hidden 128,
dropout 0.1 on the hidden states and the attention probabilities, as transformers'
configs default) and an AdamW masked-LM step that draws its masks from a key argument,
at b=4, s=512. `--model t5`: `FlaxT5ForConditionalGenerationModule` with its config's
default dropout 0.1 (`experiments.third_party`'s T5: 2+2 layers, d_model 128, relative
position buckets, cross-attention), source "b, s" and target "b, t", at b=4, s=512,
t=256. Plans the step and compiles every round with the options symmem.jit uses under
a budget, printing XLA's `memory_analysis()` footprint of each and the footprint
`symmem.jit` predicts for it (`Analysis.round_footprint`), beside the same model with
transformers' own `gradient_checkpointing=True` (barriers kept, F1) and `jax.jit`'s
step. With `--fixed_random` the planner runs with JAX's random ops treated as not
recomputable, as it did before 431755f, for the comparison.

    python -m experiments.dropout_reach [--model bert|t5] [--fixed_random]

Writes experiments/results/dropout_reach[_t5][_fixed_random].json.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from experiments import _common  # noqa: E402
from experiments._common import MiB  # noqa: E402
import jax_symmem as symmem  # noqa: E402
from jax_symmem._src import remat, variants  # noqa: E402

RANDOM_OPS = frozenset({"random_bits", "random_seed", "random_split", "random_fold_in",
                        "random_wrap", "random_unwrap", "threefry2x32", "iota_2x32_shape"})
B, S = 4, 512


def _bert(gradient_checkpointing: bool):
  from transformers import BertConfig
  from transformers.models.bert.modeling_flax_bert import FlaxBertForMaskedLMModule
  cfg = BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=256, max_position_embeddings=512, type_vocab_size=2,
                   hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
  module = FlaxBertForMaskedLMModule(cfg, dtype=jnp.float32,
                                     gradient_checkpointing=gradient_checkpointing)
  tx = optax.adamw(1e-3)

  def init():
    t = jnp.zeros((1, 4), jnp.int32)
    params = module.init(jax.random.key(0), t, jnp.ones_like(t), jnp.zeros_like(t),
                         jnp.arange(4)[None], None, return_dict=False)["params"]
    return {"params": params, "opt": tx.init(params)}

  def step(state, tokens, key):
    def loss(p):
      b, s = tokens.shape
      logits = module.apply({"params": p}, tokens, jnp.ones_like(tokens), jnp.zeros_like(tokens),
                            jnp.broadcast_to(jnp.arange(s)[None], (b, s)), None, False,
                            return_dict=False, rngs={"dropout": key})[0]
      gold = jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
      return jnp.mean(jax.nn.logsumexp(logits, -1) - gold)
    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

  def call():
    tokens = jnp.asarray(np.random.RandomState(0).randint(5, 512, (B, S)), jnp.int32)
    return (init(), tokens, jax.random.key(1))

  return dict(call=call, step=step, dims={"b": B, "s": S},
              shapes=(None, "b, s", None), constraints=("s >= 2", "s <= 512", "b <= 4"))


def _t5(gradient_checkpointing: bool):
  from experiments import third_party
  from jax_symmem.examples import llama
  m = third_party._t5(gradient_checkpointing, dropout=0.1)
  step = llama.adamw_train_step(m["loss_fn"])

  def call():
    params = m["init"](jax.random.PRNGKey(0))
    state = {"params": params, "opt_state": llama.make_optimizer().init(params)}
    return (state, *m["batch"](B, S, np.random.RandomState(0)))

  return dict(call=call, step=step, dims=m["dims"](B, S), shapes=m["shapes"],
              constraints=m["constraints"])


MODELS = {"bert": _bert, "t5": _t5}


def _footprint(fn, flat, options) -> float:
  return variants.footprint(jax.jit(fn).lower(*flat).compile(options)) / MiB


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=sorted(MODELS), default="bert")
  parser.add_argument("--fixed_random", action="store_true",
                      help="plan with JAX's random ops not recomputable (the planner before 431755f)")
  args = parser.parse_args()
  if args.fixed_random:
    remat.NOT_RECOMPUTABLE = remat.NOT_RECOMPUTABLE | RANDOM_OPS
  m = MODELS[args.model](False)
  checkpointed = MODELS[args.model](True)["step"]
  call = m["call"]()
  flat, tree = jax.tree_util.tree_flatten(call)
  a = symmem.analyze(m["step"], *call, polymorphic_shapes=m["shapes"],
                     constraints=m["constraints"])
  dims = m["dims"]
  rounds = [_footprint(variants.round_function(a, k, dims), flat, variants.round_options(a, k))
            for k in range(len(a.rounds))]
  predicted = [a.round_footprint(k, dims) / MiB for k in range(len(a.rounds))]
  as_flat = lambda f: lambda *x: jax.tree_util.tree_leaves(f(*jax.tree_util.tree_unflatten(tree, x)))
  per_layer = _footprint(as_flat(checkpointed), flat, _common.REMAT_FENCE_OPTIONS)
  jit = _footprint(as_flat(m["step"]), flat, variants.CPU_COMPILER_OPTIONS)
  print(f"transformers {args.model}, dropout 0.1, {dims}; random ops recomputable: "
        f"{not args.fixed_random}; {len(a.rounds) - 1} rounds")
  print("XLA MiB per round (predicted): " + " ".join(
      f"{k}:{x:.1f} ({p:.1f})" for k, (x, p) in enumerate(zip(rounds, predicted))))
  print(f"best round {min(rounds[1:]):.1f} MiB; gradient_checkpointing=True {per_layer:.1f}; "
        f"jax.jit {jit:.1f}")
  name = "dropout_reach" + ("" if args.model == "bert" else f"_{args.model}")
  out = pathlib.Path(__file__).parent / "results" / (
      f"{name}{'_fixed_random' if args.fixed_random else ''}.json")
  print("wrote", _common.write_results(out, {
      "model": args.model, "random_recomputable": not args.fixed_random, "dims": dims,
      "rounds_xla_mib": rounds, "rounds_predicted_mib": predicted,
      "gradient_checkpointing_xla_mib": per_layer, "jax_jit_xla_mib": jit}))


if __name__ == "__main__":
  main()
