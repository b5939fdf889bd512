"""The search for a fitting round when a new shape arrives (variants.search_rounds).

Pure functions of modeled peaks and XLA's figures: checked on the rule's own
assumption (hypothesis) and on figures measured by experiments/bench_recompile.py.
"""

import collections.abc
import dataclasses
import types

from hypothesis import given, settings, strategies as st
import pytest

from jax_symmem._src import analysis
from jax_symmem._src import variants

MiB = 2**20


@st.composite
def searches(draw):
  n = draw(st.integers(2, 16))
  drops = draw(st.lists(st.integers(0, 60), min_size=n - 1, max_size=n - 1))
  peaks = [1000]
  for d in drops:
    peaks.append(peaks[-1] - d)
  ratio = draw(st.floats(0.8, 1.25))
  budget = draw(st.integers(min(peaks) // 2, 1200))
  return peaks, ratio, budget, draw(st.data())


@settings(max_examples=300, deadline=None)
@given(searches())
def test_two_compiles_when_the_error_does_not_grow(search):
  # XLA's figure of round k is ratio x its modeled peak, so the model was off by
  # e = |ratio - 1| x peak_k there; every other round's figure is off from ratio x its
  # peak by at most e. Then if any later round fits by ratio x peak + e, the second
  # compile fits.
  peaks, ratio, budget, data = search
  fits = lambda b: b <= budget
  k = analysis.first_round(peaks, fits)[0]
  e = abs(ratio - 1) * peaks[k]
  off = st.one_of(st.sampled_from([-int(e), int(e)]), st.integers(-int(e), int(e)))
  xla = [int(ratio * p) + (0 if j == k else data.draw(off)) for j, p in enumerate(peaks)]
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits)
  assert tried[0] == (k, xla[k])
  assert len({j for j, _ in tried}) == len(tried)          # no round compiled twice
  n = 1 + variants.MAX_RECOMPILES
  capped, extra = tried[:n], tried[n:]
  if fits(xla[k]):
    assert len(tried) == 1
  elif any(fits(int(xla[k] / peaks[k] * peaks[j] + e)) for j in range(k + 1, len(peaks))):
    assert len(tried) == 2 and fits(tried[-1][1])
  # Past the cap only on the way to a refusal, and only until a round fits.
  assert not extra or not any(fits(x) for _, x in capped)
  assert not any(fits(x) for _, x in extra[:-1])
  # Before refusing, every round that the most favourable XLA/model ratio of the capped
  # search predicts within the budget was tried: one that fits is never missed.
  best = min(x / peaks[j] for j, x in capped)
  if len(capped) == n and any(fits(int(best * peaks[j])) and fits(xla[j])
                              for j in range(len(peaks)) if j not in dict(capped)):
    assert fits(tried[-1][1])
  if any(fits(x) for x in xla):   # a fitting round tried last, or the search ran out
    assert fits(tried[-1][1]) or len(tried) >= n or (
        {j for j, _ in tried} >= {len(peaks) - 1, 0})


def test_a_prediction_a_fraction_of_a_byte_under_the_budget_is_not_a_fit():
  # Found by the property above: XLA's figure for round 0 is 1140 (ratio 1.14, off by
  # 140); round 7 predicts 1.14 x 842 + 140 = 1099.88 under a budget of 1099, and its
  # figure can be 1100. Rounded down, the search compiled round 7, then round 8.
  peaks = [1000, 1000, 1000, 1000, 1000, 962, 902, 842, 841]
  fits = lambda b: b <= 1099
  assert variants.next_round(peaks, 0, 1140, 1000, {0}, fits) == 8


# Gradient accumulation (bench_models' llama_accum, s=512): modeled peak / XLA footprint
# of rounds 0..22 in MiB as symmem.jit compiles them under a budget (bench_recompile.py).
_ACCUM_512 = [(285.1, 277.2), (281.1, 277.2), (277.1, 277.2), (273.1, 274.2), (269.1, 270.2),
              (264.1, 259.2), (250.1, 253.2), (218.1, 227.2), (195.5, 201.5), (183.3, 193.4),
              (174.1, 182.7), (169.4, 182.7), (166.4, 180.7), (162.4, 173.7), (159.4, 167.7),
              (158.4, 162.7), (152.0, 157.3), (141.9, 149.3), (140.0, 138.5), (140.0, 136.5),
              (132.0, 136.5), (132.0, 134.5), (132.0, 134.5)]


def test_the_measured_gradient_accumulation_step_fits_in_two_compiles():
  # bench_models' budget (179.0 MiB): the model picks round 10, XLA reports 182.7; the
  # ratio alone predicted round 11 (XLA 182.7 again) and a third compile; with the
  # error as margin the second compile is round 13 (173.7 MiB).
  peaks = [int(m * MiB) for m, _ in _ACCUM_512]
  xla = [int(x * MiB) for _, x in _ACCUM_512]
  budget = int(179.04 * MiB)
  fits = lambda b: b <= budget
  k = analysis.first_round(peaks, fits)[0]
  assert k == 10
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits)
  assert [j for j, _ in tried] == [10, 13]
  ratio_alone = variants.next_round(peaks, 10, xla[10], xla[10], {10}, fits)
  assert ratio_alone == 11 and not fits(xla[11])


