"""Server flags of sglang-rl, added to sglang's own ServerArgs dataclass.

sglang derives CLI flags from annotated dataclass fields, pickles the instance to every scheduler
process and builds it for `sgl.Engine(**kwargs)`; subclassing it is how a plugin adds flags that
work with `python -m sglang.launch_server`, `sglang serve` and the Engine alike.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal, Optional

from sglang.srt.arg_groups.arg_utils import A
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RLServerArgs(ServerArgs):
    """sglang's ServerArgs plus the sglang-rl flags."""

    toploc_verification: A[
        bool,
        "sglang-rl: attach TOPLOC fingerprints of the last-layer hidden states to every response "
        "and accept verification requests (max_tokens=0 with toploc_verification_fingerprint_to_validate).",
    ] = False
    toploc_verification_topk: A[
        int, "sglang-rl: number of top-|value| activations committed per 32-token chunk (toploc topk)."
    ] = 128
    toploc_verification_max_exp_mismatches: A[
        Optional[int],
        "sglang-rl: fail a chunk above this many exponent mismatches "
        "(default: 38 per 128 top-k values, scaled with --toploc-verification-topk).",
    ] = None
    toploc_verification_max_mant_err_mean: A[
        float, "sglang-rl: fail a chunk whose mean mantissa error is above this (default 10)."
    ] = 10.0
    toploc_verification_max_mant_err_median: A[
        float, "sglang-rl: fail a chunk whose median mantissa error is above this (default 8)."
    ] = 8.0
    toploc_verification_max_sampling_z: A[
        float,
        "sglang-rl: bound on |Z| of the temperature-1 sampling test of verification requests with "
        "toploc_verification_expect_sampled (Z is standard normal for honest sampling: 4.0 rejects "
        "6.3e-5 of honest responses).",
    ] = 4.0
    toploc_verification_min_eos_prob: A[
        float,
        "sglang-rl: a verified response that ends on an EOS / stop token must have given it at least this "
        "probability at that position, else its verdict is fail (0 turns the check off; 0.02, GRAIL's "
        "bound, suits greedy work).",
    ] = 0.001
    toploc_verification_calibration: A[
        Optional[str],
        "sglang-rl: calibration file of the served model (written by sglang-rl calibrate): "
        "its per-chunk bounds, with separate ones for a short final chunk, replace the uncalibrated "
        "defaults and the --toploc-verification-max-* flags.",
    ] = None

    specforge_export_dir: A[
        Optional[str],
        "sglang-rl: write every finished rollout of this EAGLE3 server into this folder in SpecForge's "
        "offline EAGLE3 format (one .ckpt per rollout: input_ids, loss_mask, hidden_state, aux_hidden_state).",
    ] = None

    drafter_cotrain: A[
        bool,
        "sglang-rl: co-train the EAGLE drafter on this server's own rollouts and hot-swap it into "
        "the running server after every training round (needs --speculative-algorithm EAGLE "
        "or EAGLE3 with a --speculative-draft-model-path of that kind).",
    ] = False
    drafter_cotrain_buffer_bytes: A[
        int, "sglang-rl: byte budget of the co-training sample buffer (oldest samples go first)."
    ] = 1 << 30
    drafter_cotrain_samples_per_round: A[
        int, "sglang-rl: finished rollouts that start a training round (and that it trains on)."
    ] = 64
    drafter_cotrain_steps: A[int, "sglang-rl: optimizer steps per co-training round."] = 20
    drafter_cotrain_lr: A[float, "sglang-rl: AdamW learning rate of drafter co-training."] = 1e-4
    drafter_cotrain_window: A[
        int, "sglang-rl: rows per rollout kept for training (the end of the response first)."
    ] = 512
    drafter_cotrain_samples_per_step: A[
        int, "sglang-rl: rollouts packed into one co-training optimizer step."
    ] = 16
    drafter_cotrain_device: A[
        Optional[str],
        "sglang-rl: device of the co-training process, e.g. cuda:1 for a second GPU or cpu "
        "(default: the server's own device).",
    ] = None
    drafter_cotrain_soft_topk: A[
        Optional[int],
        "sglang-rl: soft cross-entropy over each row's top-N target tokens instead of the full "
        "vocabulary (cheaper; default: full vocabulary).",
    ] = None
    drafter_cotrain_threads: A[
        int, "sglang-rl: torch threads of the co-training process (0: torch's default)."
    ] = 0
    drafter_cotrain_unroll_steps: A[
        int, "sglang-rl: draft steps trained on the drafter's own rows (1: teacher forcing only)."
    ] = 1
    drafter_cotrain_feature_noise: A[
        float, "sglang-rl: uniform noise U(-a, a) times each row's mean absolute value, added to the "
        "target rows the drafter reads while training (EAGLE's feature noise; 0: none)."
    ] = 0.0
    drafter_cotrain_replay_samples: A[
        int, "sglang-rl: older samples replayed per round from the whole buffer (newer policies more often)."
    ] = 0
    drafter_cotrain_lr_schedule: A[
        Optional[str], "sglang-rl: lr schedule over rounds, e.g. warmup=1,cosine=16,floor=0.1 (default: constant)."
    ] = None
    drafter_cotrain_train_dtype: A[
        str, "sglang-rl: compute dtype of co-training (bfloat16: autocast, float32 weights)."
    ] = "float32"
    drafter_cotrain_train_in_gaps: A[
        bool, "sglang-rl: run co-training's optimizer steps only while this server is idle (between "
        "rollout bursts), waiting at most --drafter-cotrain-gap-max-wait-s per round."
    ] = False
    drafter_cotrain_gap_max_wait_s: A[
        float, "sglang-rl: with --drafter-cotrain-train-in-gaps, the longest a round waits for idle time."
    ] = 10.0
    drafter_cotrain_gap_busy_share: A[
        float, "sglang-rl: with --drafter-cotrain-train-in-gaps, the share of time (0-1] a round's optimizer "
        "steps may compute while this server is busy once the round has waited its most (1: no limit)."
    ] = 1.0
    drafter_cotrain_swap_check_samples: A[
        int, "sglang-rl: hold back each round's N newest rollouts from its training and swap the trained "
        "drafter in only if it agrees with the target on them at least as well as the served one (0: swap every round)."
    ] = 0
    drafter_cotrain_objective: A[
        Literal["greedy", "sampled"], "sglang-rl: what co-training optimises: greedy (regression plus soft "
        "cross-entropy) or sampled (that plus the TV loss 1 - sum min(p_T, q_T) at --drafter-cotrain-temperature: "
        "acceptance under speculative sampling; EAGLE-1/2 drafters)."
    ] = "greedy"
    drafter_cotrain_temperature: A[
        float, "sglang-rl: sampling temperature the sampled co-training objective trains for (RL's rollout temperature)."
    ] = 1.0
    drafter_cotrain_trainer: A[
        Optional[str], "sglang-rl: HOST:PORT of a shared `sglang-rl drafter trainer` to send rollouts to "
        "instead of training in this server (key: SGLANG_RL_COTRAIN_AUTHKEY)."
    ] = None

    speculative_switch: A[
        bool,
        "sglang-rl: the speculation switch: an EAGLE / EAGLE3 server drafts only in decode steps whose batch "
        "size and rolling acceptance (tokens per verify step) reach the break-even of --speculative-switch-table; "
        "other steps run the target's plain decode (no draft forward, no draft extend).",
    ] = False
    speculative_switch_table: A[
        Optional[str],
        "sglang-rl: break-even table of the speculation switch (JSON written by benchmark/bench_spec_curve.py "
        "--switch-table; default: the shipped H100/H200 table).",
    ] = None
    speculative_switch_window: A[
        int, "sglang-rl: drafting steps in the speculation switch's rolling acceptance."
    ] = 32
    speculative_switch_probe_interval: A[
        int, "sglang-rl: off decode steps between two probes of the drafter's acceptance by the speculation switch."
    ] = 256
    speculative_switch_probe_steps: A[
        int, "sglang-rl: drafting steps of one probe of the speculation switch."
    ] = 8
    speculative_switch_probe_backoff: A[
        int, "sglang-rl: the longest wait between two probes of the speculation switch, in probe intervals (each "
        "probe that leaves drafting off doubles the wait; new draft weights reset it)."
    ] = 8
    speculative_switch_probe_reach: A[
        float, "sglang-rl: the speculation switch probes only at batch sizes whose break-even is at most this many "
        "tokens per step above the last measured acceptance."
    ] = 0.5
    speculative_switch_catch_up_tokens: A[
        int, "sglang-rl: plain decode steps whose target rows the speculation switch keeps on the device, to catch "
        "the drafter up on them when drafting resumes (0: only the resuming step's)."
    ] = 32

    def __post_init__(self) -> None:
        if self.toploc_verification_topk < 1 or self.toploc_verification_topk > 4096:
            raise ValueError("--toploc-verification-topk must be between 1 and 4096")
        if not 0.0 <= self.toploc_verification_min_eos_prob < 1.0:
            raise ValueError("--toploc-verification-min-eos-prob must be in [0, 1)")
        if self.toploc_verification and self.speculative_algorithm:
            self._check_toploc_speculative()
        if self.toploc_verification_calibration is not None:
            self._check_toploc_calibration()
        if self.speculative_draft_model_path and self.load_format == "dummy" and not self.speculative_draft_load_format:
            # sglang loads the draft in --load-format unless told otherwise (verl starts servers this way)
            logger.warning("--load-format dummy applies to the draft too: %s is not read and the draft is random; "
                           "--speculative-draft-load-format auto loads it", self.speculative_draft_model_path)
        if self.specforge_export_dir is not None and str(self.speculative_algorithm or "").upper() != "EAGLE3":
            raise ValueError("--specforge-export-dir needs --speculative-algorithm EAGLE3: SpecForge's offline "
                             "format holds the auxiliary layers an EAGLE3 target captures for its draft")
        if self.speculative_switch:
            self._check_speculative_switch()
        running_given = self.max_running_requests is not None
        if self.drafter_cotrain:
            self._check_cotrain()
            if self.enable_memory_saver:
                # a release of the weights (verl's colocated mode) would drop what co-training
                # loaded into the draft, which nobody pushes back (sglang issue #31674)
                self.enable_draft_weights_cpu_backup = True
        super().__post_init__()
        if self.speculative_switch and not running_given:
            self._lift_speculative_running_cap()
        self._check_last_layer_rows_without_graphs()

    def _lift_speculative_running_cap(self) -> None:
        """sglang runs a speculative server at most 48 requests at a time unless told otherwise
        (arg_groups/speculative_hook.py); a switched server decodes large batches plainly, so it
        takes as many as a plain server (sized from the KV pool at start-up)."""
        logger.info("--speculative-switch: no --max-running-requests given, so as many running requests as a plain "
                    "server (not sglang's 48 for speculative decoding)")
        self.override("sglang-rl --speculative-switch", max_running_requests=None)

    def _check_speculative_switch(self) -> None:
        """The switch drives sglang's EAGLE worker and replaces sglang's own adaptive speculation."""
        from sglang_rl.speculation import BreakEvenTable, SwitchConfig

        if str(self.speculative_algorithm or "").upper() not in ("EAGLE", "EAGLE3"):
            raise ValueError("--speculative-switch needs --speculative-algorithm EAGLE or EAGLE3")
        if self.speculative_adaptive:
            raise ValueError("--speculative-switch replaces --speculative-adaptive: give one of them")
        if self.speculative_switch_catch_up_tokens < 0:
            raise ValueError("--speculative-switch-catch-up-tokens must be >= 0")
        SwitchConfig(window=self.speculative_switch_window, probe_interval=self.speculative_switch_probe_interval,
                     probe_steps=self.speculative_switch_probe_steps, probe_backoff=self.speculative_switch_probe_backoff,
                     probe_reach=self.speculative_switch_probe_reach)
        BreakEvenTable.load(self.speculative_switch_table)  # a bad table fails at start-up, not at the first step

    def _check_last_layer_rows_without_graphs(self) -> None:
        """An EAGLE3 target keeps its last-layer rows beside the auxiliary ones its draft reads
        (`adapters.last_layer_rows`); a graph replay returns only sglang's own fields."""
        from sglang.srt.model_executor.cuda_graph_config import Backend

        from sglang_rl.adapters.last_layer_rows import server_needs_them

        if not server_needs_them(self):
            return
        if self.device == "cpu":  # sglang's CPU graphs come with torch.compile
            graphs, off = self.enable_torch_compile, "without --enable-torch-compile"
        else:
            config = self.cuda_graph_config
            graphs = any(getattr(config, phase).backend != Backend.DISABLED for phase in ("decode", "prefill"))
            off = "with --disable-cuda-graph"
        if graphs:
            raise ValueError("--speculative-algorithm EAGLE3 with --toploc-verification, "
                             f"--enable-return-hidden-states or --specforge-export-dir runs {off}: a graph replay returns the "
                             "auxiliary rows its draft reads, not the last layer's that fingerprints and "
                             "hidden-state fields are defined on")

    def _check_toploc_calibration(self) -> None:
        """Load the calibration file now, so that a missing, malformed or mismatched one stops the
        server at start-up with the reason instead of failing every verification request."""
        from sglang_rl.fingerprint.calibration import load_calibration
        from sglang_rl.fingerprint.codec import DEFAULT_CHUNK_SIZE

        if not self.toploc_verification:
            raise ValueError("--toploc-verification-calibration needs --toploc-verification")
        calibration = load_calibration(self.toploc_verification_calibration)
        if calibration.topk != self.toploc_verification_topk:
            raise ValueError(
                f"the calibration file {self.toploc_verification_calibration} was measured with "
                f"topk={calibration.topk}, the server uses --toploc-verification-topk "
                f"{self.toploc_verification_topk}"
            )
        if calibration.chunk_size != DEFAULT_CHUNK_SIZE:
            raise ValueError(
                f"the calibration file {self.toploc_verification_calibration} was measured with "
                f"chunks of {calibration.chunk_size} rows, the server fingerprints chunks of "
                f"{DEFAULT_CHUNK_SIZE}"
            )
        if (
            self.toploc_verification_max_exp_mismatches is not None
            or self.toploc_verification_max_mant_err_mean != 10.0
            or self.toploc_verification_max_mant_err_median != 8.0
        ):
            raise ValueError(
                "--toploc-verification-calibration sets the bounds: leave the "
                "--toploc-verification-max-* flags at their defaults"
            )

    def _check_toploc_speculative(self) -> None:
        """Fingerprints follow a speculative step's committed run of rows for the algorithms whose
        rows are known to be in committed order; refuse the others with the reason."""
        from sglang_rl.request_options import unsupported_reason

        reason = unsupported_reason(self.speculative_algorithm)
        if reason is not None:
            raise ValueError(
                f"--toploc-verification with --speculative-algorithm "
                f"{str(self.speculative_algorithm).upper()}: {reason}"
            )

    def _check_cotrain_eagle3(self) -> None:
        """An EAGLE3 drafter co-trains when it has its own LM head (the one training changes)."""
        import json
        from pathlib import Path

        try:
            config = json.loads((Path(self.speculative_draft_model_path) / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--drafter-cotrain: cannot read the draft's config.json: {exc}") from exc
        if config.get("architectures") != ["LlamaForCausalLMEagle3"]:
            raise ValueError("--drafter-cotrain with EAGLE3 trains LlamaForCausalLMEagle3 drafters; "
                             f"the draft is {config.get('architectures')}")
        if config.get("tie_word_embeddings") or config.get("draft_vocab_size") is None:
            raise ValueError("--drafter-cotrain with EAGLE3 needs a draft with its own LM head "
                             "(draft_vocab_size set, tie_word_embeddings false), as `sglang-rl drafter "
                             "init --arch eagle3` writes")
        if self.drafter_cotrain_objective == "sampled":  # p_T needs the final rows; EAGLE3's are the aux ones
            raise ValueError("--drafter-cotrain-objective sampled with EAGLE3: the rows an EAGLE3 server captures "
                             "are the target's aux rows, which do not give its sampling distribution; use greedy")

    def _check_cotrain(self) -> None:
        """Refuse a co-training setup that cannot work, with the reason, before anything starts."""
        algorithm = (self.speculative_algorithm or "").upper()
        if algorithm not in ("EAGLE", "NEXTN", "EAGLE3") or not self.speculative_draft_model_path:
            raise ValueError(
                "--drafter-cotrain trains an EAGLE drafter: start the server with "
                "--speculative-algorithm EAGLE (or EAGLE3) --speculative-draft-model-path DIR "
                "(make one with `sglang-rl drafter init --model-path MODEL --out DIR [--arch eagle3]`)"
            )
        if algorithm == "EAGLE3":
            self._check_cotrain_eagle3()
        if self.pp_size != 1 or self.enable_dp_attention:
            raise ValueError("--drafter-cotrain supports tensor and data parallelism (--tp-size, --dp-size), "
                             "not pipeline parallelism or --enable-dp-attention")
        if self.nnodes > 1 and not self.drafter_cotrain_trainer:
            raise ValueError("--drafter-cotrain on several nodes: start a shared trainer and give every node "
                             "--drafter-cotrain-trainer HOST:PORT (a server's own trainer listens on loopback)")
        from sglang_rl.adapters.cotrain_config import config_from_args
        from sglang_rl.adapters.cotrain_parallel import check_tp_shapes

        config_from_args(self)
        if self.drafter_cotrain_train_in_gaps and (self.drafter_cotrain_trainer or self.tp_size > 1
                                                   or self.dp_size > 1):
            raise ValueError("--drafter-cotrain-train-in-gaps needs the server's own trainer process "
                             "(one scheduler, no --drafter-cotrain-trainer)")
        if self.drafter_cotrain_gap_busy_share != 1 and not self.drafter_cotrain_train_in_gaps:
            raise ValueError("--drafter-cotrain-gap-busy-share paces training while the server is busy, which "
                             "only --drafter-cotrain-train-in-gaps tells the trainer")
        if self.tp_size > 1:
            check_tp_shapes(self.speculative_draft_model_path, self.tp_size)
        if self.drafter_cotrain_trainer:  # a trainer that does not answer stops the start, with the reason
            from sglang_rl.drafter.trainer_client import check_trainer

            check_trainer(self.drafter_cotrain_trainer)
