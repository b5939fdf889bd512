"""A T5-style encoder-decoder in Flax linen: optax AdamW step, one-flag switch to symmem.jit.

A token embedding shared by the encoder, the decoder and the (tied) output
head; pre-norm layers with RMSNorm (T5's scale-only layer norm) and a ReLU MLP;
bidirectional encoder self-attention that ignores padded source tokens; causal
decoder self-attention and cross-attention over the encoder output. Positions
enter as T5's bucketed relative position bias (one learned table per stack,
shared by its layers; none in cross-attention), computed from
`jnp.arange(s)` / `jnp.arange(t)`: the log-spaced buckets are jnp ops on those
arrays, so one trace with symbolic (b, s, t) covers every batch.

The loss is the masked cross-entropy of the decoder's logits against the target
tokens; the decoder reads the targets shifted right by one (token 0 first, as in
T5, where 0 is the pad and start token).

    state = init_state(cfg, seed=0)
    step = make_train_step(cfg, use_symmem=True, memory_budget=2**30)   # or use_symmem=False
    for src, src_mask, tgt, tgt_mask in batches:     # any (b, s), (b, t) within the maxima
      state, loss = step(state, src, src_mask, tgt, tgt_mask)
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_symmem.examples import llama
from jax_symmem.examples.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class T5Config(ModelConfig):
  n_enc_layers: int = 2
  n_dec_layers: int = 2
  d_kv: int = 16               # per-head width (T5 does not tie it to d_model / n_heads)
  d_ff: int = 256
  num_buckets: int = 32        # relative-position buckets per direction pair
  max_distance: int = 128      # distances beyond this share the last bucket
  max_src_len: int = 256       # the longest source / target the step is planned for
  max_tgt_len: int = 128

  @property
  def d_head(self) -> int:
    return self.d_kv


PRESETS = {
    # Tests: 25 k parameters; seconds to trace, plan and compile on 2 CPU cores.
    "tiny": T5Config(vocab=128, d_model=32, n_enc_layers=1, n_dec_layers=1, n_heads=2,
                     d_kv=16, d_ff=64, num_buckets=8, max_distance=16, max_src_len=64,
                     max_tgt_len=64),
    # The CPU benchmark: 2 + 2 layers, d_model 256, vocab 4096; 4.7 M parameters,
    # 54 MiB with the AdamW state. At b=2, s=512, t=256: XLA footprint of the step 241 MiB;
    # modeled peak 205 MiB without eviction, 146 MiB after symmem.jit's 11 rounds.
    "small": T5Config(vocab=4096, d_model=256, n_enc_layers=2, n_dec_layers=2, n_heads=4,
                      d_kv=64, d_ff=1024, num_buckets=32, max_distance=128, max_src_len=1024,
                      max_tgt_len=512),
}


# --- relative position bias ------------------------------------------------------------


def relative_position_buckets(q_len, k_len, *, bidirectional: bool, num_buckets: int,
                              max_distance: int):
  """(q_len, k_len) int32 bucket of each key position relative to each query position.

  Half the buckets (all of them when not bidirectional, where keys after the
  query all share bucket 0) hold exact distances 0, 1, ...; the rest cover
  larger distances up to `max_distance` on a log scale. Built from
  `jnp.arange`, so the lengths may be symbolic.
  """
  rel = jnp.arange(k_len, dtype=jnp.int32)[None, :] - jnp.arange(q_len, dtype=jnp.int32)[:, None]
  bucket = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + jnp.where(rel > 0, num_buckets, 0)   # keys after the query
    dist = jnp.abs(rel)
  else:
    dist = jnp.maximum(-rel, 0)                             # only keys before the query
  exact = num_buckets // 2
  # log(dist / exact) / log(max_distance / exact), scaled to the remaining buckets;
  # max(dist, 1) keeps log finite where the exact branch is taken anyway.
  scaled = (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / exact)
            / jnp.log(max_distance / exact) * (num_buckets - exact))
  far = jnp.minimum(exact + scaled.astype(jnp.int32), num_buckets - 1)
  return bucket + jnp.where(dist < exact, dist, far)


class RelativePositionBias(nn.Module):
  """(1, heads, q_len, k_len) learned bias of each relative-position bucket."""
  cfg: T5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, q_len, k_len):
    cfg = self.cfg
    buckets = relative_position_buckets(q_len, k_len, bidirectional=self.bidirectional,
                                        num_buckets=cfg.num_buckets,
                                        max_distance=cfg.max_distance)
    table = nn.Embed(cfg.num_buckets, cfg.n_heads, **llama.layer_dtypes(cfg),
                     embedding_init=nn.initializers.normal(cfg.d_model**-0.5),
                     name="rel_embedding")
    return jnp.transpose(table(buckets), (2, 0, 1))[None]


# --- layers ----------------------------------------------------------------------------


def attention(q, k, v, bias, mask, dtype):
  """Softmax attention of (b, q, h, d) queries over (b, k, h, d) keys and values.

  T5 scales no scores by 1/sqrt(d) (its query initialization absorbs it). `bias`
  is added to the (b, h, q, k) scores (None: no bias); `mask` (broadcastable
  to them, True where a key may be seen) blocks the others.
  """
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class MultiHeadAttention(nn.Module):
  """Queries from `x`, keys and values from `memory` (`x` itself for self-attention)."""
  cfg: T5Config

  @nn.compact
  def __call__(self, x, memory, bias, mask):
    cfg = self.cfg
    heads, inner = (cfg.n_heads, cfg.d_kv), cfg.n_heads * cfg.d_kv
    dense = lambda std, name: nn.DenseGeneral(
        heads, use_bias=False, kernel_init=nn.initializers.normal(std),
        **llama.layer_dtypes(cfg), name=name)
    q = dense((cfg.d_model * cfg.d_kv) ** -0.5, "q")(x)
    k = dense(cfg.d_model**-0.5, "k")(memory)
    v = dense(cfg.d_model**-0.5, "v")(memory)
    out = attention(q, k, v, bias, mask, jnp.dtype(cfg.dtype))
    return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False,
                           kernel_init=nn.initializers.normal(inner**-0.5),
                           **llama.layer_dtypes(cfg), name="o")(out)


class MLP(nn.Module):
  """T5's ReLU feed-forward block: wi, ReLU, wo, no biases."""
  cfg: T5Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dense = lambda features, std, name: nn.Dense(
        features, use_bias=False, kernel_init=nn.initializers.normal(std),
        **llama.layer_dtypes(cfg), name=name)
    return dense(cfg.d_model, cfg.d_ff**-0.5, "wo")(
        nn.relu(dense(cfg.d_ff, cfg.d_model**-0.5, "wi")(x)))