def test_over_budget_everywhere_tries_every_round_the_step_as_written_last():
  peaks, xla = [100, 90, 80], [130, 120, 110]
  fits = lambda b: b <= 50
  k, fit = analysis.first_round(peaks, fits)
  assert (k, fit) == (2, False)   # nothing fits: the smallest modeled peak
  tried = variants.search_rounds(peaks, k, 80, xla.__getitem__, fits)
  # The model's pick (the last round), the rest, and round 0 (jax.jit's program, which
  # no ratio puts within the budget) before the refusal.
  assert [j for j, _ in tried] == [2, 1, 0]


def test_a_round_the_model_overestimates_is_tried_before_giving_up():
  # The step as written (last round) is modeled well, round 3 overestimated (the model
  # counts a loop body's unfused chain op by op): nothing fits by the model, round 3 by XLA.
  peaks, xla = [400, 300, 250, 190, 150], [390, 290, 240, 143, 147]
  fits = lambda b: b <= 146
  k = analysis.first_round(peaks, fits)[0]
  assert k == 4
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits)
  assert [j for j, _ in tried] == [4, 3] and fits(tried[-1][1])   # round 0 (390) not compiled


def test_an_annotated_step_tries_its_round_as_written_before_the_other_rounds():
  # A ViT with nn.remat on each block (b=64): the planner's rounds 0-18, then the step as
  # written (19: jax.jit's program, 116.4 MiB modeled). The model picks round 16 under a
  # 118.6 MiB budget; XLA reports the planner's rounds over it, the step as written
  # within (109.8 MiB). It must be compiled before the search runs out of recompiles
  # (it sorted after round 17 by modeled peak, and a BudgetError followed).
  peaks = [300 - 12 * j for j in range(19)] + [116]
  xla = [p * 17 // 10 for p in peaks[:19]] + [110]
  fits = lambda b: b <= 118
  k = analysis.first_round(peaks, fits)[0]
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, last=18,
                                 as_written=19)
  assert [j for j, _ in tried][:3] == [k, 18, 19] and fits(tried[-1][1])
  assert len(tried) <= 1 + variants.MAX_RECOMPILES


# transformers' Flax BERT (experiments.third_party, b=4, s=512): predicted footprint / XLA's
# figure of rounds 0..13 in MiB as symmem.jit compiles them under a budget. The planner's
# last round is predicted as rounds 10-12 and comes out 16 MiB over them (XLA runs other
# work beside its regeneration of attention scores).
_BERT_512 = [(114.5, 121.6), (114.5, 120.6), (112.5, 119.6), (67.5, 74.6), (67.5, 74.6),
             (68.5, 75.6), (68.5, 75.6), (63.0, 66.1), (63.0, 66.1), (63.0, 63.1), (61.0, 62.1),
             (61.0, 62.1), (61.0, 62.1), (61.0, 78.1)]


def test_jax_jits_program_far_over_the_budget_is_not_compiled_on_the_way():
  # Under 64.2 MiB the search compiled rounds 7, 13, 0 (121.6 MiB) and then 10: round 0,
  # jax.jit's program, waits until a refusal would otherwise follow.
  peaks = [int(p * MiB) for p, _ in _BERT_512]
  xla = [int(x * MiB) for _, x in _BERT_512]
  fits = lambda b: b <= int(64.2 * MiB)
  k = analysis.first_round(peaks, fits)[0]
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, last=13)
  assert [j for j, _ in tried] == [7, 13, 10] and fits(tried[-1][1])


