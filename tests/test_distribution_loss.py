"""The drafter's hand-differentiated losses against the same formulas through autograd: equal values and equal
gradients, with target mass outside the draft vocabulary and labels the vocabulary lacks, so a mistake in the
closed-form backward fails here rather than as a drafter that learns a little worse."""

from __future__ import annotations

import torch

from backends.training.distribution_loss import distribution_losses


def reference(logits: torch.Tensor, target_logprobs: torch.Tensor, labels: torch.Tensor):
    logprobs = torch.log_softmax(logits, dim=-1)
    target = target_logprobs.exp()
    l1 = (logprobs.exp() - target).abs().sum(dim=-1) + (1.0 - target.sum(dim=-1)).clamp_min(0.0)
    ce = -logprobs.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return l1, ce


def test_values_and_gradients_match_autograd():
    generator = torch.Generator().manual_seed(0)
    shape = (3, 5, 7, 64)
    logits = (3.0 * torch.randn(shape, generator=generator, dtype=torch.float64)).requires_grad_()
    # the target keeps 90% of its mass inside this vocabulary, sharper than the draft at some positions
    target = torch.log_softmax(4.0 * torch.randn(shape, generator=generator, dtype=torch.float64), -1) + torch.log(
        torch.tensor(0.9, dtype=torch.float64)
    )
    labels = torch.randint(-1, shape[-1], shape[:-1], generator=generator)
    l1_weight, ce_weight = torch.rand(shape[:-1], generator=generator, dtype=torch.float64).unbind(0)[0], 0.1
    l1, ce = distribution_losses(logits, target, labels)
    (ours,) = torch.autograd.grad((l1 * l1_weight).sum() + ce_weight * (ce * (labels >= 0)).sum(), logits)
    ref_l1, ref_ce = reference(logits, target, labels)
    (expected,) = torch.autograd.grad((ref_l1 * l1_weight).sum() + ce_weight * (ref_ce * (labels >= 0)).sum(), logits)
    torch.testing.assert_close(l1, ref_l1)
    torch.testing.assert_close(ce, ref_ce)
    assert (l1 > 0.1).all() and (l1 <= 2.0 + 1e-9).all()
    torch.testing.assert_close(ours, expected)
    assert ours.abs().max() > 1e-3


def test_a_draft_equal_to_the_target_has_no_distance():
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    l1, ce = distribution_losses(logits, torch.log_softmax(logits, -1), torch.arange(4))
    torch.testing.assert_close(l1, torch.zeros(4), atol=1e-6, rtol=0)
    torch.testing.assert_close(ce, -torch.log_softmax(logits, -1)[torch.arange(4), torch.arange(4)])
