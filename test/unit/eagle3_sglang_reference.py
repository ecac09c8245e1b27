"""sglang's own ``LlamaForCausalLMEagle3`` on the CPU, run in a subprocess by
test_drafter_eagle3_train.py: ``python eagle3_sglang_reference.py DRAFT TARGET IN.pt OUT.pt``.

It builds the model the way a server does (config.json through transformers, a single-rank gloo
group, published server args), loads the folder's tensors with the model's own ``load_weights``
(SpecForge names, ``d2t``) and swaps in the target's embedding (``set_embed``, as the EAGLE
worker does). The only stand-in is the attention kernel: sglang's ``RadixAttention`` (paged KV
cache and backend) becomes causal SDPA per packed sequence with its own head counts and scaling.
fc, the norms and their fused adds, q/k/v and gate/up fusion, rope, the MLP and the final norm
are sglang's. Every parameter starts as NaN, so a tensor ``load_weights`` silently skips shows.

IN.pt: ``ids [N]``, ``aux [N, 3H]``, ``positions [N]``, ``cu_seqlens``, ``chain [N, H]`` (a
chained step's input) and ``pushed`` (``sglang_weights`` pairs). OUT.pt: step-1 and chained
``g``/``logits``, ``hot_token_id`` and whether the pushed weights load into every parameter.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class _Attention(torch.nn.Module):
    """Causal SDPA within each packed sequence, with RadixAttention's heads and scaling."""

    def __init__(self, radix: torch.nn.Module) -> None:
        super().__init__()
        self.q, self.kv, self.d, self.scale = radix.tp_q_head_num, radix.tp_k_head_num, radix.head_dim, radix.scaling

    def forward(self, q, k, v, forward_batch):
        n = q.shape[0]
        q, k, v = (t.view(n, h, self.d).transpose(0, 1) for t, h in ((q, self.q), (k, self.kv), (v, self.kv)))
        parts = [F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], is_causal=True,
                                                enable_gqa=True, scale=self.scale)[0] for a, b in forward_batch.bounds]
        return torch.cat(parts, dim=1).transpose(0, 1).reshape(n, self.q * self.d)


def _model(draft: Path, embed: torch.Tensor, weights) -> torch.nn.Module:
    from transformers import AutoConfig

    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    model = LlamaForCausalLMEagle3(AutoConfig.from_pretrained(str(draft)))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(weights)
    model.set_embed(torch.nn.Parameter(embed, requires_grad=False))
    for layer in model.model.layers:
        layer.self_attn.attn = _Attention(layer.self_attn.attn)
    return model.eval()


def _run(model, ids, hidden, positions, bounds, vocab):
    batch = SimpleNamespace(
        mm_input_embeds=None, contains_mm_inputs=lambda: False, bounds=bounds,
        forward_mode=SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False),
        spec_info=SimpleNamespace(hidden_states=hidden))
    with torch.no_grad():
        normed, aux = model.model(ids, positions, batch)
    return aux[0], normed @ model.lm_head.weight[:vocab].T


def main(draft: str, target: str, inp: str, out: str) -> None:
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs

    from sglang_rl.drafter.target_weights import load_target_head

    torch.set_num_threads(1)
    runtime_context.publish(ServerArgs(model_path=target, device="cpu", skip_tokenizer_init=True), role="test")
    # a file rendezvous: no port to race other processes for
    store = Path(out).with_suffix(".store")
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"file://{store}")
    parallel_state.initialize_model_parallel(1, backend="gloo")
    data = torch.load(inp)
    embed = load_target_head(target).embed
    files = sorted(Path(draft).glob("*.safetensors"))
    model = _model(Path(draft), embed, ((n, t) for f in files for n, t in load_file(str(f)).items()))
    vocab = int(model.config.draft_vocab_size)
    cu = data["cu_seqlens"].tolist()
    bounds = list(zip(cu[:-1], cu[1:]))
    g1, logits1 = _run(model, data["ids"], data["aux"], data["positions"], bounds, vocab)
    g2, logits2 = _run(model, data["ids"], data["chain"], data["positions"], bounds, vocab)
    pushed = _model(Path(draft), embed, iter(data["pushed"]))
    params = dict(model.named_parameters())
    same = all(torch.equal(p, params[n]) for n, p in pushed.named_parameters() if n != "lm_head.weight")
    same = same and torch.equal(pushed.lm_head.weight[:vocab], model.lm_head.weight[:vocab])
    loaded = all(not p[:vocab].isnan().any() if n == "lm_head.weight" else not p.isnan().any()
                 for n, p in model.named_parameters())
    torch.save({"g1": g1, "logits1": logits1, "g2": g2, "logits2": logits2, "hot_token_id": model.hot_token_id,
                "all_loaded": loaded, "pushed_same": same}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
