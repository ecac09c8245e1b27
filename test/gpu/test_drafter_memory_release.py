"""A co-trained draft survives a release and resume of the server's memory (GPU).

verl's colocated mode releases the weights and the KV cache after each rollout phase and resumes
them before the next; its trainer pushes the target back, but nobody pushes the draft (sglang
issue #31674: the draft comes back as garbage and acceptance falls to ~1). Each case runs an
Engine in its own process: EAGLE on a small accepted-draft pair, `--enable-memory-saver`, a draft
update (what a co-training round loads), release and resume as verl does, then the draft's
weights are read back and greedy outputs compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(sys.argv[1]) / "benchmark"))
from spec_models import make_eagle_pair
import sglang as sgl

def main():
    target, draft = make_eagle_pair(Path(sys.argv[2]), Path(sys.argv[3]), hidden=1024, layers=4)
    extra = json.loads(sys.argv[4])
    engine = sgl.Engine(model_path=str(target), speculative_algorithm="EAGLE",
                        speculative_draft_model_path=str(draft), speculative_num_steps=3,
                        speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                        enable_memory_saver=True, attention_backend="triton", sampling_backend="pytorch",
                        mem_fraction_static=0.5, log_level="error", **extra)
    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(8)]
    greedy = {"temperature": 0, "max_new_tokens": 32}
    before = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    gen = torch.Generator().manual_seed(1)
    fc = engine.get_draft_weights_by_name("fc.weight", truncate_size=1024 * 2048)
    fc = torch.tensor(fc)
    pushed = fc + 1e-3 * torch.randn(fc.shape, generator=gen)  # a co-training round's change
    ok, message = engine.update_draft_weights_from_tensor([("fc.weight", pushed.to(torch.bfloat16))])
    assert ok, message
    loaded = torch.tensor(engine.get_draft_weights_by_name("fc.weight", truncate_size=1024 * 2048))
    engine.release_memory_occupation(tags=["kv_cache", "weights"])
    engine.resume_memory_occupation(tags=["weights"])
    pushed_back = engine.update_weights_from_disk(str(target))  # the trainer pushes the target back
    assert pushed_back[0], pushed_back
    engine.resume_memory_occupation(tags=["kv_cache"])
    after = torch.tensor(engine.get_draft_weights_by_name("fc.weight", truncate_size=1024 * 2048))
    outs = engine.generate(input_ids=prompts, sampling_params=greedy)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    tokens = sum(len(o["output_ids"]) for o in outs)
    print("RESULT " + json.dumps({
        "draft_kept": bool(torch.equal(after, loaded)),
        "max_abs_diff": float((after.float() - loaded.float()).abs().max()),
        "outputs_same": [o["output_ids"] for o in outs] == before,
        "acceptance_length": tokens / max(steps, 1),
        "cpu_backup": extra.get("drafter_cotrain", False)}), flush=True)
    engine.shutdown()

if __name__ == "__main__":
    main()
'''


def _run(tmp_path: Path, tokenizer: Path, extra: dict) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(script), str(ROOT), str(tmp_path / "pair"), str(tokenizer),
                           json.dumps(extra)], capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_cotraining_server_keeps_its_draft_across_release(tmp_path: Path, tokenizer: Path) -> None:
    result = _run(tmp_path, tokenizer, {"drafter_cotrain": True, "drafter_cotrain_samples_per_round": 10**6})
    print(result)
    assert result["draft_kept"] and result["outputs_same"], result
    assert result["acceptance_length"] > 1.5, result


def test_plain_eagle_server_loses_an_updated_draft(tmp_path: Path, tokenizer: Path) -> None:
    """The failure the co-training server avoids (no host copy of the draft): shows the check can fail."""
    result = _run(tmp_path, tokenizer, {})
    print(result)
    assert not result["draft_kept"], result
