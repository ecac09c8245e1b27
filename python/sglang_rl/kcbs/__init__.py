"""k-CBS: top-k-constrained beam search (arXiv 2603.24917), engine-agnostic pieces."""

from sglang_rl.kcbs.step import KcbsSelection, kcbs_initial, kcbs_step, ranked_topk

__all__ = ["KcbsSelection", "kcbs_initial", "kcbs_step", "ranked_topk"]
