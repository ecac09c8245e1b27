"""Training EAGLE3 drafters (eagle3_model.py, eagle3_loss.py, objectives.py, unroll.py, the trainer
and checkpoint entry points, CotrainLoop) on tiny targets.

The forward is checked against sglang 0.5.17's own ``LlamaForCausalLMEagle3`` run on the CPU in a
subprocess (eagle3_sglang_reference.py; only its paged attention kernel is replaced by SDPA); the
labels against the written-out rule: pair ``i`` learns the next pair's input id, within its
segment, inside the draft vocabulary.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sglang_rl.drafter import DrafterTrainer, load_drafter, sample_from_rows, save_drafter, sglang_weights
from sglang_rl.drafter.cli import main
from sglang_rl.drafter.cotrain import CotrainConfig, CotrainLoop
from sglang_rl.drafter.messages import RolloutSample
from sglang_rl.drafter.eagle3 import init_eagle3, read_eagle3, save_eagle3
from sglang_rl.drafter.eagle3_loss import eagle3_labels
from sglang_rl.drafter.eagle3_model import Eagle3Drafter
from sglang_rl.drafter.unroll import unrolled_predictions
from test_drafter_eagle3 import H, V, target
from test_drafter_unroll import assert_steps_are_chained, packed

HERE = Path(__file__).resolve().parent
DRAFT_VOCAB = 40


def random_folder(tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    """(EAGLE3 folder with random weights everywhere and a scattered draft vocabulary, target)."""
    folder = target(tmp_path, tied=False)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.rand(V, generator=gen).tolist()
    cfg, tensors = init_eagle3(folder, DRAFT_VOCAB, counts, seed=seed, init="normal")
    for name, t in tensors.items():
        if t.is_floating_point():
            scale = 0.1 if t.dim() == 1 else 0.3
            tensors[name] = (1.0 if t.dim() == 1 else 0.0) + scale * torch.randn(t.shape, generator=gen)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    return save_eagle3(tmp_path / "draft", cfg, tensors), folder


def cli_folder(tmp_path: Path) -> tuple[Path, Path]:
    folder = target(tmp_path)
    out = tmp_path / "draft"
    assert main(["init", "--arch", "eagle3", "--model-path", str(folder), "--out", str(out),
                 "--draft-vocab-size", str(DRAFT_VOCAB), "--dtype", "float32"]) == 0
    return out, folder


def rollouts(n: int, width: int, seed: int = 0, length: int = 20) -> list:
    """Samples whose next token is a fixed function of the row: learnable, so the loss can fall."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(width, DRAFT_VOCAB, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in range(n):
        rows = torch.randn(length, width, generator=gen)
        ids = torch.cat((torch.zeros(1, dtype=torch.long), (rows[:-1] @ proj).argmax(-1)))
        out.append(sample_from_rows(ids, rows, 4))
    return out