def test_before_refusing_the_rounds_the_best_ratio_puts_within_the_budget_are_tried():
  # The tiny Llama with `dots_saveable` layers (unrolled) at b=2, s=128, as symmem.jit
  # compiles it, in 10 KiB units: predicted footprints and XLA's figures of rounds 0-11
  # (10 the planner's last, 11 as written). Under 5.7 MiB the capped search compiled
  # rounds 3, 10, 11 and 9, all over, and raised BudgetError; rounds 5-7 fit. The step as
  # written (11) is no longer compiled on the way: neither the model (649) nor the best
  # ratio seen (577 / 528) puts it within the budget.
  peaks = [786, 786, 767, 528, 545, 498, 498, 482, 551, 481, 482, 649]
  xla = [822, 823, 810, 577, 597, 564, 545, 537, 576, 598, 585, 674]
  fits = lambda b: b <= 570
  k = analysis.first_round(peaks, fits)[0]
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, last=10,
                                 as_written=11)
  assert [j for j, _ in tried] == [3, 10, 9, 7] and fits(tried[-1][1])
  # A budget below every round refuses only after every round was compiled...
  fits = lambda b: b <= 400
  tried = variants.search_rounds(peaks, analysis.first_round(peaks, fits)[0], peaks[9],
                                 xla.__getitem__, fits, last=10, as_written=11)
  assert sorted(j for j, _ in tried) == list(range(len(peaks)))
  # ...unless what every round holds (XLA's arguments and outputs) is over the budget.
  tried = variants.search_rounds(peaks, analysis.first_round(peaks, fits)[0], peaks[9],
                                 xla.__getitem__, fits, last=10, as_written=11,
                                 resident=lambda: 401)
  assert len(tried) == 1 and not fits(tried[0][1])


# transformers' Flax BART (experiments.third_party, b=4, s=512; experiments/results/
# bench_recompile_third_party.json), MiB: predicted footprint / XLA's figure of rounds
# 0..13 under a budget. Round 5 comes out 6 MiB below every round after it.
_BART_512 = [(150.4, 154.5), (123.4, 128.1), (96.1, 97.7), (57.6, 58.2), (57.1, 57.7),
             (56.6, 50.7), (56.6, 56.7), (56.1, 56.7), (56.1, 56.7), (56.1, 56.7), (56.1, 56.7),
             (56.1, 56.7), (56.1, 56.7), (56.1, 56.7)]


@pytest.mark.parametrize("budget_mib", [50.7, 53.0, 56.0])
def test_a_round_far_below_its_neighbours_is_found_before_a_refusal(budget_mib):
  # Only round 5 fits these budgets. The search by XLA/model ratios compiled rounds 7, 13,
  # 8, 9 and 0 and refused (no ratio seen puts round 5, predicted 56.6, within them).
  peaks = [int(p * MiB) for p, _ in _BART_512]
  xla = [int(x * MiB) for _, x in _BART_512]
  fits = lambda b: b <= int(budget_mib * MiB) + MiB // 20
  assert [k for k, x in enumerate(xla) if fits(x)] == [5]
  k = analysis.first_round(peaks, fits)[0]
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, scale={}, last=13)
  assert tried[-1][0] == 5 and len({j for j, _ in tried}) == len(tried)


# transformers' Flax BigBird (experiments.third_party, b=4, s=512), MiB: predicted footprint /
# XLA's figure of rounds 0..24 under a budget. The model underestimates the later rounds
# more and more (XLA's scatter-adds of the gathered blocks' gradients): rounds 10-24 are
# predicted 39.3-43.6 and come out 46.6-53.7.
_BIG_BIRD_512 = [
    (90.7, 90.0), (93.7, 93.0), (88.1, 88.3), (84.2, 86.4), (78.7, 81.0), (76.7, 79.0),
    (74.4, 81.2), (76.3, 77.4), (45.9, 47.5), (43.6, 45.5), (43.6, 49.1), (43.6, 46.8),
    (43.4, 50.4), (43.4, 47.7), (43.4, 53.7), (42.6, 53.7), (41.2, 53.3), (41.2, 52.9),
    (41.2, 52.9), (41.2, 46.6), (40.9, 46.6), (39.8, 46.6), (39.8, 47.4), (39.6, 46.6),
    (39.3, 46.6)]


