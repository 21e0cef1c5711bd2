"""The drafter's two losses over the draft vocabulary, with one hand-written backward: the L1 distance between the
draft's and the target's distributions (twice the total variation, whose complement is what speculative sampling
accepts) and the cross-entropy of the target's token.

Every training position carries a whole draft-vocabulary row (16,384 floats on the default model, 1,792 positions a
step), so these element-wise passes, not the matrix products, were most of a training step: autograd ran
log-softmax, exp, subtract, abs, sum and their backwards (sgn, mul, fill, log-softmax backward) as some 25 passes
over 117 MB tensors, about 1 s of a 3 s step on 2 AVX2 cores. The gradients have a closed form, with p the draft's
distribution, t the target's and s = sign(p - t):

    d L1 / d logits = p * (s - sum(p * s)),    d CE / d logits = p - onehot(label),

so the forward keeps p and s and the backward is four in-place passes.
"""

from __future__ import annotations

import torch


class DistributionLosses(torch.autograd.Function):
    """(L1, CE) per position from draft logits [..., V], the target's log-probabilities over the same vocabulary
    (their exp sums to the target's mass inside it: the rest, which the draft can never propose, is added to the L1
    distance) and the target's token as a vocabulary index (-1 where the vocabulary lacks it: its CE is that of
    index 0, for the caller to weigh by zero)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_logprobs: torch.Tensor, labels: torch.Tensor):
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bfloat16 logits (autocast) in float32
        logprobs = torch.log_softmax(logits.to(dtype), dim=-1)
        index = labels.clamp_min(0).unsqueeze(-1)
        ce = -logprobs.gather(-1, index).squeeze(-1)
        probs = logprobs.exp_()
        target = target_logprobs.to(dtype).exp()
        outside = (1.0 - target.sum(dim=-1)).clamp_min(0.0)
        sign = target.neg_().add_(probs)  # p - t, then its sign, in the target's buffer
        l1 = torch.linalg.vector_norm(sign, ord=1, dim=-1) + outside
        sign.sign_()
        ctx.save_for_backward(probs, sign, torch.linalg.vecdot(probs, sign), index)
        ctx.logits_dtype = logits.dtype
        return l1, ce

    @staticmethod
    def backward(ctx, grad_l1: torch.Tensor, grad_ce: torch.Tensor):
        probs, sign, mean_sign, index = ctx.saved_tensors
        grad = sign.sub_(mean_sign.unsqueeze(-1)).mul_(grad_l1.unsqueeze(-1)).add_(grad_ce.unsqueeze(-1)).mul_(probs)
        grad.scatter_add_(-1, index, -grad_ce.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def distribution_losses(
    logits: torch.Tensor, target_logprobs: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L1, CE) per position (:class:`DistributionLosses`); differentiable in ``logits`` only."""
    return DistributionLosses.apply(logits, target_logprobs, labels)
