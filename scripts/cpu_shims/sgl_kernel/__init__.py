"""Stand-in for sgl_kernel on CPU test machines (no CPU build of sgl-kernel exists on PyPI).

sglang's CPU paths import a few `<name>_cpu` kernels at module load; with
--attention-backend torch_native none of them is called. Any attribute resolves to a
function that raises, so an unexpected call fails loudly instead of silently.

`speculative` holds pure-torch versions of the few ops that the NGRAM and EAGLE speculative
decoding paths call on CPU (--speculative-algorithm NGRAM / EAGLE).
"""

from .speculative import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this CPU test machine")

    _missing.__name__ = name
    return _missing