def test_before_refusing_the_round_its_compiled_neighbours_predict_lowest_comes_first():
  # Only round 9 fits 46 MiB. The capped search compiles 8 (just over), 15, 24 and 23; by
  # increasing modeled peak the rounds left came in the order 22, 21, ..., 10, 9: 16
  # compiles. Round 9's neighbours on the ladder (8 and 15, XLA/model 1.03 and 1.26) put
  # it lowest of those left.
  peaks = [int(p * MiB) for p, _ in _BIG_BIRD_512]
  xla = [int(x * MiB) for _, x in _BIG_BIRD_512]
  fits = lambda b: b <= 46 * MiB
  assert [k for k, x in enumerate(xla) if fits(x)] == [9]
  k = analysis.first_round(peaks, fits)[0]
  tried = [j for j, _ in variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits,
                                                scale={}, last=24)]
  assert tried[:1 + variants.MAX_RECOMPILES] == [8, 15, 24, 23] and tried[-1] == 9
  assert len(tried) == 2 + variants.MAX_RECOMPILES


# A Flax ResNet (BatchNorm, 3x3 convs) at b=8, 64x64, measured by a helper probing conv
# nets: the model, which counts every value, overestimates round 0 by 1.5x (XLA fuses).
_RESNET = [(34.2, 22.9), (30.1, 25.9), (26.1, 29.4), (23.0, 28.9), (16.0, 22.9), (13.8, 21.9),
           (13.3, 19.9)]


def test_a_first_round_that_fits_at_once_checks_one_that_recomputes_less():
  peaks = [int(m * MiB) for m, _ in _RESNET]
  xla = [int(x * MiB) for _, x in _RESNET]
  fits = lambda b: b <= int(33.45 * MiB)   # jax.jit's own footprint as the budget
  k = analysis.first_round(peaks, fits)[0]
  assert k == 1
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, scale={})
  assert tried == [(1, xla[1]), (0, xla[0])]   # round 0 fits too, and recomputes nothing
  # Without a budget (no scale) the first round is kept as it is; a ratio measured for
  # round 0 at another shape that says it does not fit is believed.
  assert variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits) == [(1, xla[1])]
  assert variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits,
                                scale={0: 1.0}) == [(1, xla[1])]


def test_a_ratio_from_a_smaller_shape_does_not_keep_round_zero_untried():
  # A DP-SGD step (found by a probe): round 0 read XLA / model = 1.52 at s=64, where
  # the model's peak is 19.6 MiB and outputs XLA allocates apart weigh a lot. At s=256
  # (model 69.6 MiB, XLA 67.7) that ratio predicted 105.9 MiB over an 89.3 MiB budget,
  # so round 1 ran although round 0 fit. Only ratios measured at a shape at least as
  # large transfer; without one, the ratio of the round just compiled here is used.
  peaks = [int(69.6 * MiB), int(60.0 * MiB)]
  xla = [int(67.7 * MiB), int(58.0 * MiB)]
  fits = lambda b: b <= int(89.3 * MiB)
  at_64 = ({0: 1.52}, {0: int(19.6 * MiB)})
  scale = variants.transferable(*at_64, peaks)
  assert scale == {}
  assert variants.search_rounds(peaks, 1, peaks[1], xla.__getitem__, fits, scale=scale) == [
      (1, xla[1]), (0, xla[0])]
  # Measured at a shape as large or larger, the ratio is believed (as before).
  at_512 = ({0: 1.52}, {0: int(165.1 * MiB)})
  scale = variants.transferable(*at_512, peaks)
  assert scale == {0: 1.52}
  assert variants.search_rounds(peaks, 1, peaks[1], xla.__getitem__, fits, scale=scale) == [
      (1, xla[1])]


def test_first_round_reads_peaks_only_up_to_the_first_that_fits():
  values, read = [300, 200, 100, 50], []
  class Peaks(collections.abc.Sequence):   # as analysis.RoundPeaks: each read is a model run
    def __len__(self):
      return len(values)
    def __getitem__(self, k):
      read.append(k)
      return values[k]
  assert analysis.first_round(Peaks(), lambda b: b <= 200) == (1, True)
  assert read == [0, 1]
  assert analysis.first_round([300, 120, 120, 200], lambda b: b <= 100) == (1, False)  # earliest of equals


def test_the_fallback_is_the_planners_last_round_not_the_step_as_written():
  # An annotated step keeps its round as written after the planned ones (here round 5);
  # it can need more memory than the planner's last round (a probe: 12.5-13.0 MiB
  # against 10.6 MiB, and BudgetError after 4 compiles although rounds 8-11 fit).
  peaks = [100, 90, 80, 70, 60, 95]
  xla = [int(1.3 * p) for p in peaks]   # the model underestimates every round
  fits = lambda b: b <= 80
  k, _ = analysis.first_round(peaks, fits)
  assert k == 2 and not fits(xla[k])
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, last=4)
  assert [j for j, _ in tried] == [2, 4] and fits(tried[-1][1])


