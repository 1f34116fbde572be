"""Soft-label PRM losses: hand-computed values and gradients with a 0.7 target."""

import math

import pytest
import torch

from mmprm.scoring.losses import gather_steps, soft_bce_value, soft_ce_token_pair

SIG2 = 1 / (1 + math.exp(-2.0))  # 0.8807970779778823


def test_token_pair_soft_target_hand_computed():
    logits = torch.tensor([[2.0, 0.0]], requires_grad=True)
    loss = soft_ce_token_pair(logits, torch.tensor([0.7]))
    # log softmax = [-log(1 + e^-2), -2 - log(1 + e^-2)] = [-0.126928, -2.126928]
    want = 0.7 * 0.12692801104297263 + 0.3 * 2.1269280110429727
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert loss.item() == pytest.approx(0.7269280110, rel=1e-6)
    loss.backward()
    # d loss / d logits = softmax - [t, 1 - t]
    torch.testing.assert_close(logits.grad, torch.tensor([[SIG2 - 0.7, (1 - SIG2) - 0.3]]))
    torch.testing.assert_close(logits.grad, torch.tensor([[0.1807970779778823, -0.1807970779778823]]))


def test_target_is_not_rounded():
    logits = torch.tensor([[2.0, 0.0]])
    at = lambda t: soft_ce_token_pair(logits, torch.tensor([t])).item()  # noqa: E731
    # Linear in t: exactly 0.7 of the way from the t=0 loss to the t=1 loss.
    assert at(0.7) == pytest.approx(0.3 * at(0.0) + 0.7 * at(1.0), rel=1e-6)
    assert at(0.7) != pytest.approx(at(1.0)) and at(0.7) != pytest.approx(at(0.0))
    # Integer 0/1 labels are accepted and read as floats.
    assert soft_ce_token_pair(logits, torch.tensor([1])).item() == pytest.approx(at(1.0))


def test_value_head_bce_matches_pair_and_its_gradient():
    x = torch.tensor([2.0], requires_grad=True)
    loss = soft_bce_value(x, torch.tensor([0.7]))
    assert loss.item() == pytest.approx(0.7269280110, rel=1e-6)
    loss.backward()
    assert x.grad.item() == pytest.approx(SIG2 - 0.7, rel=1e-6)

    # Same loss and same gradient wrt the logit difference for the token pair.
    torch.manual_seed(0)
    pair = torch.randn(5, 2, requires_grad=True)
    diff = (pair[:, 0] - pair[:, 1]).detach().requires_grad_(True)
    t = torch.tensor([0.7, 0.0, 1.0, 0.25, 0.5])
    lp, lv = soft_ce_token_pair(pair, t), soft_bce_value(diff, t)
    torch.testing.assert_close(lp, lv)
    lp.backward()
    lv.backward()
    torch.testing.assert_close(pair.grad[:, 0], diff.grad)
    torch.testing.assert_close(pair.grad[:, 1], -diff.grad)


def test_mean_over_steps():
    logits = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    loss = soft_ce_token_pair(logits, torch.tensor([0.7, 0.3]))
    # Second row: uniform softmax, loss log 2 whatever the target.
    assert loss.item() == pytest.approx((0.7269280110 + math.log(2)) / 2, rel=1e-6)


def test_no_steps_gives_connected_zero():
    pair = torch.zeros(0, 2, requires_grad=True)
    loss = soft_ce_token_pair(pair, torch.zeros(0))
    assert loss.item() == 0.0
    loss.backward()
    v = torch.zeros(0, requires_grad=True)
    assert soft_bce_value(v, torch.zeros(0)).item() == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"pair_logits must be \(N, 2\)"):
        soft_ce_token_pair(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"targets must have shape \(2,\)"):
        soft_ce_token_pair(torch.zeros(2, 2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 1\]"):
        soft_bce_value(torch.zeros(2), torch.tensor([0.5, 1.5]))


def test_bf16_logits_are_computed_in_fp32():
    pair = torch.tensor([[2.0, 0.0]], dtype=torch.bfloat16)
    loss = soft_ce_token_pair(pair, torch.tensor([0.7]))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.7269280110, rel=1e-3)


def test_gather_steps_mask_and_positions_agree():
    values = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # (B, S, H)
    positions = [[1, 4], [2]]
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = mask[0, 4] = mask[1, 2] = True
    by_mask, by_pos = gather_steps(values, mask), gather_steps(values, positions)
    assert by_mask.shape == (3, 3)
    torch.testing.assert_close(by_mask, by_pos)
    torch.testing.assert_close(by_pos, torch.stack([values[0, 1], values[0, 4], values[1, 2]]))
    # (B, S) values give (N,), e.g. value-head logits.
    torch.testing.assert_close(gather_steps(values[..., 0], positions), torch.tensor([3.0, 12.0, 21.0]))
    # No steps at all.
    assert gather_steps(values, [[], []]).shape == (0, 3)


def test_gather_steps_errors():
    values = torch.zeros(2, 5, 3)
    with pytest.raises(ValueError, match="example 1 position 5 is outside sequence length 5"):
        gather_steps(values, [[0], [5]])
    with pytest.raises(ValueError, match="1 position lists for a batch of 2"):
        gather_steps(values, [[0]])
    with pytest.raises(ValueError, match=r"mask must be bool \(2, 5\)"):
        gather_steps(values, torch.zeros(2, 5, dtype=torch.long))


def test_weighted_losses_are_the_weighted_mean_of_per_step_losses():
    import torch

    from mmprm.scoring.losses import soft_bce_value, soft_ce_token_pair

    logits = torch.tensor([[1.0, -1.0], [0.2, 0.4], [-0.5, 0.5]])
    t = torch.tensor([1.0, 0.7, 0.0])
    w = torch.tensor([2.0, 1.0, 0.5])
    per = torch.stack([soft_ce_token_pair(logits[i : i + 1], t[i : i + 1]) for i in range(3)])
    assert torch.allclose(soft_ce_token_pair(logits, t, w), (w * per).sum() / w.sum())
    assert torch.allclose(soft_ce_token_pair(logits, t, torch.ones(3)), soft_ce_token_pair(logits, t))
    v = logits[:, 0] - logits[:, 1]
    per_v = torch.stack([soft_bce_value(v[i : i + 1], t[i : i + 1]) for i in range(3)])
    assert torch.allclose(soft_bce_value(v, t, w), (w * per_v).sum() / w.sum())
    # the token pair is the value head on the logit difference, weighted or not
    assert torch.allclose(soft_ce_token_pair(logits, t, w), soft_bce_value(v, t, w), atol=1e-6)