def _norm(cfg: T5Config, name: str) -> llama.RMSNorm:
  return llama.RMSNorm(cfg.norm_eps, **llama.layer_dtypes(cfg), name=name)


class EncoderLayer(nn.Module):
  """Pre-norm bidirectional self-attention and MLP, each with a residual."""
  cfg: T5Config

  @nn.compact
  def __call__(self, x, bias, mask):
    cfg = self.cfg
    h = _norm(cfg, "attn_norm")(x)
    x = x + MultiHeadAttention(cfg, name="self_attn")(h, h, bias, mask)
    return x + MLP(cfg, name="mlp")(_norm(cfg, "mlp_norm")(x))


class DecoderLayer(nn.Module):
  """Pre-norm causal self-attention, cross-attention over the encoder output, MLP."""
  cfg: T5Config

  @nn.compact
  def __call__(self, y, encoded, self_bias, self_mask, cross_mask):
    cfg = self.cfg
    h = _norm(cfg, "self_attn_norm")(y)
    y = y + MultiHeadAttention(cfg, name="self_attn")(h, h, self_bias, self_mask)
    h = _norm(cfg, "cross_attn_norm")(y)
    y = y + MultiHeadAttention(cfg, name="cross_attn")(h, encoded, None, cross_mask)
    return y + MLP(cfg, name="mlp")(_norm(cfg, "mlp_norm")(y))


class Encoder(nn.Module):
  cfg: T5Config
  remat_policy: str | None = None

  @nn.compact
  def __call__(self, x, src_mask):
    cfg, s = self.cfg, x.shape[1]
    bias = RelativePositionBias(cfg, bidirectional=True, name="rel_bias")(s, s)
    mask = src_mask.astype(bool)[:, None, None, :]            # (b, 1, 1, s): real keys
    layer = llama.remat_block(EncoderLayer, self.remat_policy)
    for i in range(cfg.n_enc_layers):
      x = layer(cfg, name=f"layer_{i}")(x, bias, mask)
    return _norm(cfg, "final_norm")(x)


class Decoder(nn.Module):
  cfg: T5Config
  remat_policy: str | None = None

  @nn.compact
  def __call__(self, y, encoded, src_mask, tgt_mask):
    cfg, t = self.cfg, y.shape[1]
    bias = RelativePositionBias(cfg, bidirectional=False, name="rel_bias")(t, t)
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None]     # (1, 1, t, t)
    self_mask = causal & tgt_mask.astype(bool)[:, None, None, :]
    cross_mask = src_mask.astype(bool)[:, None, None, :]      # (b, 1, 1, s)
    layer = llama.remat_block(DecoderLayer, self.remat_policy)
    for i in range(cfg.n_dec_layers):
      y = layer(cfg, name=f"layer_{i}")(y, encoded, bias, self_mask, cross_mask)
    return _norm(cfg, "final_norm")(y)


