"""`kcbs_step` selects the same beams on CUDA as on the CPU (GPU).

The CPU tests pin down k-CBS's selections; a server runs the step on its GPU, where top-k and
sorting are other kernels. Ties are frequent here on purpose (logits drawn from a few integers).
"""

from __future__ import annotations

import pytest
import torch

from sglang_rl.kcbs import kcbs_step


@pytest.mark.parametrize("trial", range(20))
def test_kcbs_step_on_cuda_equals_cpu(trial: int) -> None:
    gen = torch.Generator().manual_seed(trial)
    logits = torch.randint(-4, 4, (12, 50), generator=gen).float()
    logprobs = torch.log_softmax(logits, -1)
    state = (
        torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 2, 2]),  # each beam's request
        torch.linspace(-3, 0, 12),  # cumulative renormalised log-prob
        torch.zeros(12),  # cumulative raw log-prob
        torch.tensor([False] * 10 + [True, False]),  # finished beams
        torch.tensor([3, 5, 2]),  # k of each request
        torch.tensor([True, False, True]),  # keep_all
    )
    cpu = kcbs_step(logprobs, *state)
    gpu = kcbs_step(logprobs.cuda(), *(t.cuda() for t in state))
    for name in ("request", "parent_beam", "token", "finished", "offsets"):
        assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
    torch.testing.assert_close(cpu.score, gpu.score.cpu())
    torch.testing.assert_close(cpu.raw, gpu.raw.cpu())
