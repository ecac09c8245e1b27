"""k-CBS: top-k-constrained beam search (arXiv 2603.24917), engine-agnostic pieces.

`step` is one batched step over full log-prob rows; `search` the state of one search between
steps; `advance` steps many searches from their beams' top-k; `rows` forks beams in a token table.
"""

from sglang_rl.kcbs.advance import advance
from sglang_rl.kcbs.search import Beam, BeamSearch, candidate_fields
from sglang_rl.kcbs.step import KcbsSelection, kcbs_initial, kcbs_step, ranked_topk

__all__ = ["Beam", "BeamSearch", "KcbsSelection", "advance", "candidate_fields", "kcbs_initial",
           "kcbs_step", "ranked_topk"]