def shift_right(tokens):
  """The decoder's input: token 0 (T5's start token), then `tokens` without the last."""
  return jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)


class T5(nn.Module):
  """`__call__(src, src_mask, tgt, tgt_mask)`: (b, t, vocab) logits predicting `tgt`."""
  cfg: T5Config
  remat_policy: str | None = None

  @nn.compact
  def __call__(self, src_tokens, src_mask, tgt_tokens, tgt_mask):
    cfg = self.cfg
    shared = nn.Embed(cfg.vocab, cfg.d_model, **llama.layer_dtypes(cfg),
                      embedding_init=nn.initializers.normal(1.0), name="shared")
    encoded = Encoder(cfg, self.remat_policy, name="encoder")(shared(src_tokens), src_mask)
    y = Decoder(cfg, self.remat_policy, name="decoder")(
        shared(shift_right(tgt_tokens)), encoded, src_mask, tgt_mask)
    # The tied head: T5 rescales the decoder output by d_model^-1/2 before it.
    return shared.attend(y * cfg.d_model**-0.5)


# --- loss, state, step -----------------------------------------------------------------


def seq2seq_loss(logits, tgt_tokens, tgt_mask):
  """Masked cross-entropy of the decoder's logits against the target tokens."""
  return llama.masked_cross_entropy(logits, tgt_tokens, tgt_mask)


def init_state(cfg: T5Config, seed: int = 0, learning_rate: float = 1e-3) -> dict:
  """{"params", "opt_state"}: the pytree the step takes and returns."""
  tokens, mask = jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.float32)
  return llama.init_linen_state(T5(cfg), seed, learning_rate,
                                example_args=(tokens, mask, tokens, mask))


POLYMORPHIC_SHAPES = (None, "b, s", "b, s", "b, t", "b, t")


def step_constraints(max_src_len: int, max_tgt_len: int, max_batch: int) -> tuple[str, ...]:
  return (f"s <= {max_src_len}", f"t <= {max_tgt_len}", f"b <= {max_batch}", "s >= 2",
          "t >= 2")


def train_step_fn(model: T5, *, learning_rate: float = 1e-3):
  """The pure `(state, src, src_mask, tgt, tgt_mask) -> (state, loss)` AdamW step."""
  def loss_fn(params, src_tokens, src_mask, tgt_tokens, tgt_mask):
    logits = model.apply({"params": params}, src_tokens, src_mask, tgt_tokens, tgt_mask)
    return seq2seq_loss(logits, tgt_tokens, tgt_mask)
  return llama.adamw_train_step(loss_fn, learning_rate=learning_rate)


def make_train_step(cfg: T5Config, *, learning_rate: float = 1e-3,
                    remat_policy: str | None = None, use_symmem: bool = False,
                    memory_budget=None, max_src_len: int | None = None,
                    max_tgt_len: int | None = None, max_batch: int = 16):
  """A jitted `(state, src, src_mask, tgt, tgt_mask) -> (state, loss)` AdamW step.

  As `llama.make_train_step`, with two lengths: `use_symmem=True` compiles with
  `symmem.jit`, shapes `(None, "b, s", "b, s", "b, t", "b, t")` and constraints
  s <= max_src_len, t <= max_tgt_len (defaults `cfg.max_src_len`,
  `cfg.max_tgt_len`), b <= max_batch, s, t >= 2. `remat_policy` ("layer" or a
  `jax.checkpoint_policies` name) wraps each encoder and decoder layer in `nn.remat`.
  """
  step = train_step_fn(T5(cfg, remat_policy), learning_rate=learning_rate)
  constraints = step_constraints(cfg.max_src_len if max_src_len is None else max_src_len,
                                 cfg.max_tgt_len if max_tgt_len is None else max_tgt_len,
                                 max_batch)
  return llama.jit_polymorphic(step, use_symmem=use_symmem, polymorphic_shapes=POLYMORPHIC_SHAPES,
                               constraints=constraints, memory_budget=memory_budget)


def example_batch(cfg: T5Config, batch: int, src_len: int, tgt_len: int, seed: int = 0):
  """Random (src, src_mask, tgt, tgt_mask): int32 tokens in [1, vocab), f32 masks.

  Row i keeps its first `len - i` positions real (at least 2), so padding is exercised.
  """
  k_src, k_tgt = jax.random.split(jax.random.PRNGKey(seed))
  def side(key, length):
    real = jnp.maximum(length - jnp.arange(batch), 2)[:, None]
    mask = (jnp.arange(length)[None, :] < real).astype(jnp.float32)
    tokens = jax.random.randint(key, (batch, length), 1, cfg.vocab, jnp.int32)
    return tokens * mask.astype(jnp.int32), mask
  return (*side(k_src, src_len), *side(k_tgt, tgt_len))
