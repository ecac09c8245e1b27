"""The batched kcbs_step, driven by a padded batched forward, equals the per-beam HF reference."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from sglang_rl.kcbs import kcbs_step
from sglang_rl.kcbs.reference import Candidate, kcbs_reference, next_token_logprobs

import transformers  # noqa: F401  (the reference needs it; installed by make setup)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a fox"]
KS = [1, 2, 4]


class MemoLm(torch.nn.Module):
    """Wraps a causal LM and replays the output of a forward it has already run on the same ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.cache: dict[tuple[object, ...], object] = {}

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        key = (repr(sorted(kwargs.items())), *input_ids.flatten().tolist())
        if key not in self.cache:
            self.cache[key] = self.model(input_ids, **kwargs)
        return self.cache[key]


@dataclass
class Lm:
    model: torch.nn.Module
    reference_model: MemoLm
    prompts: list[list[int]]
    eos: set[int] = field(default_factory=set)


@pytest.fixture(scope="module")
def lm() -> Iterator[Lm]:
    """The default model in float32; one intra-op thread, as these tiny forwards gain nothing from
    more and a busy shared CPU makes OpenMP threads wait on each other."""
    from sglang_rl.default_model import ensure_default_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = ensure_default_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    memo = MemoLm(model)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    eos = {int(tokenizer.eos_token_id)}
    for ids in prompts:
        eos.add(int(next_token_logprobs(memo, ids).argsort(descending=True)[1]))
    yield Lm(model, memo, prompts, eos)
    torch.set_num_threads(threads)


def batched_logprobs(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """Next-token log-probs of several sequences in one right-padded forward."""
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden[torch.arange(len(seqs)), lengths - 1])
    return torch.log_softmax(logits.float(), dim=-1)


def drive_batched(lm: Lm, requests: list[tuple[list[int], int, bool]], steps: int) -> list[list[Candidate]]:
    """Run k-CBS for all (prompt, k, final_prune) requests together, one kcbs_step per step."""
    beams = [(r, Candidate([], 0.0, 0.0)) for r in range(len(requests))]
    k = torch.tensor([kr for _, kr, _ in requests])
    vocab = lm.model.config.vocab_size
    for step in range(steps):
        if all(c.finish_reason is not None for _, c in beams):
            break
        last = step == steps - 1
        seqs = {
            i: tuple(requests[r][0] + c.token_ids) for i, (r, c) in enumerate(beams) if c.finish_reason is None
        }
        unique = sorted(set(seqs.values()))
        rows = batched_logprobs(lm.model, [list(s) for s in unique])
        logprobs = torch.full((len(beams), vocab), float("nan"))
        for i, seq in seqs.items():
            logprobs[i] = rows[unique.index(seq)]
        sel = kcbs_step(
            logprobs,
            torch.tensor([r for r, _ in beams]),
            torch.tensor([c.logprob for _, c in beams], dtype=torch.float64),
            torch.tensor([c.raw_logprob for _, c in beams], dtype=torch.float64),
            torch.tensor([c.finish_reason is not None for _, c in beams]),
            k,
            torch.tensor([last and not fp for _, _, fp in requests]),
        )
        new = []
        for i in range(len(sel)):
            r, parent = beams[int(sel.parent_beam[i])]
            if bool(sel.finished[i]):
                new.append((r, parent))
                continue
            token = int(sel.token[i])
            reason = "stop" if token in lm.eos else ("length" if last else None)
            child = Candidate(parent.token_ids + [token], float(sel.score[i]), float(sel.raw[i]), reason)
            new.append((r, child))
        beams = new
    return [[c for r, c in beams if r == req] for req in range(len(requests))]


@pytest.mark.parametrize("steps", [4, 1])
def test_batched_step_equals_reference(lm: Lm, steps: int) -> None:
    requests = [(prompt, kr, fp) for prompt in lm.prompts for kr in KS for fp in (True, False)]
    batched = drive_batched(lm, requests, steps)
    stops = 0
    for (prompt, kr, final_prune), got in zip(requests, batched):
        want = kcbs_reference(lm.reference_model, prompt, kr, steps, final_prune, lm.eos)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], (kr, final_prune, prompt)
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        assert [c.logprob for c in got] == pytest.approx([c.logprob for c in want], abs=1e-4)
        assert [c.raw_logprob for c in got] == pytest.approx([c.raw_logprob for c in want], abs=1e-4)
        assert len(want) <= (kr if final_prune else kr * kr)
        assert len(want) == len({tuple(c.token_ids) for c in want})
        stops += sum(c.finish_reason == "stop" for c in want)
        if kr == 1:
            assert all(c.logprob == 0.0 for c in want)
    assert stops > 0