def test_a_budget_error_prints_mib_though_other_arrays_hold_a_few_bytes():
  # A probe's BudgetError printed every figure in bytes: 8 bytes held by other live
  # arrays made the budget and the budget less them read the same in MiB.
  assert variants.over_budget(138_637_612, 124_385_029, 8) == (
      "132.2 MiB",
      "the 118.6 MiB that the 118.6 MiB budget leaves beside 8 bytes held by other live arrays")
  assert variants.over_budget(138_637_612, 124_385_029) == ("132.2 MiB", "the 118.6 MiB budget")
  # Bytes where the figure and the room would read the same.
  assert variants.over_budget(124_385_030, 124_385_029)[0] == "124,385,030 bytes"
  # Other arrays holding more than the budget leave no room (it read "-139,864 bytes"),
  # and what the arguments and outputs alone take shares the figures' units (it read
  # "0.3 MiB" beside a room of "0.3 MiB").
  assert variants.over_budget(700_000, 600_000, 739_864, 500_000) == (
      "0.7 MiB", "the 0.6 MiB budget, which 0.7 MiB held by other live arrays already fill",
      "0.5 MiB")
  assert variants.over_budget(300_000, 700_000, 400_000, 330_000) == (
      "300,000 bytes", "the 300,000 bytes that the 0.7 MiB budget leaves beside 0.4 MiB held by "
      "other live arrays", "330,000 bytes")
  # No memory_budget given: the bound is the device's own limit, and the message says so.
  assert variants.over_budget(138_637_612, 124_385_029, device_limit=True) == (
      "132.2 MiB", "the device's 118.6 MiB limit")
  assert variants.over_budget(300_000, 700_000, 400_000, device_limit=True)[1] == (
      "the 300,000 bytes that the device's 0.7 MiB limit leaves beside 0.4 MiB held by other "
      "live arrays")
  assert variants.over_budget(700_000, 600_000, 739_864, device_limit=True)[1] == (
      "the device's 0.6 MiB limit, which 0.7 MiB held by other live arrays already fill")


# --- refinement when a shape comes back (variants.refine_round) -------------------------

# bench_models' unrolled Llama at b=4, s=512 (experiments/bench_recompile.py at 26e6847):
# modeled peak / XLA footprint of rounds 0..20 in MiB, as symmem.jit compiles them.
_LLAMA_512 = [(435, 442), (431, 440), (401, 426), (383, 424), (340, 376), (322, 376), (271, 328),
              (246, 296), (242, 296), (221, 274), (214, 270), (211, 270), (202, 252), (201, 252),
              (188, 235), (187, 217), (169, 195), (168, 185), (168, 185), (168, 185), (167, 185)]


def test_a_recurring_shape_moves_to_the_smallest_fitting_round():
  # bench_models' budget, 1.25 x per-layer checkpointing's real peak (280.1 MiB): the
  # model picks round 6 (XLA 328), the jump with the error as margin round 16 (195: it
  # fits, and 2 compiles were enough), while round 9 (274) fits too and recomputes less.
  peaks = [m * MiB for m, _ in _LLAMA_512]
  xla = [x * MiB for _, x in _LLAMA_512]
  fits = lambda b: b <= int(280.1 * MiB)
  k = analysis.first_round(peaks, fits)[0]
  tried = variants.search_rounds(peaks, k, peaks[k], xla.__getitem__, fits, scale={})
  assert [j for j, _ in tried] == [6, 16]
  j = variants.refine_round(peaks, tried, fits)
  assert j == 9 and fits(xla[j]) and min(k for k, x in enumerate(xla) if fits(x)) == 9
  assert variants.refine_round(peaks, tried + [(9, xla[9])], fits) is None   # nothing between 6 and 9


