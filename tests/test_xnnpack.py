"""xnnpack: the bound on what XLA:CPU's XNNPACK fusions hold beside memory_analysis()."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_symmem._src import variants
from jax_symmem._src import xnnpack

# Two fusions as XLA:CPU prints them (trimmed): one XNNPACK fusion with three inner
# values (a dot, a tuple-shaped op and a broadcast), one loop fusion; a header
# with the /*index=5*/ comments XLA writes in long parameter lists.
_HLO = """HloModule jit_f, entry_computation_layout={(f32[8,4]{1,0})->f32[8]{0}}

%fused_computation (param_0: f32[8,4], param_1: f32[4,4], param_2: f32[], p3: f32[], p4: f32[], /*index=5*/p5: f32[]) -> f32[8] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = f32[4,4]{1,0} parameter(1)
  %dot = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %pair = (bf16[8,4]{1,0}, s32[2]{0}) tuple(%dot, %dot)
  %b = pred[8,4]{1,0} broadcast(%param_2), dimensions={}
  %bc = f32[32]{0} bitcast(%dot)
  %c = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%dot, %c), dimensions={1}, to_apply=%add
}

%fused_loop (param_0: f32[8,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %big = f32[1024,1024]{1,0} broadcast(%param_0), dimensions={}
  ROOT %e = f32[8,4]{1,0} exponential(%param_0)
}

%fused_conv (param_0: f32[2,4,4,5], param_1: f32[3,3,5,8]) -> f32[2,4,4,8] {
  %param_0 = f32[2,4,4,5]{3,2,1,0} parameter(0)
  %param_1 = f32[3,3,5,8]{3,2,1,0} parameter(1)
  %conv = f32[2,4,4,8]{3,2,1,0} convolution(%param_0, %param_1), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  ROOT %t = f32[2,4,4,8]{3,2,1,0} tanh(%conv)
}

ENTRY %main.1 (x: f32[8,4]) -> f32[8] {
  %x = f32[8,4]{1,0} parameter(0)
  %l = f32[8,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_loop
  %c = f32[2,4,4,8]{3,2,1,0} fusion(%y, %k), kind=kCustom, calls=%fused_conv, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  ROOT %ynn_fusion = f32[8]{0} fusion(%l, %x), kind=kCustom, calls=%fused_computation, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
}
"""


def test_reads_each_xnnpack_fusions_inner_values():
  # dot 8*4*4 B; the tuple 8*4*2 + 2*4 B; the broadcast of preds 8*4*1 B; not the
  # parameters, the bitcast, the constant or the root (XLA's buffers), nor the loop fusion.
  # The convolution: its output (2*4*4*8 floats) and its patch matrix, 2*4*4 output
  # positions x a 3x3 window of 5 input features.
  assert xnnpack.fusion_inner_bytes(_HLO) == [4 * (2 * 4 * 4 * 8 + 2 * 4 * 4 * 3 * 3 * 5),
                                               128 + 64 + 8 + 32]
  assert xnnpack.hidden_bytes_bound(_HLO) == 4 * (256 + 1440)
  assert xnnpack.hidden_bytes_bound(_HLO.replace("__ynn_fusion", "__other")) == 0


@pytest.mark.parametrize("broken,message", [
    (("calls=%fused_computation,", "calls=%gone,"), "without its computation"),
    (("(bf16[8,4]{1,0}, s32[2]{0})", "(f4e2m1fn[8,4]{1,0})"), "element type"),
    (("dim_labels=b01f_01io->b01f", ""), "convolution"),
])
def test_unreadable_text_is_an_error_not_a_zero(broken, message):
  with pytest.raises(ValueError, match=message):
    xnnpack.hidden_bytes_bound(_HLO.replace(*broken))


def _mlp(w, x):
  h = jnp.tanh(x @ w) * 2.0 + 1.0
  return jnp.sum(h * h, axis=-1)


def test_on_xla_cpus_own_fusions_and_on_the_budgets_single_dots():
  if jax.devices()[0].platform != "cpu":
    pytest.skip("XNNPACK fusions are XLA:CPU's")
  w, x = jnp.ones((64, 64)), jnp.asarray(np.random.RandomState(0).randn(256, 64), jnp.float32)
  own = jax.jit(_mlp).lower(w, x).compile()
  sizes = xnnpack.fusion_inner_bytes(own.as_text())
  if jax.__version_info__ < (0, 10):
    assert not sizes   # jax 0.9's XLA:CPU leaves dots out of XNNPACK fusions by default
  else:
    # XLA:CPU fuses the dot and the chain after it into XNNPACK: at least the dot's result
    # (256 x 64 float32) lives inside a fusion.
    assert sizes and max(sizes) >= 256 * 64 * 4
  # The budget's single dots hold nothing inside.
  single = jax.jit(_mlp).lower(w, x).compile(compiler_options=variants.XNNPACK_DOTS)
  assert xnnpack.hidden_bytes_bound(single.as_text()) == 0
