"""adapter.patches.zero does DeepSpeed's ZeRO-1/2 clipping arithmetic, with the clip factor kept on the device."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from adapter.patches import zero


@pytest.mark.parametrize("norm", [4.0, 0.5, math.inf, math.nan, -1.0])
@pytest.mark.parametrize("clip_grad,loss_scale", [(1.0, 1.0), (1.0, 8.0), (0.0, 8.0), (0.0, 1.0)])
def test_clip_matches_deepspeed(norm, clip_grad, loss_scale):
    fake = SimpleNamespace(clip_grad=clip_grad, loss_scale=loss_scale, device="cpu")
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(0)), [torch.ones(3), torch.full((2,), 2.0)]]
    theirs = [grads[0].clone(), [t.clone() for t in grads[1]]]
    ours = [grads[0].clone(), [t.clone() for t in grads[1]]]
    DeepSpeedZeroOptimizer.unscale_and_clip_grads(fake, theirs, torch.tensor(norm))
    zero.unscale_and_clip_grads(fake, ours, torch.tensor(norm))
    flat = lambda gs: torch.cat([gs[0], *gs[1]])  # noqa: E731
    assert torch.equal(flat(ours), flat(theirs)), (flat(ours), flat(theirs))
    if clip_grad and (not math.isfinite(norm) or norm < 0):  # an invalid norm zeroes the step's gradients
        assert not flat(ours).any()


def test_mask_matches_deepspeed():
    a = torch.tensor([1.0, math.inf, -math.inf, math.nan, -3.0])
    b = a.clone()
    ds_utils.mask_nan_or_inf_with_val_inplace(a, device="cpu")
    zero.mask_nonfinite_(b, device="cpu")
    assert torch.equal(a, b)
