"""Models nobody here wrote: nineteen of transformers' Flax models (twenty-four steps), a
Haiku decoder (three steps) and keras-hub's Llama under symmem.jit.

Each step is the model's own Flax module (transformers < 5, `pip install -e ".[experiments]"`;
a small random config, no download), or a Haiku module written as Haiku's examples write one,
with AdamW and a masked token loss:

  t5    FlaxT5ForConditionalGenerationModule: relative position buckets, cross-attention,
        source "b, s" and target "b, t" (t = s / 2)
  gpt2  FlaxGPT2LMHeadModule: learned positions, a causal mask sliced from a table
  bart  FlaxBartForConditionalGenerationModule: learned positions, "b, s" and "b, t",
        padded rows in both
  bert  FlaxBertForMaskedLMModule: token types, padded rows, a masked-LM loss over 15 % of
        the real tokens
  albert  FlaxAlbertForMaskedLMModule: one layer's weights shared by its 4 layers (one
        Flax module called once per layer, so every layer has the same scope), factorized
        embeddings; BERT's batch and loss
  mistral  FlaxMistralForCausalLMModule: grouped-query attention, rotary positions, a
        sliding window of 128 (below the longer lengths), padded rows
  gpt2_bf16, mistral_bf16  the same GPT-2 and Mistral computing in bfloat16 (the modules'
        `dtype`; parameters and optimizer state float32)
  t5_dropout  the same T5 with its config's default dropout (0.1, on the hidden states
        and the attention probabilities) drawn from a key passed with each batch
  t5_checkpointed, bert_checkpointed  the same T5 and BERT with the library's own
        `gradient_checkpointing=True` (each layer under its `nn.remat`, as a user turns it
        on against running out of memory)
  gpt_neo  FlaxGPTNeoForCausalLMModule: global and local (window 64) attention layers in turn
  opt   FlaxOPTForCausalLMModule: learned positions offset by the padding (a cumulative sum
        of the mask)
  gptj  FlaxGPTJForCausalLMModule: rotary positions on the first 16 dims of each head,
        attention and MLP in parallel
  xglm  FlaxXGLMForCausalLMModule: sinusoidal positions from a table
  gemma  FlaxGemmaForCausalLMModule: grouped-query attention, a head width of its own,
        tanh-approximated GELU gates
  bloom  FlaxBloomForCausalLMModule: ALiBi biases made from the attention mask
  (each of the last six with padded rows)
  longt5  FlaxLongT5ForConditionalGenerationModule with transient-global attention: the
        source padded into blocks of 33, so declared "s == 33*k" (lengths 66, 264, 528)
  wav2vec2  FlaxWav2Vec2ForCTCModule: raw audio "b, n" through 7 strided convolutions
        (total stride 320, declared "n == 320*k"; 1, 4 and 10 s at 16 kHz), optax's CTC
        loss over labels "b, u" (a scan over the frames), padded rows
  roformer  FlaxRoFormerForMaskedLMModule: rotary positions; BERT's batch and loss
  pegasus  FlaxPegasusForConditionalGenerationModule: sinusoidal positions, pre-norm
        layers; BART's batches
  big_bird  FlaxBigBirdForMaskedLMModule with block-sparse attention (blocks of 16 gathered
        by index; declared "s == 16*k", lengths 256, 384, 512); BERT's batch and loss
  whisper  FlaxWhisperForConditionalGenerationModule: a convolutional encoder over log-mel
        features of the library's fixed length ("b, _, _"), a decoder over "b, t" (t = 32,
        128, 256) attending to it, padded rows
  clip  FlaxCLIPModule: a ViT over fixed-size images ("b, _, _, _") and a causal text
        transformer over padded captions ("b, s"), pooled at each caption's end token;
        the symmetric contrastive loss over the batch's b x b similarities
  haiku  a Haiku decoder (dm-haiku): `hk.MultiHeadAttention` with a causal and padding
        mask, 4 pre-norm layers in a Python loop, padded rows
  haiku_stack, haiku_stack_remat  the same layers in `hk.layer_stack` (a scan over stacked
        weights), and with each under `hk.remat` (timed as the checkpointed models are)
  keras_llama  keras-hub's LlamaBackbone on Keras' JAX backend, trained through
        `stateless_call` (`pip install keras-hub` first; not run by default)

For each, at three shapes up to the longest: `symmem.jit` without a budget against
`jax.jit` (they compile alike, so the updated state must be equal), then under budgets
a fraction of the way from the plan's last round to round 0 (modeled peaks at the longest
shape): the round each shape runs once its refinements are done, XLA's footprint of that
variant, the compiles, and the updated state against `jax.jit` compiled with the
variant's XLA options (rtol 1e-5, atol 1e-6; otherwise the largest difference, the
elements off and the worst leaf of AdamW's first moments, which compare the gradients
before the update (`_common.deviation`), beside the spread between `jax.jit` with those
options and with its defaults, for scale). For
the checkpointed models also the step time against the same step under `jax.jit`, which
recomputes every layer at every shape, as `jax.jit` compiles it and with the variant's XLA
options (median and fastest of `--passes` interleaved passes): where memory allows, the
plan runs the step without that recomputation.

With `--device_limit F` each model runs instead without a budget under a simulated device
limit: what other live arrays hold plus F times jax.jit's footprint at the longest length
(XLA's memory_analysis()), so that jax.jit would not fit there. The CPU reports no limit, so
the one symmem.jit reads is replaced for the run (`jit._device_memory`); on a GPU that limit
is the device's own (`experiments.device_limit`). Per length: the round that ran, whether the
plan had been made by then (the step as written runs unplanned where XLA's figure fits), the
compiles, XLA's figure against the limit, and the updated state against jax.jit with the
variant's options. Writes experiments/results/third_party_device_limit.json by default.

  python -m experiments.third_party [--models t5,gpt2,bart,bert,albert,mistral,t5_dropout,t5_checkpointed,bert_checkpointed,
                                               gpt2_bf16,mistral_bf16,gpt_neo,opt,gptj,xglm,gemma,bloom,longt5,
                                               wav2vec2,roformer,pegasus,big_bird,whisper,clip,haiku,
                                               haiku_stack,haiku_stack_remat,keras_llama]
      [--fractions 0.1,0.3,0.6] [--passes 5] [--speed_trials] [--device_limit F]

Writes experiments/results/third_party.json (or --out).
"""