def test_forward_matches_sglangs_llama_for_causal_lm_eagle3(tmp_path: Path) -> None:
    draft, folder = random_folder(tmp_path)
    model = load_drafter(draft, folder)
    assert isinstance(model, Eagle3Drafter)
    ids, aux, pos, cu = packed([6, 5], width=3 * H, vocab=V, dtype=torch.float32)
    chain = torch.randn(ids.shape[0], H, generator=torch.Generator().manual_seed(5))
    torch.save({"ids": ids, "aux": aux, "positions": pos, "cu_seqlens": cu, "chain": chain,
                "pushed": sglang_weights(model)}, tmp_path / "in.pt")
    run = subprocess.run([sys.executable, str(HERE / "eagle3_sglang_reference.py"), str(draft), str(folder),
                          str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    ref = torch.load(tmp_path / "out.pt")
    assert ref["all_loaded"] and ref["pushed_same"]
    assert torch.equal(ref["hot_token_id"], model.to_target_ids(torch.arange(DRAFT_VOCAB)))
    with torch.no_grad():
        g1 = model(ids, aux, pos, cu)
        g2 = model.step(ids, chain, pos, [(0, 6), (6, 11)])
        torch.testing.assert_close(g1, ref["g1"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.logits(g1), ref["logits1"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g2, ref["g2"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.logits(g2), ref["logits2"], rtol=1e-5, atol=1e-5)


def test_cli_folder_trains_saves_and_pushes_the_folders_names(tmp_path: Path) -> None:
    draft, folder = cli_folder(tmp_path)
    model = load_drafter(draft, folder)
    trainer = DrafterTrainer(model, lr=3e-3)
    samples = rollouts(4, model.feature_width)
    history = trainer.train_steps(samples, 40)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"], [h["loss"] for h in history]
    assert history[-1]["prob_loss"] == history[-1]["loss"] and history[-1]["value_loss"] == 0.0
    assert history[-1]["top1_agreement"] > history[0]["top1_agreement"]
    _, folder_tensors = read_eagle3(draft)
    want = {n.replace("midlayer.", "layers.0."): tuple(t.shape) for n, t in folder_tensors.items()
            if n not in ("d2t", "t2d")}
    pushed = trainer.weights(torch.bfloat16)
    assert {n: tuple(t.shape) for n, t in pushed} == want and all(t.dtype == torch.bfloat16 for _, t in pushed)
    moved = [n for n, t in pushed if not torch.equal(t, folder_tensors[n.replace("layers.0.", "midlayer.")].bfloat16())]
    assert "lm_head.weight" in moved and "fc.weight" in moved
    saved = save_drafter(trainer.model, tmp_path / "saved")
    assert set(load_file(str(saved / "model.safetensors"))) == set(folder_tensors)
    again = load_drafter(saved, folder)
    batch = trainer.as_batches(samples)[0]
    with torch.no_grad():
        torch.testing.assert_close(again(batch.input_ids, batch.hidden_states, batch.position_ids, batch.cu_seqlens),
                                   trainer.model(batch.input_ids, batch.hidden_states, batch.position_ids,
                                                 batch.cu_seqlens))
    assert torch.equal(again.d2t, model.d2t) and trainer.evaluate(samples)["loss"] < history[0]["loss"]


def chained_g(model: Eagle3Drafter, ids, aux, start: int, t: int, step: int) -> torch.Tensor:
    """Draft step ``step + 1`` at position ``t`` as serving runs it: an extend over the committed
    pairs fed ``fc(aux)``, then decode steps fed their own previous ``g`` (no fc)."""
    m = t - start - step + 1
    seq_ids, feats = ids[start:start + m], model.fc(aux[start:start + m])
    last = model.step(seq_ids, feats, torch.arange(m), [(0, m)])[-1]
    for s in range(1, step + 1):
        seq_ids = torch.cat((seq_ids, ids[start + m - 1 + s].reshape(1)))
        feats = torch.cat((feats, last.reshape(1, -1)))
        last = model.step(seq_ids, feats, torch.arange(seq_ids.numel()), [(0, seq_ids.numel())])[-1]
    return last


def test_unrolled_eagle3_steps_are_the_chained_draft_steps_and_train(tmp_path: Path) -> None:
    draft, folder = random_folder(tmp_path)
    model = load_drafter(draft, folder).double()
    ids, aux, pos, cu = packed([7, 9], width=3 * H, vocab=V)
    with torch.no_grad():
        preds = unrolled_predictions(model, ids, aux, pos, cu, 3)
        assert torch.equal(preds[0], model(ids, aux, pos, cu))
        assert_steps_are_chained(preds, lambda a, t, step: chained_g(model, ids, aux, a, t, step))
    samples = rollouts(3, model.feature_width)
    three = DrafterTrainer(load_drafter(draft, folder), lr=3e-3, unroll_steps=3)
    step1 = three.evaluate(samples)
    out = three.train_steps(samples, 15)
    assert {"top1_agreement_step2", "top1_agreement_step3"} <= set(out[0]) and out[-1]["loss"] < out[0]["loss"]
    plain = DrafterTrainer(load_drafter(draft, folder)).evaluate(samples)  # K=1, the same weights
    assert abs(step1["prob_loss"] - plain["loss"]) < 1e-5 and step1["loss"] > plain["loss"]


def test_labels_are_the_next_pairs_id_within_the_segment_and_the_draft_vocabulary(tmp_path: Path) -> None:
    draft, folder = random_folder(tmp_path)
    model = load_drafter(draft, folder)
    hot = model.to_target_ids(torch.arange(DRAFT_VOCAB))
    inside, outside = hot[:4].tolist(), sorted(set(range(V)) - set(hot.tolist()))[:2]
    ids = torch.tensor([inside[0], inside[1], outside[0], inside[2], inside[3], inside[0], outside[1]])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    labels, draft_ids, weights = eagle3_labels(model, ids, mask, cu)
    # pair 1's label is out of the draft vocabulary, 3 and 6 end their segments, 4 is masked
    assert weights.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert labels.tolist() == [inside[1], -1, inside[2], -1, inside[0], -1, -1]
    assert model.to_target_ids(draft_ids[[0, 2, 4]]).tolist() == [inside[1], inside[2], inside[0]]
    trainer = DrafterTrainer(model)
    aux = torch.randn(7, model.feature_width)
    batch = trainer.prepare({"input_ids": ids[None], "hidden_states": aux[None], "target": aux[None],
                             "loss_mask": mask[None], "cu_seqlens": cu})
    assert batch.num_loss_pairs == 2 and torch.equal(batch.soft.top1, torch.tensor([inside[1], inside[2]]))
    with torch.no_grad():
        logits = model.logits(model(ids, aux, batch.position_ids, cu)).float()
    ce = F.cross_entropy(logits[[0, 2]], draft_ids[[0, 2]])
    assert abs(trainer.evaluate(batch)["loss"] - float(ce)) < 1e-5
    only_unlabelled = {"input_ids": ids[None], "hidden_states": aux[None], "target": aux[None],
                       "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]]), "cu_seqlens": cu}
    assert trainer.train_steps(only_unlabelled, 1)[0]["skipped"] == 1.0


def test_cotrain_loop_trains_an_eagle3_folder_and_follows_only_the_target_embedding(tmp_path: Path) -> None:
    draft, folder = cli_folder(tmp_path)
    loop = CotrainLoop(CotrainConfig(draft_path=str(draft), target_path=str(folder), samples_per_round=2,
                                     steps=3, lr=1e-3, window=32, samples_per_step=2, unroll_steps=2))
    model = loop.trainer.model
    assert isinstance(model, Eagle3Drafter)
    gen = torch.Generator().manual_seed(0)
    for i in range(2):
        loop.add(RolloutSample(torch.randint(0, V, (24,), generator=gen), torch.randn(24, 3 * H, generator=gen), 8, 0))
    weights, metrics = loop.train_round()
    _, folder_tensors = read_eagle3(draft)
    assert {n.replace("layers.0.", "midlayer."): tuple(t.shape) for n, t in weights} == {
        n: tuple(t.shape) for n, t in folder_tensors.items() if n not in ("d2t", "t2d")}
    assert metrics["pairs"] > 0 and metrics["loss"] == metrics["loss"]
    head = model.lm_head.weight.detach().clone()
    embed = torch.randn(V + 6, H, generator=gen)  # sglang pads its embedding
    loop.set_target_head(embed, torch.randn(V, H, generator=gen))
    assert torch.equal(model.embed_tokens, embed[:V]) and torch.equal(model.lm_head.weight, head)
    assert loop.head_updates == 1