def test_refinement_only_where_a_round_before_the_fitting_one_is_predicted_to_fit():
  peaks, xla = [100, 90, 80], [130, 100, 85]
  fits = lambda b: b <= 100
  assert variants.refine_round(peaks, [(1, xla[1])], fits) is None   # round 0: 111 by 1's ratio
  assert variants.refine_round(peaks, [(0, xla[0]), (2, xla[2])], lambda b: b <= 50) is None
  # Adjacent rounds: nothing between them.
  assert variants.refine_round(peaks, [(0, xla[0]), (1, xla[1])], fits) is None
  # No round over the budget compiled: round 1 predicted by round 2's ratio (95.6).
  assert variants.refine_round(peaks, [(2, xla[2])], fits) == 1


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_refinement_is_exact_where_xla_interpolates_between_the_rounds_compiled(data):
  # Where XLA's ratio to the model moves linearly along the ladder between the compiled
  # rounds (a over budget, b fitting) and stays at a's before a, the round refine_round
  # picks fits and is the first one before b that does; with none, None.
  n = data.draw(st.integers(3, 14))
  peaks = [1000]
  for d in data.draw(st.lists(st.integers(-20, 80), min_size=n - 1, max_size=n - 1)):
    peaks.append(max(1, peaks[-1] - d))   # modeled peaks need not fall round by round
  a = data.draw(st.integers(0, n - 3))
  b = data.draw(st.integers(a + 2, n - 1))
  ends = {a: int(data.draw(st.floats(0.9, 1.3)) * peaks[a]),
          b: int(data.draw(st.floats(0.9, 1.3)) * peaks[b])}
  ra, rb = ends[a] / peaks[a], ends[b] / peaks[b]
  ratio = lambda j: ra if j < a else ra + (j - a) / (b - a) * (rb - ra)
  xla = [ends.get(j, int(ratio(j) * peaks[j])) for j in range(n)]
  budget = data.draw(st.integers(xla[b], max(xla[b], xla[a] - 1)))
  fits = lambda x: x <= budget
  if fits(xla[a]):
    return
  j = variants.refine_round(peaks, [(a, xla[a]), (b, xla[b])], fits)
  before = [i for i in range(b) if i != a and fits(xla[i])]
  assert j == (before[0] if before else None)


def test_refinement_reads_xla_ratio_by_position_on_the_ladder():
  # BigBird at s=384 (experiments/results/bench_recompile_big_bird.json), MiB: rounds 9-24
  # have nearly equal modeled peaks and XLA's ratio to them grows along the ladder. Under
  # 38.2 MiB the first call compiled rounds 8 (38.6), 15 (41.8) and 24 (37.1, fits).
  # Interpolated by modeled peak, rounds 16 and 23 were refined to (both by 15's and 24's
  # ratios, the peaks alike); by position, round 9, next to round 8, is predicted at 37.9:
  # it fits (36.4), 15 rounds less recomputation on every later call.
  peaks = [int(p * MiB) for p in (70.05, 72.30, 68.18, 65.39, 61.39, 59.90, 58.21, 58.57, 36.87,
                                  35.41, 35.41, 35.41, 35.25, 35.25, 35.25, 34.62, 32.66, 32.66,
                                  32.66, 32.66, 32.66, 32.44, 32.44, 32.21, 32.21)]
  xla = {8: 38.60, 9: 36.41, 15: 41.77, 24: 37.11}
  fits = lambda b: b <= int(38.2 * MiB)
  tried = [(k, int(xla[k] * MiB)) for k in (8, 15, 24)]
  assert variants.refine_round(peaks, tried, fits) == 9 and fits(int(xla[9] * MiB))


def test_the_long_search_warning_prints_bytes_where_figures_read_the_same(caplog):
  # A probe's tiny NNX step: every round XLA compiled read 5.4 MiB beside 5.4 MiB of room.
  step = types.SimpleNamespace(traced=types.SimpleNamespace(fun_name="train_step"),
                               rounds=[None] * 14)
  compiled = [variants.Variant({"s": 128}, k, None, n, True)
              for k, n in ((2, 5_662_244), (13, 5_650_180), (3, 5_656_388))]
  policy = variants.CompilePolicy(budget=7_233_699, reserved=1_622_240)
  with caplog.at_level("WARNING"):
    variants._warn_long_search(step, {"s": 128}, compiled, policy)
  assert ("(round 2 5,662,244 bytes, round 13 5,650,180 bytes, round 3 5,656,388 bytes; "
          "5,611,459 bytes available): the other rounds (11)") in caplog.text
  far_apart = [variants.Variant({"s": 128}, 2, None, 9 * 2**20, True)]
  with caplog.at_level("WARNING"):
    variants._warn_long_search(step, {"s": 128}, far_apart, policy)
  assert "(round 2 9.0 MiB; 5.4 MiB available)" in caplog.text
  with caplog.at_level("WARNING"):
    variants._warn_long_search(step, {"s": 128}, far_apart,
                               dataclasses.replace(policy, device_limit=True))
  assert "none within the device's limit by XLA's memory_analysis()" in caplog.text