from __future__ import annotations

import argparse
import functools
import time
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import _common
from experiments._common import MiB
import jax_symmem as symmem
from jax_symmem._src import device
from jax_symmem._src import jit as jit_lib
from jax_symmem._src import variants
from jax_symmem.examples import llama
from jax_symmem.examples import t5


def _numpy_with_old_clip():
  """transformers 4.57's T5 calls `jnp.clip(x, a_max=...)`, which jax 0.10 removed: its
  module gets a jax.numpy whose clip also takes the old keywords (nothing else changes)."""
  compat = types.ModuleType("jax.numpy")
  compat.__dict__.update(vars(jnp))
  compat.clip = lambda x, a_min=None, a_max=None, **kw: jnp.clip(
      x, kw.pop("min", a_min), kw.pop("max", a_max), **kw)
  return compat


def _t5(gradient_checkpointing: bool = False, dropout: float = 0.0):
  from transformers import T5Config
  from transformers.models.t5 import modeling_flax_t5
  modeling_flax_t5.jnp = _numpy_with_old_clip()
  cfg = T5Config(vocab_size=512, d_model=128, d_kv=32, d_ff=256, num_layers=2,
                 num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, dropout_rate=dropout,
                 decoder_start_token_id=0, pad_token_id=0)
  module = modeling_flax_t5.FlaxT5ForConditionalGenerationModule(
      cfg, dtype=jnp.float32, gradient_checkpointing=gradient_checkpointing)

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, t, jnp.ones_like(t), t, jnp.ones_like(t))["params"]

  def loss_fn(params, src, src_mask, tgt, tgt_mask, *key):
    # With dropout, `key` (one per batch) seeds the masks: training mode, as fine-tuning runs.
    decoder_in = jnp.concatenate([jnp.zeros_like(tgt[:, :1]), tgt[:, :-1]], axis=1)
    logits = module.apply({"params": params}, src, src_mask.astype(jnp.int32), decoder_in,
                          tgt_mask.astype(jnp.int32), deterministic=not key, return_dict=False,
                          rngs={"dropout": key[0]} if key else None)[0]
    return t5.seq2seq_loss(logits, tgt, tgt_mask)

  def batch(b, s, rng):
    t = s // 2
    arrays = (jnp.asarray(rng.randint(1, 512, (b, s)), jnp.int32), jnp.ones((b, s), jnp.float32),
              jnp.asarray(rng.randint(1, 512, (b, t)), jnp.int32), jnp.ones((b, t), jnp.float32))
    return arrays + ((jax.random.key(rng.randint(2**31)),) if dropout else ())

  return dict(init=init, loss_fn=loss_fn, batch=batch, dims=lambda b, s: {"b": b, "s": s, "t": s // 2},
              shapes=(None, "b, s", "b, s", "b, t", "b, t") + ((None,) if dropout else ()),
              constraints=("s >= 2", "s <= 512", "t >= 2", "t <= 256", "b <= 4"))


def _longt5():
  """LongT5 with transient-global attention: the encoder pads the source to blocks of
  local_radius + 1 = 33 positions, so the source length is declared a multiple of 33
  (`tracing`'s advice when it is not), as a tokenizer's pad_to_multiple_of=33 pads it."""
  from transformers import LongT5Config
  from transformers.models.longt5 import modeling_flax_longt5
  modeling_flax_longt5.jnp = _numpy_with_old_clip()
  cfg = LongT5Config(vocab_size=512, d_model=128, d_kv=32, d_ff=256, num_layers=2,
                     num_decoder_layers=2, num_heads=4, local_radius=32, global_block_size=16,
                     encoder_attention_type="transient-global", dropout_rate=0.0,
                     decoder_start_token_id=0, pad_token_id=0)
  module = modeling_flax_longt5.FlaxLongT5ForConditionalGenerationModule(cfg, dtype=jnp.float32)

  def init(key):
    t = jnp.ones((1, 8), jnp.int32)
    return module.init(key, t, t, t, t)["params"]

  def loss_fn(params, src, src_mask, tgt, tgt_mask):
    decoder_in = jnp.concatenate([jnp.zeros_like(tgt[:, :1]), tgt[:, :-1]], axis=1)
    logits = module.apply({"params": params}, src, src_mask.astype(jnp.int32), decoder_in,
                          tgt_mask.astype(jnp.int32), return_dict=False)[0]
    return t5.seq2seq_loss(logits, tgt, tgt_mask)

  def batch(b, s, rng):
    t = s // 2
    return (jnp.asarray(rng.randint(1, 512, (b, s)), jnp.int32), _padding_mask(b, s),
            jnp.asarray(rng.randint(1, 512, (b, t)), jnp.int32), jnp.ones((b, t), jnp.float32))

  return dict(init=init, loss_fn=loss_fn, batch=batch, lengths=(66, 264, 528),
              dims=lambda b, s: {"b": b, "k": s // 33, "t": s // 2},
              shapes=(None, "b, s", "b, s", "b, t", "b, t"),
              constraints=("s == 33*k", "s <= 528", "t >= 2", "t <= 264", "b <= 4"))


def _gpt2(dtype=jnp.float32):
  from transformers import GPT2Config
  from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule
  cfg = GPT2Config(vocab_size=512, n_positions=512, n_embd=128, n_layer=3, n_head=4,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  return _causal_lm(FlaxGPT2LMHeadModule(cfg, dtype=dtype), padded=False)


def _causal_lm(module, padded: bool):
  """A decoder-only LM module (tokens, attention mask, positions) with the next-token loss;
  batches of full rows, or `padded` as `_padding_mask` pads them."""

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, t, jnp.ones_like(t), jnp.arange(4)[None])["params"]

  def loss_fn(params, tokens, mask):
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    logits = module.apply({"params": params}, tokens, mask.astype(jnp.int32), positions,
                          return_dict=False)[0]
    return llama.next_token_loss(logits, tokens, mask)

  return _decoder_lm(init, loss_fn, padded)


def _decoder_lm(init, loss_fn, padded: bool = True):
  """A decoder-only LM step's entry: `init(key)` -> parameters, `loss_fn(params, tokens,
  mask)`, batches of 512-token vocabularies in full rows or padded (`_padding_mask`)."""

  def batch(b, s, rng):
    mask = _padding_mask(b, s) if padded else jnp.ones((b, s), jnp.float32)
    return (jnp.asarray(rng.randint(0, 512, (b, s)), jnp.int32), mask)

  return dict(init=init, loss_fn=loss_fn, batch=batch, dims=lambda b, s: {"b": b, "s": s},
              shapes=(None, "b, s", "b, s"), constraints=("s >= 2", "s <= 512", "b <= 4"))


def _bart_like(module, decoder_start: int):
  """`init` and the sequence `loss_fn` of an encoder-decoder module called as BART's is
  (source, its mask, decoder input, its mask, source positions, target positions), the
  decoder input the target shifted right after `decoder_start`."""

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4)[None]
    return module.init(key, t, jnp.ones_like(t), t, jnp.ones_like(t), positions,
                       positions)["params"]

  def loss_fn(params, src, src_mask, tgt, tgt_mask):
    (b, s), t = src.shape, tgt.shape[1]
    decoder_in = jnp.concatenate([jnp.full_like(tgt[:, :1], decoder_start), tgt[:, :-1]], axis=1)
    logits = module.apply({"params": params}, src, src_mask.astype(jnp.int32), decoder_in,
                          tgt_mask.astype(jnp.int32), jnp.broadcast_to(jnp.arange(s)[None], (b, s)),
                          jnp.broadcast_to(jnp.arange(t)[None], (b, t)), return_dict=False)[0]
    return t5.seq2seq_loss(logits, tgt, tgt_mask)

  return init, loss_fn


def _bart():
  from transformers import BartConfig
  from transformers.models.bart.modeling_flax_bart import FlaxBartForConditionalGenerationModule
  cfg = BartConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                   decoder_ffn_dim=128, max_position_embeddings=512, dropout=0.0,
                   attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                   bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
  init, loss_fn = _bart_like(FlaxBartForConditionalGenerationModule(cfg, dtype=jnp.float32),
                             cfg.decoder_start_token_id)

  def batch(b, s, rng):
    t = s // 2
    return (jnp.asarray(rng.randint(3, 512, (b, s)), jnp.int32), _padding_mask(b, s),
            jnp.asarray(rng.randint(3, 512, (b, t)), jnp.int32), _padding_mask(b, t))

  return dict(init=init, loss_fn=loss_fn, batch=batch, dims=lambda b, s: {"b": b, "s": s, "t": s // 2},
              shapes=(None, "b, s", "b, s", "b, t", "b, t"),
              constraints=("s >= 2", "s <= 512", "t >= 2", "t <= 256", "b <= 4"))


def _bert(gradient_checkpointing: bool = False):
  from transformers import BertConfig
  from transformers.models.bert.modeling_flax_bert import FlaxBertForMaskedLMModule
  cfg = BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=256, max_position_embeddings=512, type_vocab_size=2,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  module = FlaxBertForMaskedLMModule(cfg, dtype=jnp.float32,
                                     gradient_checkpointing=gradient_checkpointing)
  mask_token = 3
  init, loss_fn = _bert_like(module)

  def batch(b, s, rng):
    labels = rng.randint(5, 512, (b, s)).astype(np.int32)
    mask = np.asarray(_padding_mask(b, s))
    chosen = (rng.rand(b, s) < 0.15) & (mask > 0)   # 15 % of the real tokens are masked
    tokens = np.where(mask > 0, np.where(chosen, mask_token, labels), 0).astype(np.int32)
    token_types = np.zeros((b, s), np.int32)
    token_types[:, s // 2:] = 1   # two "sentences"
    return tuple(map(jnp.asarray, (tokens, mask, token_types, labels, chosen.astype(np.float32))))

  return dict(init=init, loss_fn=loss_fn, batch=batch, dims=lambda b, s: {"b": b, "s": s},
              shapes=(None, "b, s", "b, s", "b, s", "b, s", "b, s"),
              constraints=("s >= 2", "s <= 512", "b <= 4"))


def _bert_like(module, init_length: int = 4):
  """`init` and the masked-LM `loss_fn` of a module called as BERT's is (tokens, attention
  mask, token types, positions, head mask)."""

  def init(key):
    t = jnp.zeros((1, init_length), jnp.int32)
    return module.init(key, t, jnp.ones_like(t), jnp.zeros_like(t),
                       jnp.arange(init_length)[None], None, return_dict=False)["params"]

  def loss_fn(params, tokens, mask, token_types, labels, chosen):
    b, s = tokens.shape
    logits = module.apply({"params": params}, tokens, mask.astype(jnp.int32), token_types,
                          jnp.broadcast_to(jnp.arange(s)[None], (b, s)), None,
                          return_dict=False)[0]
    return llama.masked_cross_entropy(logits, labels, chosen)

  return init, loss_fn


def _albert():
  """ALBERT: one layer's weights shared by every layer (the same Flax module called
  `num_hidden_layers` times), so all layers carry one scope name."""
  from transformers import AlbertConfig
  from transformers.models.albert.modeling_flax_albert import FlaxAlbertForMaskedLMModule
  cfg = AlbertConfig(vocab_size=512, embedding_size=64, hidden_size=128, num_hidden_layers=4,
                     num_hidden_groups=1, num_attention_heads=4, intermediate_size=256,
                     max_position_embeddings=512, type_vocab_size=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
  bert = _bert()   # the same masked-LM batch and loss
  module = FlaxAlbertForMaskedLMModule(cfg, dtype=jnp.float32)

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, t, jnp.ones_like(t), jnp.zeros_like(t), jnp.arange(4)[None],
                       return_dict=False)["params"]

  def loss_fn(params, tokens, mask, token_types, labels, chosen):
    b, s = tokens.shape
    logits = module.apply({"params": params}, tokens, mask.astype(jnp.int32), token_types,
                          jnp.broadcast_to(jnp.arange(s)[None], (b, s)), return_dict=False)[0]
    return llama.masked_cross_entropy(logits, labels, chosen)

  return dict(bert, init=init, loss_fn=loss_fn)


def _mistral(dtype=jnp.float32):
  from transformers import MistralConfig
  from transformers.models.mistral.modeling_flax_mistral import FlaxMistralForCausalLMModule
  cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      sliding_window=128, tie_word_embeddings=False)
  return _causal_lm(FlaxMistralForCausalLMModule(cfg, dtype=dtype), padded=True)


def _hf_causal_lm(model: str, config: str, module: str, **config_kwargs):
  """transformers' `module` of models/<model>/modeling_flax_<model>.py with a small random
  `config` (a class of transformers), padded rows."""
  import importlib
  import transformers
  cls = getattr(importlib.import_module(f"transformers.models.{model}.modeling_flax_{model}"),
                module)
  return _causal_lm(cls(getattr(transformers, config)(**config_kwargs)), padded=True)


_SMALL = dict(vocab_size=512, max_position_embeddings=512)
_gpt_neo = functools.partial(
    _hf_causal_lm, "gpt_neo", "GPTNeoConfig", "FlaxGPTNeoForCausalLMModule", **_SMALL,
    hidden_size=128, num_layers=4, num_heads=4, attention_types=[[["global", "local"], 2]],
    window_size=64, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
_opt = functools.partial(
    _hf_causal_lm, "opt", "OPTConfig", "FlaxOPTForCausalLMModule", **_SMALL, hidden_size=128,
    num_hidden_layers=3, ffn_dim=256, num_attention_heads=4, word_embed_proj_dim=128,
    dropout=0.0, attention_dropout=0.0)
_gptj = functools.partial(
    _hf_causal_lm, "gptj", "GPTJConfig", "FlaxGPTJForCausalLMModule", vocab_size=512,
    n_positions=512, n_embd=128, n_layer=3, n_head=4, rotary_dim=16, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0)
_xglm = functools.partial(
    _hf_causal_lm, "xglm", "XGLMConfig", "FlaxXGLMForCausalLMModule", **_SMALL, d_model=128,
    num_layers=3, attention_heads=4, ffn_dim=256, dropout=0.0, attention_dropout=0.0,
    activation_dropout=0.0)
_gemma = functools.partial(
    _hf_causal_lm, "gemma", "GemmaConfig", "FlaxGemmaForCausalLMModule", **_SMALL,
    hidden_size=128, num_hidden_layers=3, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, hidden_activation="gelu_pytorch_tanh")


def _bloom():
  """BLOOM: ALiBi position biases, made from the attention mask (no position ids)."""
  from transformers import BloomConfig
  from transformers.models.bloom.modeling_flax_bloom import FlaxBloomForCausalLMModule
  module = FlaxBloomForCausalLMModule(BloomConfig(vocab_size=512, hidden_size=128, n_layer=3,
                                                  n_head=4, hidden_dropout=0.0,
                                                  attention_dropout=0.0))

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, t, jnp.ones_like(t))["params"]

  def loss_fn(params, tokens, mask):
    logits = module.apply({"params": params}, tokens, mask.astype(jnp.int32), return_dict=False)[0]
    return llama.next_token_loss(logits, tokens, mask)

  return _decoder_lm(init, loss_fn)


def _wav2vec2():
  """Wav2Vec2 for CTC: a 7-layer strided convolution feature extractor over raw audio (total
  stride 320, as the released models), a convolutional position embedding, pre-norm layers,
  and optax's CTC loss (a scan over the frames). Audio "b, n", declared a multiple of the
  total stride as a data loader pads it (`n == 320*k`: without it, the backward of the
  strided convolutions needs paddings JAX cannot express in n, and symmem.jit falls back to
  jax.jit saying so); labels "b, u"; rows 1 and 3 padded in both."""
  from transformers import Wav2Vec2Config
  from transformers.models.wav2vec2.modeling_flax_wav2vec2 import FlaxWav2Vec2ForCTCModule
  cfg = Wav2Vec2Config(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, conv_dim=(32,) * 7, conv_stride=(5, 2, 2, 2, 2, 2, 2),
                       conv_kernel=(10, 3, 3, 3, 3, 2, 2), num_conv_pos_embeddings=16,
                       num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
                       feat_extract_norm="layer", apply_spec_augment=False, hidden_dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                       final_dropout=0.0, layerdrop=0.0)
  module = FlaxWav2Vec2ForCTCModule(cfg, dtype=jnp.float32)

  def init(key):
    audio = jnp.zeros((1, 1600), jnp.float32)
    return module.init(key, audio, jnp.ones((1, 1600), jnp.int32))["params"]

  def loss_fn(params, audio, audio_mask, labels, label_mask):
    logits = module.apply({"params": params}, audio, audio_mask.astype(jnp.int32),
                          deterministic=True, return_dict=False)[0]
    frames = module._get_feat_extract_output_lengths(audio_mask.sum(-1).astype(jnp.int32))
    frame_padding = (jnp.arange(logits.shape[1])[None] >= frames[:, None]).astype(jnp.float32)
    return optax.ctc_loss(logits, frame_padding, labels, 1.0 - label_mask).mean()

  def batch(b, n, rng):
    mask = _padding_mask(b, n)
    labels = jnp.asarray(rng.randint(1, 32, (b, n // 1280)), jnp.int32)
    return (jnp.asarray(rng.randn(b, n).astype(np.float32)) * mask, mask, labels,
            _padding_mask(b, n // 1280))

  return dict(init=init, loss_fn=loss_fn, batch=batch, lengths=(16000, 64000, 160000),
              dims=lambda b, n: {"b": b, "k": n // 320, "u": n // 1280},
              shapes=(None, "b, n", "b, n", "b, u", "b, u"),
              constraints=("n == 320*k", "k >= 5", "n <= 160000", "u >= 2", "u <= 125", "b <= 4"))


def _roformer():
  """RoFormer for masked LM: rotary positions from a sinusoidal table sliced to the length,
  factorized embeddings; BERT's batch and loss."""
  from transformers import RoFormerConfig
  from transformers.models.roformer.modeling_flax_roformer import FlaxRoFormerForMaskedLMModule
  cfg = RoFormerConfig(vocab_size=512, embedding_size=128, hidden_size=128, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=256, max_position_embeddings=512,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  module = FlaxRoFormerForMaskedLMModule(cfg, dtype=jnp.float32)

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, t, jnp.ones_like(t), jnp.zeros_like(t), None,
                       return_dict=False)["params"]

  def loss_fn(params, tokens, mask, token_types, labels, chosen):
    logits = module.apply({"params": params}, tokens, mask.astype(jnp.int32), token_types, None,
                          return_dict=False)[0]
    return llama.masked_cross_entropy(logits, labels, chosen)

  return dict(_bert(), init=init, loss_fn=loss_fn)


def _pegasus():
  """Pegasus: an encoder-decoder with sinusoidal positions and pre-norm layers; BART's
  batches ("b, s", "b, t", padded rows) and loss."""
  from transformers import PegasusConfig
  from transformers.models.pegasus.modeling_flax_pegasus import (
      FlaxPegasusForConditionalGenerationModule)
  cfg = PegasusConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                      decoder_ffn_dim=128, max_position_embeddings=512, dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0)
  init, loss_fn = _bart_like(FlaxPegasusForConditionalGenerationModule(cfg, dtype=jnp.float32),
                             cfg.decoder_start_token_id)
  return dict(_bart(), init=init, loss_fn=loss_fn)


def _big_bird():
  """BigBird's block-sparse attention: each block of 16 queries attends to its neighbours,
  global blocks and 2 random blocks, gathered from the keys by block index (without a key for
  the random indices, the library's fixed pattern). The length must be a multiple of the
  block (declared `s == 16*k`); lengths 256 to 512; BERT's batch and loss."""
  from transformers import BigBirdConfig
  from transformers.models.big_bird.modeling_flax_big_bird import FlaxBigBirdForMaskedLMModule
  cfg = BigBirdConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=256, max_position_embeddings=1024,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attention_type="block_sparse", block_size=16, num_random_blocks=2)
  # Initialized at a length the block-sparse pattern has room in.
  init, loss_fn = _bert_like(FlaxBigBirdForMaskedLMModule(cfg, dtype=jnp.float32), 256)
  return dict(_bert(), init=init, loss_fn=loss_fn, lengths=(256, 384, 512),
              dims=lambda b, s: {"b": b, "s": s, "k": s // 16},
              constraints=("s == 16*k", "s >= 256", "s <= 512", "b <= 4"))


def _whisper():
  """Whisper: a convolutional encoder over log-mel features of the fixed length the library
  requires (its check raises on any other: "b, _, _"), a decoder over text "b, t" with
  cross-attention to it; padded rows; T5's sequence loss."""
  from transformers import WhisperConfig
  from transformers.models.whisper.modeling_flax_whisper import (
      FlaxWhisperForConditionalGenerationModule)
  cfg = WhisperConfig(vocab_size=512, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, d_model=64,
                      encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=200,
                      max_target_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0)
  module = FlaxWhisperForConditionalGenerationModule(cfg, dtype=jnp.float32)
  frames = 2 * cfg.max_source_positions

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, jnp.zeros((1, cfg.num_mel_bins, frames)), t, jnp.ones_like(t),
                       jnp.arange(4)[None])["params"]

  def loss_fn(params, features, tgt, tgt_mask):
    b, t = tgt.shape
    decoder_in = jnp.concatenate([jnp.ones_like(tgt[:, :1]), tgt[:, :-1]], axis=1)
    logits = module.apply({"params": params}, features, decoder_in, tgt_mask.astype(jnp.int32),
                          jnp.broadcast_to(jnp.arange(t)[None], (b, t)), return_dict=False)[0]
    return t5.seq2seq_loss(logits, tgt, tgt_mask)

  def batch(b, t, rng):
    features = rng.randn(b, cfg.num_mel_bins, frames).astype(np.float32)
    return (jnp.asarray(features), jnp.asarray(rng.randint(3, 512, (b, t)), jnp.int32),
            _padding_mask(b, t))

  return dict(init=init, loss_fn=loss_fn, batch=batch, lengths=(32, 128, 256),
              dims=lambda b, t: {"b": b, "t": t}, shapes=(None, "b, _, _", "b, t", "b, t"),
              constraints=("t >= 2", "t <= 256", "b <= 4"))


def _haiku(layer_stack: bool = False, remat: bool = False):
  """A Haiku decoder written as Haiku's transformer example writes one: pre-norm blocks of
  `hk.MultiHeadAttention` and a GELU MLP, a causal mask combined with the padding mask,
  learned positions; its 4 layers in a Python loop or in `hk.layer_stack` (a scan over
  stacked weights), each under `hk.remat` where `remat`. Padded rows."""
  import haiku as hk
  vocab, width, heads, layers = 512, 128, 4, 4

  class Block(hk.Module):
    def __call__(self, x, mask):
      y = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
      y = hk.MultiHeadAttention(num_heads=heads, key_size=width // heads, model_size=width,
                                w_init=hk.initializers.VarianceScaling(2 / layers))(y, y, y, mask)
      x = x + y
      y = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
      y = hk.Linear(width)(jax.nn.gelu(hk.Linear(4 * width)(y)))
      return x + y

  def forward(tokens, pad):
    s = tokens.shape[1]
    positions = hk.get_parameter("positions", [512, width], init=hk.initializers.TruncatedNormal())
    x = hk.Embed(vocab, width)(tokens) + positions[:s]
    mask = jnp.tril(jnp.ones((1, 1, s, s), bool)) & (pad[:, None, None, :] > 0)
    layer = lambda x: Block()(x, mask)
    layer = hk.remat(layer) if remat else layer
    if layer_stack:
      x = hk.layer_stack(layers)(layer)(x)
    else:
      for _ in range(layers):
        x = layer(x)
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
    return hk.Linear(vocab)(x)

  net = hk.without_apply_rng(hk.transform(forward))

  def loss_fn(params, tokens, mask):
    return llama.next_token_loss(net.apply(params, tokens, mask), tokens, mask)

  return _decoder_lm(lambda key: net.init(key, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4))),
                     loss_fn)


def _keras_llama():
  """keras-hub's `LlamaBackbone` (Keras 3 on its JAX backend; `pip install keras-hub`, not in
  the experiments extra: it brings TensorFlow) with a Dense head, trained as Keras' guide to
  custom JAX training loops does it, through `stateless_call`. Padded rows."""
  import os
  os.environ.setdefault("KERAS_BACKEND", "jax")
  import keras
  import keras_hub
  if keras.backend.backend() != "jax":
    raise RuntimeError(f"Keras runs on {keras.backend.backend()!r}: set KERAS_BACKEND=jax")
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=512, num_layers=3, num_query_heads=4, num_key_value_heads=2,
      hidden_dim=128, intermediate_dim=256)
  inputs = {"token_ids": keras.Input((None,), dtype="int32"),
            "padding_mask": keras.Input((None,), dtype="int32")}
  model = keras.Model(inputs, keras.layers.Dense(512)(backbone(inputs)))
  fixed = [v.value for v in model.non_trainable_variables]

  def loss_fn(params, tokens, mask):
    logits, _ = model.stateless_call(params, fixed, {"token_ids": tokens,
                                                     "padding_mask": mask.astype(jnp.int32)})
    return llama.next_token_loss(logits, tokens, mask)

  return _decoder_lm(lambda key: [v.value for v in model.trainable_variables], loss_fn)


def _clip():
  """CLIP as transformers writes it: a ViT over fixed-size images and a causal text
  transformer over padded captions (pooled at each row's end-of-text token, the largest
  id), projected, normalized, and the symmetric contrastive loss over the batch's
  b x b similarities: the batch is a dim of the loss's own arrays, not only a factor."""
  from transformers import CLIPConfig
  from transformers.models.clip.modeling_flax_clip import FlaxCLIPModule
  cfg = CLIPConfig(
      text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                       eos_token_id=511),
      vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, image_size=32, patch_size=8),
      projection_dim=32)
  module = FlaxCLIPModule(cfg, dtype=jnp.float32)

  def init(key):
    t = jnp.zeros((1, 4), jnp.int32)
    return module.init(key, t, jnp.zeros((1, 3, 32, 32)), jnp.ones_like(t),
                       jnp.arange(4)[None])["params"]

  def loss_fn(params, pixels, tokens, mask):
    b, s = tokens.shape
    logits = module.apply({"params": params}, tokens, pixels, mask.astype(jnp.int32),
                          jnp.broadcast_to(jnp.arange(s)[None], (b, s)), return_dict=False)[1]
    labels = jnp.arange(b)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2

  def batch(b, s, rng):
    mask = np.asarray(_padding_mask(b, s))
    tokens = np.where(mask > 0, rng.randint(1, 510, (b, s)), 0)
    ends = mask.sum(1).astype(int) - 1
    tokens[np.arange(b), ends] = 511   # each caption's end-of-text token
    pixels = rng.randn(b, 3, 32, 32).astype(np.float32)
    return jnp.asarray(pixels), jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)

  return dict(init=init, loss_fn=loss_fn, batch=batch, dims=lambda b, s: {"b": b, "s": s},
              shapes=(None, "b, _, _, _", "b, s", "b, s"),
              constraints=("s >= 2", "s <= 512", "b <= 4"))


