"""Train a drafter on packed EAGLE batches: model, AdamW, gradient clipping, metrics.

Defaults follow EAGLE's published training: AdamW with betas (0.9, 0.95), gradient
clipping at 0.5, lr 3e-5. Online RL co-training of an already-trained drafter uses far
smaller rates (FastRL: 1e-6 every 10 RL steps); a freshly initialised drafter needs larger
ones. The caller sets ``lr`` for its regime.

The per-step metric ``top1_agreement`` is the fraction of loss-masked pairs where
``argmax lm_head(predicted row)`` equals ``argmax lm_head(true row)``. It is measured on the
step's forward pass, before the update, so it describes the weights the step started from.
This is a teacher-forced proxy for the first draft token's acceptance under greedy
verification.

An :class:`~sglang_rl.drafter.eagle3_model.Eagle3Drafter` trains through the same API: the
trainer picks its objective from the model (``objectives.py``). For EAGLE3 the loss is the
cross-entropy against the next sampled token (``prob_loss``; ``value_loss`` is 0.0), the
``loss`` options of EAGLE-1/2 do not apply, and ``top1_agreement`` is the fraction of weighted
pairs whose draft argmax (as a target id) is that token.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch

from sglang_rl.drafter.checkpoint import save_drafter, sglang_weights
from sglang_rl.drafter.data import batches_from_samples
from sglang_rl.drafter.loss import EagleLossConfig, SoftTargets
from sglang_rl.drafter.model import DraftModel
from sglang_rl.drafter.objectives import objective_for
from sglang_rl.drafter.prepared_batch import PreparedBatch
from sglang_rl.drafter.sample import AlignedSample
from sglang_rl.drafter.unroll import unroll_valid, unrolled_predictions
from sglang_rl.drafter.window import DEFAULT_WINDOW

__all__ = ["DrafterTrainer", "PreparedBatch"]


def _subset(soft: SoftTargets, rows: torch.Tensor) -> SoftTargets:
    """The soft targets of the rows selected by the boolean ``rows [M]``."""
    probs = None if soft.probs is None else soft.probs[rows]
    ids = None if soft.token_ids is None else soft.token_ids[rows]
    return SoftTargets(top1=soft.top1[rows], probs=probs, token_ids=ids, subset=soft.subset)


class DrafterTrainer:
    """Holds a drafter (EAGLE-1/2 or EAGLE3) and its optimizer; see the module docstring."""

    def __init__(
        self,
        model: DraftModel,
        lr: float = 3e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        grad_clip: float | None = 0.5,
        loss: EagleLossConfig = EagleLossConfig(),
        window: int = DEFAULT_WINDOW,
        full_vocab_metrics: bool = True,
        unroll_steps: int = 1,
        unroll_decay: float = 0.8,
        lr_factor: Callable[[int], float] | None = None,
        autocast_dtype: torch.dtype | None = None,
        feature_noise: float = 0.0,
        seed: int = 0,
        target_head: torch.Tensor | None = None,
    ) -> None:
        """``full_vocab_metrics``: with a reduced soft vocabulary, still take the prediction's
        argmax over the full vocabulary for ``top1_agreement`` (one extra no-grad head product).
        ``unroll_steps``: train draft steps ``1..k`` on the drafter's own rows (``unroll.py``), the
        loss of step ``j`` weighted ``unroll_decay ** (j - 1)``; 1 is plain teacher forcing.
        ``lr_factor(step)``: multiplier of ``lr`` for optimizer step ``step`` (1-based).
        ``autocast_dtype``: mixed precision (weights and optimizer stay in their own dtype).
        ``feature_noise``: while training, add U(-a, a) times each row's mean absolute value to the
        target rows the drafter reads (not to the rows it predicts): EAGLE's guard against its own
        feature errors, made independent of the target's row scale; ``seed`` seeds it.
        ``target_head``: the target's LM head ``[V, H]``, for an EAGLE3 drafter under the sampled
        objective (``loss.objective``; ``objectives.py``)."""
        if isinstance(unroll_steps, bool) or not isinstance(unroll_steps, int) or unroll_steps < 1:
            raise ValueError(f"unroll_steps must be a positive integer, got {unroll_steps!r}")
        if not 0 < unroll_decay <= 1:
            raise ValueError(f"unroll_decay must be in (0, 1], got {unroll_decay!r}")
        if isinstance(feature_noise, bool) or not isinstance(feature_noise, (int, float)) or not feature_noise >= 0:
            raise ValueError(f"feature_noise must be >= 0, got {feature_noise!r}")
        self.unroll_steps = unroll_steps
        self.unroll_decay = unroll_decay
        self.feature_noise = float(feature_noise)
        self.lr_factor = lr_factor
        self.autocast_dtype = autocast_dtype
        self.base_lr = lr
        self.model = model
        self.loss_config = loss
        self.window = window
        self.grad_clip = grad_clip
        self.full_vocab_metrics = full_vocab_metrics
        self.objective = objective_for(model, loss, full_vocab_metrics, target_head)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.steps_done = 0
        self._noise = torch.Generator(device=self.device).manual_seed(seed) if self.feature_noise else None

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def prepare(self, batch: Mapping[str, torch.Tensor] | PreparedBatch) -> PreparedBatch:
        """Move a ``build_eagle_batch`` dict to the model and compute its soft targets."""
        if isinstance(batch, PreparedBatch):
            return batch
        dev, dtype = self.device, self.model.compute_dtype
        ids = batch["input_ids"].reshape(-1).to(dev, torch.long)
        n = ids.shape[0]
        mask = batch["loss_mask"].reshape(-1).to(dev, torch.float32)
        cu = batch.get("cu_seqlens")
        cu = torch.tensor([0, n], dtype=torch.int32) if cu is None else cu.to("cpu", torch.int32)
        pos = batch.get("position_ids")
        if pos is None:
            pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])
        target, mask, soft = self.objective.targets(batch, ids, mask, cu)
        # rows laid out [aux | final] (EAGLE3's sampled objective): the drafter reads the aux part
        hidden = batch["hidden_states"].reshape(n, -1)
        if self.model.config.is_eagle3 and hidden.shape[1] == self.model.feature_width + self.model.config.hidden_size:
            hidden = hidden[:, : self.model.feature_width]
        return PreparedBatch(
            input_ids=ids,
            hidden_states=hidden.to(dev, dtype),
            target=target,
            loss_mask=mask,
            position_ids=pos.reshape(-1).to(dev, torch.long),
            cu_seqlens=cu,
            soft=soft,
        )

    def as_batches(self, data: Any) -> list[PreparedBatch]:
        """Prepared batches from a batch dict, a :class:`PreparedBatch`, an
        :class:`AlignedSample`, or a sequence of either kind (samples are packed into one
        batch by ``build_eagle_batch``)."""
        if isinstance(data, (Mapping, PreparedBatch)):
            return [self.prepare(data)]
        if isinstance(data, AlignedSample):
            data = [data]
        items = list(data)
        if items and all(isinstance(s, AlignedSample) for s in items):
            return [self.prepare(b) for b in batches_from_samples(items, window=self.window)]
        if all(isinstance(b, (Mapping, PreparedBatch)) for b in items):
            return [self.prepare(b) for b in items]
        raise TypeError("expected batch dicts, PreparedBatch objects or AlignedSample objects (not mixed)")

    def _autocast(self) -> ContextManager:
        if self.autocast_dtype is None or self.autocast_dtype == self.model.compute_dtype:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _step_loss(self, pred: torch.Tensor, batch: PreparedBatch, mask: torch.Tensor, soft: SoftTargets):
        """(loss output, top1_agreement) of one step's output under the pair weights ``mask``."""
        return self.objective.step_loss(pred, batch, mask, soft)

    def _noisy(self, batch: PreparedBatch) -> PreparedBatch:
        """``batch`` with U(-a, a) x |row| mean added to the rows the drafter reads (fresh per step)."""
        if self._noise is None:
            return batch
        rows = batch.hidden_states
        noise = torch.rand(rows.shape, generator=self._noise, device=rows.device, dtype=torch.float32)
        scale = rows.float().abs().mean(dim=-1, keepdim=True) * self.feature_noise
        return replace(batch, hidden_states=rows + ((2 * noise - 1) * scale).to(rows.dtype))

    def _forward_loss(self, batch: PreparedBatch):
        """(loss output, step-1 agreement, agreement per unrolled step)."""
        with self._autocast():
            if self.unroll_steps == 1:
                pred = self.model(batch.input_ids, batch.hidden_states, batch.position_ids, batch.cu_seqlens)
                out, agreement = self._step_loss(pred, batch, batch.loss_mask, batch.soft)
                return out, agreement, [agreement]
            preds = unrolled_predictions(self.model, batch.input_ids, batch.hidden_states, batch.position_ids,
                                         batch.cu_seqlens, self.unroll_steps)
            keep = batch.loss_mask > 0
            outs, agreements = [], []
            for step, pred in enumerate(preds):
                valid = unroll_valid(batch.cu_seqlens, batch.num_pairs, step, batch.loss_mask.device)
                mask = batch.loss_mask * valid
                out, agreement = self._step_loss(pred, batch, mask, _subset(batch.soft, valid[keep] > 0))
                outs.append(out)
                agreements.append(agreement)
        first = outs[0]
        weights = [self.unroll_decay ** j if o.num_tokens > 0 else 0.0 for j, o in enumerate(outs)]
        loss = sum(w * o.loss for w, o in zip(weights, outs))
        return replace(first, loss=loss), agreements[0], agreements

    def train_steps(self, data: Any, steps: int,
                    before_step: Optional[Callable[[], None]] = None) -> list[dict[str, float]]:
        """Run ``steps`` optimizer steps, cycling through the batches of ``data`` in order.

        Returns one metrics dict per step: ``step``, ``loss``, ``value_loss``, ``prob_loss``, ``tv_loss``
        (the sampled objective's TV term, 0.0 under the greedy one),
        ``top1_agreement``, ``grad_norm``, ``num_pairs``, ``num_loss_pairs``, ``seconds``, ``lr`` and
        ``skipped`` (1.0 when the batch had no loss-masked pair and no update was made). With
        ``unroll_steps > 1``: ``loss`` is the weighted sum over the steps, the loss parts and
        ``top1_agreement`` are step 1's, and ``top1_agreement_stepJ`` is step J's.
        ``before_step`` runs before each step (co-training's idle gate, ``drafter/gaps.py``).
        """
        batches = self.as_batches(data)
        if not batches:
            raise ValueError("no training pairs: every sample has fewer than two rows")
        self.model.train()
        history = []
        for i in range(steps):
            batch = batches[i % len(batches)]
            if before_step is not None:
                before_step()
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            if self.lr_factor is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = self.base_lr * self.lr_factor(self.steps_done + 1)
            out, agreement, per_step = self._forward_loss(self._noisy(batch))
            skipped = out.num_tokens == 0
            grad_norm = 0.0
            if not skipped:
                out.loss.backward()
                params = [p for p in self.model.parameters() if p.grad is not None]
                max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
                self.optimizer.step()
                self.steps_done += 1
            history.append(
                {
                    "step": float(self.steps_done),
                    "loss": float(out.loss.detach()),
                    "value_loss": out.value_loss,
                    "prob_loss": out.prob_loss,
                    "tv_loss": out.tv_loss,
                    "top1_agreement": agreement,
                    "grad_norm": grad_norm,
                    "num_pairs": float(batch.num_pairs),
                    "num_loss_pairs": float(batch.num_loss_pairs),
                    "seconds": time.perf_counter() - start,
                    "skipped": float(skipped),
                    "lr": float(self.optimizer.param_groups[0]["lr"]),
                    **{f"top1_agreement_step{j + 1}": a for j, a in enumerate(per_step) if j},
                }
            )
        return history

    @torch.no_grad()
    def evaluate(self, data: Any) -> dict[str, float]:
        """Loss parts and ``top1_agreement`` over ``data``, weighted by loss-masked pairs; with
        ``unroll_steps > 1`` also ``top1_agreement_stepJ`` for draft steps 2..K."""
        self.model.eval()
        totals = {"loss": 0.0, "value_loss": 0.0, "prob_loss": 0.0, "tv_loss": 0.0, "top1_agreement": 0.0}
        totals.update({f"top1_agreement_step{j}": 0.0 for j in range(2, self.unroll_steps + 1)})
        count = 0.0
        for batch in self.as_batches(data):
            out, agreement, per_step = self._forward_loss(batch)
            if out.num_tokens == 0:
                continue
            n = float(batch.num_loss_pairs)
            for key, value in (("loss", float(out.loss)), ("value_loss", out.value_loss),
                               ("prob_loss", out.prob_loss), ("tv_loss", out.tv_loss), ("top1_agreement", agreement),
                               *((f"top1_agreement_step{j + 1}", a) for j, a in enumerate(per_step) if j)):
                totals[key] += value * n
            count += n
        result = {k: (v / count if count else float("nan")) for k, v in totals.items()}
        result["num_loss_pairs"] = count
        return result

    def save(self, out_dir: str | Path, dtype: str | torch.dtype | None = None) -> Path:
        """:func:`save_drafter` of the current weights."""
        return save_drafter(self.model, out_dir, dtype)

    def weights(self, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
        """:func:`sglang_weights` of the current weights (for a live weight push)."""
        return sglang_weights(self.model, dtype)
