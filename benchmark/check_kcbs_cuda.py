"""GPU check (not part of CPU CI): kcbs_step gives identical selections on CUDA and on the CPU.

    python benchmark/check_kcbs_cuda.py      # prints OK or raises
"""

import torch

from sglang_rl.kcbs import kcbs_step


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randint(-4, 4, (12, 50), generator=gen).float()
        lp = torch.log_softmax(logits, -1)
        args = (
            torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 2, 2]),
            torch.linspace(-3, 0, 12),
            torch.zeros(12),
            torch.tensor([False] * 10 + [True, False]),
            torch.tensor([3, 5, 2]),
            torch.tensor([True, False, True]),
        )
        cpu = kcbs_step(lp, *args)
        gpu = kcbs_step(lp.cuda(), *(a.cuda() for a in args))
        for name in ("request", "parent_beam", "token", "finished", "offsets"):
            assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), (trial, name)
        torch.testing.assert_close(cpu.score, gpu.score.cpu())
    print("OK: kcbs_step CUDA == CPU on 20 random batches")


if __name__ == "__main__":
    main()
