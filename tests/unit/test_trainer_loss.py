"""The training objectives against values computed by hand (numbers written here)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from prime_hpc.trainer.loss import k3, rl_loss, sft_loss, token_logprobs

# Four loss tokens and one padding token (mask False). Trainer / inference probabilities:
P = [0.5, 0.25, 0.8, 0.1, 0.3]
P_INF = [0.25, 0.5, 0.4, 0.1, 0.9]
A = [1.0, -1.0, -1.0, 2.0, 5.0]
MASK = [True, True, True, True, False]


def tensors():
    lp = torch.tensor([[math.log(p) for p in P]], dtype=torch.float64, requires_grad=True)
    ilp = torch.tensor([[math.log(p) for p in P_INF]], dtype=torch.float64)
    return lp, ilp, torch.tensor([A], dtype=torch.float64), torch.tensor([MASK])


def cfg(**kw):
    base = dict(
        type="dppo",
        mask_low=0.2,
        mask_high=0.2,
        clip_low=0.2,
        clip_high=0.28,
        kl_coef=0.0,
        seq_clip_low=3e-4,
        seq_clip_high=4e-4,
        ref_kl_coef=0.0,
    )
    return SimpleNamespace(**{**base, **kw})


# k3 per token: r - log r - 1 with r = 2, 0.5, 2, 1 on the four loss tokens
K3 = [2 - math.log(2) - 1, 0.5 + math.log(2) - 1, 2 - math.log(2) - 1, 0.0]


def test_dppo_masks_tokens_that_moved_too_far_in_the_advantage_direction():
    lp, ilp, adv, mask = tensors()
    out = rl_loss(lp, ilp, adv, mask, cfg(), normalizer=4)
    # token 0: p - p_inf = +0.25 > 0.2 with A > 0  -> masked (positive)
    # token 1: p - p_inf = -0.25 < -0.2 with A < 0 -> masked (negative)
    # token 2: p - p_inf = +0.4 but A < 0: kept, r = 2: -(2 * -1 * log 0.8)
    # token 3: r = 1: -(1 * 2 * log 0.1)
    expected = (0 + 0 + 2 * math.log(0.8) - 2 * math.log(0.1)) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.loss.item() == pytest.approx(1.0397208, abs=1e-6)
    assert out.sums["masked_positive"].item() == 1 and out.sums["masked_negative"].item() == 1
    assert out.sums["tokens"].item() == 4
    assert out.sums["mismatch_kl"].item() == pytest.approx(sum(K3), abs=1e-12)
    out.loss.backward()
    # d/d lp = -w * A / 4: masked tokens and the padding token get no gradient
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.5, -0.5, 0.0], abs=1e-12)


def test_dppo_thresholds_are_separate():
    lp, ilp, adv, mask = tensors()
    # mask_high=0.3 keeps token 0 (+0.25 is below it); token 1 still masked
    out = rl_loss(lp, ilp, adv, mask, cfg(mask_high=0.3), normalizer=4)
    expected = (-(2 * 1 * math.log(0.5)) + 2 * math.log(0.8) - 2 * math.log(0.1)) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.sums["masked_positive"].item() == 0 and out.sums["masked_negative"].item() == 1


def test_cispo_clips_the_ratio_weight_but_keeps_every_token():
    lp, ilp, adv, mask = tensors()
    out = rl_loss(lp, ilp, adv, mask, cfg(type="cispo"), normalizer=4)
    # r = 2, 0.5, 2, 1 -> clipped into [0.8, 1.28] -> w = 1.28, 0.8, 1.28, 1
    w = [1.28, 0.8, 1.28, 1.0]
    per_token = [-(w[i] * A[i] * math.log(P[i])) for i in range(4)]
    assert per_token == pytest.approx([0.887228, -1.109035, -0.285624, 4.605170], abs=1e-6)
    assert out.loss.item() == pytest.approx(sum(per_token) / 4, abs=1e-12)
    # clipped tokens by advantage sign: token 0 (A>0); tokens 1, 2 (A<0)
    assert out.sums["masked_positive"].item() == 1 and out.sums["masked_negative"].item() == 2
    out.loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.28 / 4, 0.8 / 4, 1.28 / 4, -2 / 4, 0.0], abs=1e-12)  # -w * A / 4


def test_gspo_weighs_every_token_of_a_sequence_by_its_geometric_mean_ratio():
    # two sequences of two loss tokens (+ one pad each); token ratios r = p / p_inf
    p = [[0.5, 0.2, 0.3], [0.3, 0.6, 0.9]]
    p_inf = [[0.25, 0.4, 0.3], [0.3, 0.6, 0.1]]  # row 0: r = 2, 0.5 -> s = sqrt(1) = 1; row 1: r = 1, 1 -> s = 1
    lp = torch.tensor([[math.log(x) for x in row] for row in p], dtype=torch.float64, requires_grad=True)
    ilp = torch.tensor([[math.log(x) for x in row] for row in p_inf], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    out = rl_loss(lp, ilp, adv, mask, cfg(type="gspo"), normalizer=4)
    # s = 1 for both rows: the plain policy gradient, nothing masked (a token ratio of 2
    # would be masked by dppo and clipped by cispo)
    assert out.loss.item() == pytest.approx(
        -(math.log(0.5) + math.log(0.2) - 2 * math.log(0.3) - 2 * math.log(0.6)) / 4, abs=1e-12
    )
    assert out.sums["masked_positive"].item() == 0 and out.sums["masked_negative"].item() == 0
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.5, 0.5, 0.0], abs=1e-12)  # -s * A / 4

    # row 0 moved up: r = 2, 2 -> s = 2 > 1 + 4e-4 with A > 0: masked; row 1: r = 0.5, 0.5 -> s = 0.5 < 1 - 3e-4
    # with A < 0: masked too; with A of the other sign each keeps weight s
    p = [[0.5, 0.2, 0.3], [0.3, 0.4, 0.9]]
    p_inf = [[0.25, 0.1, 0.3], [0.6, 0.8, 0.1]]
    lp = torch.tensor([[math.log(x) for x in row] for row in p], dtype=torch.float64, requires_grad=True)
    ilp = torch.tensor([[math.log(x) for x in row] for row in p_inf], dtype=torch.float64)
    out = rl_loss(lp, ilp, adv, mask, cfg(type="gspo"), normalizer=4)
    assert out.loss.item() == 0.0
    assert out.sums["masked_positive"].item() == 2 and out.sums["masked_negative"].item() == 2
    flipped = -adv
    out = rl_loss(lp, ilp, flipped, mask, cfg(type="gspo"), normalizer=4)
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx(
        [2 * 1 / 4, 2 * 1 / 4, 0.0, -0.5 * 2 / 4, -0.5 * 2 / 4, 0.0], abs=1e-12
    )  # -s * A / 4 with A = -1 resp. +2


def test_reference_kl_adds_k3_of_the_frozen_policy_with_its_gradient():
    lp, ilp, adv, mask = tensors()
    ref = torch.tensor([[math.log(p) for p in [0.25, 0.25, 0.8, 0.2, 0.5]]], dtype=torch.float64)
    plain = rl_loss(lp, ilp, adv, mask, cfg(), normalizer=4)
    out = rl_loss(lp, ilp, adv, mask, cfg(ref_kl_coef=0.5), normalizer=4, ref_logprobs=ref)
    # per loss token q = p_ref / p = 0.5, 1, 1, 2: k3 = q - log q - 1 (the padding token never counts)
    ref_k3 = [0.5 + math.log(2) - 1, 0.0, 0.0, 2 - math.log(2) - 1]
    assert out.sums["ref_kl"].item() == pytest.approx(sum(ref_k3), abs=1e-12)
    assert out.loss.item() == pytest.approx(plain.loss.item() + 0.5 * sum(ref_k3) / 4, abs=1e-12)
    lp.grad = None
    out.loss.backward()
    # d/d lp of 0.5 * (q - log q - 1) = 0.5 * (1 - q): on top of dppo's -w * A / 4
    extra = [0.5 * (1 - q) / 4 for q in (0.5, 1.0, 1.0, 2.0)]
    assert lp.grad[0].tolist() == pytest.approx(
        [0.0 + extra[0], 0.0 + extra[1], 0.5 + extra[2], -0.5 + extra[3], 0.0], abs=1e-12
    )
    assert "ref_kl" not in rl_loss(lp, ilp, adv, mask, cfg(), normalizer=4, ref_logprobs=ref).sums  # coef 0: off


def test_kl_term_adds_k3_with_its_gradient():
    lp, ilp, adv, mask = tensors()
    out = rl_loss(lp, ilp, adv, mask, cfg(kl_coef=0.1), normalizer=4)
    expected = (2 * math.log(0.8) - 2 * math.log(0.1) + 0.1 * sum(K3)) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    out.loss.backward()
    # d k3 / d lp = r - 1 = 1, -0.5, 1, 0 (masked dppo tokens still get the KL gradient)
    pg = [0.0, 0.0, 2.0, -2.0]
    klg = [1.0, -0.5, 1.0, 0.0]
    assert lp.grad[0, :4].tolist() == pytest.approx([(pg[i] + 0.1 * klg[i]) / 4 for i in range(4)], abs=1e-12)


def test_normalizer_is_the_global_token_count():
    lp, ilp, adv, mask = tensors()
    a = rl_loss(lp, ilp, adv, mask, cfg(), normalizer=4).loss.item()
    b = rl_loss(lp, ilp, adv, mask, cfg(), normalizer=8).loss.item()  # e.g. another rank has 4 more tokens
    assert b == pytest.approx(a / 2, abs=1e-12)


def test_k3_by_hand():
    lp = torch.tensor([math.log(0.5), math.log(0.5)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    assert k3(lp, ref).tolist() == pytest.approx([2 - math.log(2) - 1, 0.0], abs=1e-6)


def test_sft_loss_is_mean_nll_over_loss_tokens():
    lp, _, _, mask = tensors()
    out = sft_loss(lp, mask, normalizer=4)
    assert out.loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25) + math.log(0.8) + math.log(0.1)) / 4)


def test_token_logprobs_are_aligned_to_the_predicted_token():
    # vocab 2; logits at t predict token t+1. Row: [0, log 3] -> p = (0.25, 0.75)
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])
    lp, ent = token_logprobs(logits, ids)
    assert lp[0].tolist() == pytest.approx([0.0, math.log(0.75), math.log(0.5)], abs=1e-6)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert ent[0].tolist() == pytest.approx([0.0, h, math.log(2)], abs=1e-6)
    # temperature 2 halves the logits: [0, log 3]/2 -> p(1) = sqrt(3) / (1 + sqrt(3))
    lp_t, _ = token_logprobs(logits, ids, temperature=2.0)
    assert lp_t[0, 1].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


def test_head_logprobs_at_the_trained_positions_in_chunks_match_the_whole_logits_with_their_gradients():
    """Log-probabilities computed from the hidden states of the trained positions only, in
    one pass or a few positions at a time (backward recomputing each chunk's logits), are
    those of the whole logits there, and so are the gradients; elsewhere they are 0."""
    from prime_hpc.trainer.loss import at_positions, head_logprobs, trained_positions

    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 7))
    mask = torch.tensor([[True, False, True, True, False, False, True], [False] * 4 + [True] * 3])
    g = torch.randn(2, 7, dtype=torch.float64)

    lp_ref, ent_ref = token_logprobs(torch.nn.functional.linear(hidden, weight), ids, temperature=0.7)
    trained = mask.clone()
    trained[:, 0] = False  # nothing predicts a row's first token
    lp_ref, ent_ref = lp_ref * trained, ent_ref * trained
    grads_ref = torch.autograd.grad((lp_ref * g).sum(), (hidden, weight))
    positions = trained_positions(mask)
    assert positions.tolist() == [2, 3, 6, 11, 12, 13]
    h = hidden.reshape(-1, 5).index_select(0, positions - 1)
    y = ids.reshape(-1).index_select(0, positions)
    for rows in (None, 1, 4, 100):  # one pass; chunks of one position, uneven, and all at once
        lp, ent = head_logprobs(h, weight, y, temperature=0.7, rows=rows)
        lp, ent = at_positions(lp, positions, ids.shape), at_positions(ent, positions, ids.shape)
        assert torch.allclose(lp, lp_ref) and torch.allclose(ent, ent_ref)
        grads = torch.autograd.grad((lp * g).sum(), (hidden, weight), retain_graph=True)
        assert all(torch.allclose(a, b) for a, b in zip(grads, grads_ref))
    with torch.no_grad():
        lp, ent = head_logprobs(h, weight, y, temperature=0.7, with_entropy=False, rows=4)
    assert ent is None and torch.allclose(at_positions(lp, positions, ids.shape), lp_ref)


def test_the_head_runs_in_one_pass_unless_the_free_memory_says_otherwise():
    """`chunked_logprobs=auto`: one pass when its bytes fit in the share of the free memory
    (or the free memory is unknown), else chunks as large as that share allows; true:
    fixed chunks always (an earlier config's boolean is read the same); false: one pass."""
    from prime_hpc.trainer.loss import HEAD_BYTES_PER_LOGIT, ONE_PASS_SHARE, chunk_rows, head_chunk_rows

    per_row = HEAD_BYTES_PER_LOGIT * 1000
    fits = int(1000 * per_row / ONE_PASS_SHARE)
    assert head_chunk_rows(1000, 1000, "auto", fits) is None
    assert head_chunk_rows(1000, 1000, "auto", None) is None
    assert head_chunk_rows(1000, 1000, "auto", fits // 4) == 250  # four chunks
    assert head_chunk_rows(1000, 1000, "false", 1) is None
    assert head_chunk_rows(1000, 1000, "true", fits * 100) == chunk_rows(1000)
    assert head_chunk_rows(1000, 1000, True, fits * 100) == chunk_rows(1000)  # type: ignore[arg-type]
    assert head_chunk_rows(1000, 1000, False, 1) is None  # type: ignore[arg-type]


def test_gspo_of_packed_rows_takes_each_sample_s_own_ratio():
    """Two samples packed in one row (and padding) get the loss, gradient and masks of the
    same two samples as right-padded rows: the sequence ratio is per sample, not per row."""
    lp_rows = torch.tensor([[0.0, -1.0, -0.5, 0.0], [0.0, -0.2, -0.3, -0.9]], dtype=torch.float64)
    ilp_rows = torch.tensor([[0.0, -1.1, -0.4, 0.0], [0.0, -0.1, -0.3, -0.2]], dtype=torch.float64)
    adv_rows = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64)
    mask_rows = torch.tensor([[False, True, True, False], [False, True, True, True]])
    lengths = (3, 4)  # the first row's last token is padding
    packed = [torch.cat([t[0, :3], t[1], t.new_zeros(1)])[None] for t in (lp_rows, ilp_rows, adv_rows, mask_rows)]
    index = torch.tensor([[0] * lengths[0] + [1] * lengths[1] + [2]])
    c = cfg(type="gspo", seq_clip_low=0.05, seq_clip_high=0.05)
    lp_r = lp_rows.clone().requires_grad_(True)
    lp_p = packed[0].clone().requires_grad_(True)
    rows = rl_loss(lp_r, ilp_rows, adv_rows, mask_rows, c, normalizer=5)
    pack = rl_loss(lp_p, packed[1], packed[2], packed[3], c, normalizer=5, sample_index=index, num_samples=2)
    assert pack.loss.item() == pytest.approx(rows.loss.item(), abs=1e-12)
    for k in rows.sums:
        assert pack.sums[k].item() == pytest.approx(rows.sums[k].item(), abs=1e-12), k
    assert rows.sums["masked_negative"].item() > 0  # the second sample's ratio is past the clip
    rows.loss.backward()
    pack.loss.backward()
    assert torch.allclose(lp_p.grad[0, :7], torch.cat([lp_r.grad[0, :3], lp_r.grad[1]]))


# ----------------------------------------------------------------------------- adaptive KL weight
def test_the_step_s_reference_kl_weight_replaces_the_configured_one():
    """`ref_kl_coef` given to the loss (the controller's weight for the step) weighs the
    reference KL instead of `trainer.loss.ref_kl_coef`, in the loss, its gradient and the
    `loss` sum; the configured value only switches the term on."""
    lp, ilp, adv, mask = tensors()
    ref = torch.tensor([[math.log(p) for p in [0.25, 0.25, 0.8, 0.2, 0.5]]], dtype=torch.float64)
    ref_k3 = [0.5 + math.log(2) - 1, 0.0, 0.0, 2 - math.log(2) - 1]  # q = 0.5, 1, 1, 2
    plain = rl_loss(lp, ilp, adv, mask, cfg(), normalizer=4)
    out = rl_loss(lp, ilp, adv, mask, cfg(ref_kl_coef=0.5), normalizer=4, ref_logprobs=ref, ref_kl_coef=0.125)
    assert out.loss.item() == pytest.approx(plain.loss.item() + 0.125 * sum(ref_k3) / 4, abs=1e-12)
    assert out.sums["loss"].item() == pytest.approx(out.loss.item() * 4, abs=1e-12)
    assert out.sums["ref_kl"].item() == pytest.approx(sum(ref_k3), abs=1e-12)  # the KL itself, unweighted
    lp.grad = None
    out.loss.backward()
    extra = [0.125 * (1 - q) / 4 for q in (0.5, 1.0, 1.0, 2.0)]
    assert lp.grad[0].tolist() == pytest.approx([extra[0], extra[1], 0.5 + extra[2], -0.5 + extra[3], 0.0], abs=1e-12)
    # None: the configured weight, as before
    same = rl_loss(lp, ilp, adv, mask, cfg(ref_kl_coef=0.5), normalizer=4, ref_logprobs=ref, ref_kl_coef=None)
    assert same.loss.item() == pytest.approx(plain.loss.item() + 0.5 * sum(ref_k3) / 4, abs=1e-12)


def loss_cfg(**kw):
    return SimpleNamespace(**{**dict(ref_kl_coef=0.1, target_kl=0.01, kl_horizon=10), **kw})


def test_the_kl_controller_moves_the_weight_toward_the_target_by_at_most_a_fifth_per_horizon():
    from prime_hpc.trainer.loss import KLController

    ctl = KLController.start(loss_cfg())
    assert ctl.coef == 0.1
    # kl = 1.5 x target: error +0.5, clipped to +0.2 -> x (1 + 0.2 / 10)
    assert ctl.update(0.015) == pytest.approx(0.1 * 1.02, rel=1e-12)
    # kl = 1.1 x target: error +0.1 -> x 1.01
    assert ctl.update(0.011) == pytest.approx(0.1 * 1.02 * 1.01, rel=1e-12)
    # kl at the target: unchanged; below it: shrinks (0 KL: error -1 clipped to -0.2)
    assert ctl.update(0.01) == pytest.approx(0.1 * 1.02 * 1.01, rel=1e-12)
    assert ctl.update(0.0) == pytest.approx(0.1 * 1.02 * 1.01 * 0.98, rel=1e-12)
    # not measured (a step of teacher completions) or not finite: unchanged
    before = ctl.coef
    assert ctl.update(None) == before and ctl.update(float("nan")) == before and ctl.update(float("inf")) == before
    assert ctl.state() == {"ref_kl_coef": before}
    # horizon 1: a whole fifth per step
    assert KLController.start(loss_cfg(kl_horizon=1)).update(1.0) == pytest.approx(0.12, rel=1e-12)
    # no target: fixed, and nothing for the checkpoint
    fixed = KLController.start(loss_cfg(target_kl=None))
    assert fixed.update(1.0) == 0.1 and fixed.update(0.0) == 0.1 and fixed.state() == {}


def test_the_kl_controller_resumes_with_the_checkpoint_s_weight_and_refuses_a_bad_one():
    from prime_hpc.core.errors import UserError
    from prime_hpc.trainer.loss import KLController

    state = {"step": 3, "progress": {}, "ref_kl_coef": 0.37}
    assert KLController.start(loss_cfg(), state).coef == 0.37
    # a checkpoint written with a fixed weight (or before the controller): the configured value
    assert KLController.start(loss_cfg(), {"step": 3, "progress": {}}).coef == 0.1
    assert KLController.start(loss_cfg(), None).coef == 0.1
    # a fixed weight is the configuration's, whatever a checkpoint held
    assert KLController.start(loss_cfg(target_kl=None), state).coef == 0.1
    for bad in (0.0, -1.0, float("nan"), "0.3", True):
        with pytest.raises(UserError, match=r"^/x/state.json: ref_kl_coef .* is not a positive number; resume from"):
            KLController.start(loss_cfg(), {"ref_kl_coef": bad}, where="/x/state.json")