def _padding_mask(b, s):
  """Padded batches as a data loader makes them: rows 1 and 3 end with a quarter and a half
  of padding (mask 0)."""
  mask = np.ones((b, s), np.float32)
  for row, fraction in ((1, 4), (3, 2)):
    if row < b:
      mask[row, s - s // fraction:] = 0.0
  return jnp.asarray(mask)


MODELS = {"t5": _t5, "gpt2": _gpt2, "bart": _bart, "bert": _bert, "albert": _albert, "mistral": _mistral,
          "t5_dropout": functools.partial(_t5, dropout=0.1),
          "t5_checkpointed": functools.partial(_t5, gradient_checkpointing=True),
          "bert_checkpointed": functools.partial(_bert, gradient_checkpointing=True),
          # computing in bfloat16 with float32 parameters, as the library's `dtype` does it
          "gpt2_bf16": functools.partial(_gpt2, dtype=jnp.bfloat16),
          "mistral_bf16": functools.partial(_mistral, dtype=jnp.bfloat16),
          "gpt_neo": _gpt_neo, "opt": _opt, "gptj": _gptj, "xglm": _xglm, "gemma": _gemma,
          "bloom": _bloom, "longt5": _longt5, "wav2vec2": _wav2vec2, "roformer": _roformer,
          "pegasus": _pegasus, "big_bird": _big_bird, "whisper": _whisper, "clip": _clip,
          "haiku": _haiku,
          "haiku_stack": functools.partial(_haiku, layer_stack=True),
          "haiku_stack_remat": functools.partial(_haiku, layer_stack=True, remat=True),
          "keras_llama": _keras_llama}
# Models whose step holds the library's own remat regions: timed against jax.jit.
CHECKPOINTED = frozenset(("t5_checkpointed", "bert_checkpointed", "haiku_stack_remat"))
LENGTHS = (64, 256, 512)
BATCH = 4


def _largest_difference(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _model_step(name: str):
  """(the model's entry of MODELS made, its training state, its step with AdamW, its
  lengths, a batch per length)."""
  m = MODELS[name]()
  params = m["init"](jax.random.PRNGKey(0))
  state = {"params": params, "opt_state": llama.make_optimizer().init(params)}
  step_fn = llama.adamw_train_step(m["loss_fn"])   # the same AdamW
  rng = np.random.RandomState(0)
  lengths = m.get("lengths", LENGTHS)
  return m, state, step_fn, lengths, {s: m["batch"](BATCH, s, rng) for s in lengths}


def _with_the_calls_options(step, ref, args):
  """`ref` (jax.jit of the step) compiled for `args` with the XLA options of the variant
  `step` (its symmem.jit) ran last: what that call must compute."""
  call = step.last_call
  (variant,) = [v for v in step.variants()
                if v["dims"] == call["dims"] and v["round"] == call["round"]]
  return ref.lower(*args).compile(compiler_options=variant["compiler_options"])


def run_model(name: str, fractions, passes: int, speed_trials: bool = False) -> dict:
  m, state, step_fn, lengths, batches = _model_step(name)
  ref = jax.jit(step_fn)
  out = {"model": name, "lengths": lengths, "plain": [], "budgets": []}
  plain = symmem.jit(step_fn, polymorphic_shapes=m["shapes"], constraints=m["constraints"])
  for s in lengths:
    args = (state, *batches[s])
    t0 = time.perf_counter()
    got = jax.block_until_ready(plain(*args))
    out.setdefault("first_call_s", time.perf_counter() - t0)   # trace, plan, one compile
    if plain.last_call.get("fallback"):   # not traceable with symbolic dims: jax.jit ran it
      out["fallback"] = True
      print(f"{name}: symmem.jit fell back to jax.jit (its warning says why); no plan", flush=True)
      return out
    row = {"dims": m["dims"](BATCH, s), "round": plain.last_call["round"],
           "equal_to_jax_jit": _common.trees_close(got, ref(*args))}
    out["plain"].append(row)
    print(f"{name} {row['dims']} without a budget: equal to jax.jit: {row['equal_to_jax_jit']}",
          flush=True)
  analysis = plain.analyze(state, *batches[lengths[0]])   # the first call's plan
  longest = m["dims"](BATCH, lengths[-1])
  peaks = [analysis.round_peak(k, longest) for k in range(len(analysis.rounds))]
  out["rounds"] = len(peaks) - 1
  out["modeled_mib_at_longest"] = [round(p / MiB, 1) for p in peaks]
  print(f"{name}: {out['rounds']} rounds; modeled MiB at {longest}: {out['modeled_mib_at_longest']}",
        flush=True)
  for frac in fractions:
    budget = _common.budget_between(min(peaks), peaks[0], frac)
    step = symmem.jit(step_fn, polymorphic_shapes=m["shapes"], constraints=m["constraints"],
                      memory_budget=budget, speed_trials=speed_trials)
    rows = []
    for s in lengths:
      args = (state, *batches[s])
      try:
        _common.settle(step, args)
        got = jax.block_until_ready(step(*args))   # the round every later call runs
      except symmem.BudgetError as e:   # nothing XLA compiled fits: said, not run over it
        rows.append({"dims": m["dims"](BATCH, s), "budget_error": str(e),
                     "cache_info": step.cache_info()})
        print(f"{name} budget {budget / MiB:.1f} MiB {rows[-1]['dims']}: BudgetError: {e}",
              flush=True)
        continue
      call = step.last_call
      same_options = _with_the_calls_options(step, ref, args)
      want = same_options(*args)
      row = {"dims": call["dims"], "round": call["round"], "xla_mib": call["xla_bytes"] / MiB,
             # round 0 compiled as jax.jit compiles it, XNNPACK's fusions and all; xla_mib
             # then adds the bound on what they hold (variants.compile_with_fusions)
             "xnnpack_fusions": call["xnnpack_fusions"],
             "fits": call["xla_bytes"] + call["reserved"] <= budget,
             "equal_to_jax_jit": _common.trees_close(got, want),
             "cache_info": step.cache_info()}
      if not row["equal_to_jax_jit"]:
        row["largest_difference"] = _largest_difference(got, want)
        row["deviation"] = _common.deviation(got, want)
        row["jax_jit_options_vs_defaults"] = _largest_difference(want, ref(*args))
      del got, want   # not live at the next shape's calls
      if name in CHECKPOINTED and passes:
        # jax.jit's step as compiled by default, and with the variant's XLA options (on
        # CPU XNNPACK for single dots only, F2): the second ratio leaves the options out.
        median, fastest = _common.time_interleaved(
            {"symmem": step, "jax_jit": ref, "jax_jit_same_options": same_options}, args, passes)
        row["time_s"], row["time_min_s"] = median, fastest
        for ref_name in ("jax_jit", "jax_jit_same_options"):
          row[f"time_vs_{ref_name}"] = median["symmem"] / median[ref_name]
          row[f"time_vs_{ref_name}_min"] = fastest["symmem"] / fastest[ref_name]
        row["timed_round"] = step.last_call["round"]
      del same_options
      rows.append(row)
      print(f"{name} budget {budget / MiB:.1f} MiB {row['dims']}: round {row['round']}"
            f"{' (XNNPACK fusions)' if row['xnnpack_fusions'] else ''}, XLA "
            f"{row['xla_mib']:.1f} MiB ({'fits' if row['fits'] else 'OVER'}), equal to jax.jit: "
            f"{row['equal_to_jax_jit']}"
            + (f" (largest difference {row['largest_difference']:.1e}, "
               f"{row['deviation']['elements_off']} of {row['deviation']['elements']} elements "
               f"off, gradients (first moments) within "
               f"{row['deviation']['first_moment_worst_leaf'] or 0:.1e} of their leaf's largest; "
               f"jax.jit with these options vs its defaults "
               f"{row['jax_jit_options_vs_defaults']:.1e})"
               if not row["equal_to_jax_jit"] else "")
            + (f"; time vs jax.jit (which recomputes) {row['time_vs_jax_jit']:.2f} (fastest "
               f"passes {row['time_vs_jax_jit_min']:.2f}), with the same XLA options "
               f"{row['time_vs_jax_jit_same_options']:.2f} "
               f"({row['time_vs_jax_jit_same_options_min']:.2f}), round {row['timed_round']}"
               if "time_vs_jax_jit" in row else "")
            + f"; {row['cache_info']}", flush=True)
    out["budgets"].append({"fraction": frac, "budget_mib": budget / MiB, "rows": rows})
  return out


def run_under_a_device_limit(name: str, fraction: float) -> dict:
  """`name` without a budget under a simulated device limit (the module docstring)."""
  m, state, step_fn, lengths, batches = _model_step(name)
  ref = jax.jit(step_fn)
  footprints = {s: variants.footprint(ref.lower(state, *batches[s]).compile()) for s in lengths}
  longest = (state, *batches[lengths[-1]])
  others = device.live_bytes() - sum(device.array_bytes(a) for a in jax.tree_util.tree_leaves(longest))
  limit = others + int(fraction * footprints[lengths[-1]])
  out = {"model": name, "lengths": lengths, "fraction": fraction, "limit_mib": limit / MiB,
         "rows": []}
  print(f"{name}: simulated device limit {limit / MiB:.1f} MiB ({fraction} x jax.jit's "
        f"{footprints[lengths[-1]] / MiB:.1f} MiB at the longest length)", flush=True)
  with mock.patch.object(jit_lib, "_device_memory", return_value=(None, limit)):
    step = symmem.jit(step_fn, polymorphic_shapes=m["shapes"], constraints=m["constraints"])
    for s in lengths:
      args = (state, *batches[s])
      before = step.cache_info()["compiles"]
      start = time.perf_counter()
      try:
        got = jax.block_until_ready(step(*args))
      except symmem.BudgetError as e:
        out["rows"].append({"dims": m["dims"](BATCH, s), "budget_error": str(e),
                            "call_s": time.perf_counter() - start})
        print(f"{name} {out['rows'][-1]['dims']}: BudgetError: {e}", flush=True)
        continue
      # The first call at this length: tracing and analysis at the first, compiles.
      call_s = time.perf_counter() - start
      call = step.last_call
      want = _with_the_calls_options(step, ref, args)(*args)
      analysis = step.analyze(*args)
      # Nothing here reads the plan where none was made (`as_written_round` would make it).
      row = {"dims": call["dims"], "round": call["round"], "call_s": call_s,
             "planned": analysis.planning.done,
             "as_written": analysis.is_as_written(call["round"]),
             # what symmem.jit predicts for round 0 before any plan (the step as written;
             # a checkpointed step's without its regions, which it plans at once anyway;
             # nothing donated here), against XLA's figure where round 0 ran
             "predicted_as_written_mib": analysis.unplanned_footprint(call["dims"]) / MiB,
             "jax_jit_fits": others + footprints[s] <= limit,
             "compiles": step.cache_info()["compiles"] - before,
             "xla_mib": call["xla_bytes"] / MiB, "reserved_mib": call["reserved"] / MiB,
             "fits": call["xla_bytes"] + call["reserved"] <= limit,
             "equal_to_jax_jit": _common.trees_close(got, want)}
      if not row["equal_to_jax_jit"]:
        row["largest_difference"] = _largest_difference(got, want)
        row["deviation"] = _common.deviation(got, want)
      del got, want
      out["rows"].append(row)
      print(f"{name} {row['dims']}: round {row['round']} "
            f"({'planned' if row['planned'] else 'unplanned'}; jax.jit "
            f"{'fits' if row['jax_jit_fits'] else 'over'}), {row['compiles']} compile(s) in a "
            f"{row['call_s']:.1f} s call, XLA "
            f"{row['xla_mib']:.1f} + {row['reserved_mib']:.1f} MiB ({'fits' if row['fits'] else 'OVER'}; "
            f"as written predicted {row['predicted_as_written_mib']:.1f} before planning), "
            f"equal to jax.jit: {row['equal_to_jax_jit']}"
            + (f" (largest difference {row['largest_difference']:.1e}, "
               f"{row['deviation']['elements_off']} of {row['deviation']['elements']} elements off)"
               if not row["equal_to_jax_jit"] else ""), flush=True)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models",   # keras_llama only when asked for (keras-hub: TensorFlow)
                      default=",".join(m for m in MODELS if m != "keras_llama"))
  parser.add_argument("--fractions", default="0.1,0.3,0.6",
                      help="budgets: this far from the last round's modeled peak to round 0's")
  parser.add_argument("--passes", type=int, default=5,
                      help="interleaved timing passes per shape for the checkpointed models (0: none)")
  _common.add_bool_flag(parser, "speed_trials", False,
                        "symmem.jit(speed_trials=True): a shape that comes back also times the "
                        "last round (for a checkpointed model the step as written) and keeps "
                        "the faster")
  _common.add_bool_flag(parser, "huge_pages", True,
                        "on the CPU, time in a process whose malloc asks for transparent huge "
                        "pages (_common.restart_with_huge_pages)")
  parser.add_argument("--device_limit", type=float, default=None,
                      help="instead: no budget under a simulated device limit of what other "
                           "arrays hold plus this fraction of jax.jit's footprint at the "
                           "longest length")
  parser.add_argument("--out", default=None, help="default: experiments/results/"
                      "third_party.json (third_party_device_limit.json with --device_limit)")
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = ("experiments/results/third_party.json" if args.device_limit is None
                else "experiments/results/third_party_device_limit.json")
  if args.huge_pages and argv is None and jax.devices()[0].platform == "cpu":
    _common.restart_with_huge_pages()
  fractions = [float(f) for f in args.fractions.split(",")]
  results = {"transformers": _common.package_version("transformers"), "batch": BATCH,
             "speed_trials": args.speed_trials,
             "lengths": LENGTHS, "results": []}
  for name in args.models.split(","):
    results["results"].append(
        run_model(name, fractions, args.passes, args.speed_trials) if args.device_limit is None
        else run_under_a_device_limit(name, args.device_limit))
    _common.write_results(args.out, results)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
