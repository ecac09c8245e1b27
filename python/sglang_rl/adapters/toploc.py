"""Scheduler side of TOPLOC: each scheduler's fingerprint pipeline, and verification of prefills.

Generation: every scheduler process of a --toploc-verification server makes one
`FingerprintPipeline` (fingerprint/pipeline.py) in its `Scheduler.__init__` AFTER hook and hangs
it on the objects sglang hands the other hooks (`scheduler_init_after`): the scheduler, its
output streamer (an `RLOutputStreamer`, through which its batch result processor finds it too),
and its workers, which stamp it on each batch result they return (`worker_forward_after`), where
`scheduler.copy_to_cpu_around` finds it. The
scheduler hooks route each step's rows to the requests' `FingerprintBuilder`s through it, finish
the builders of finishing requests and hold their outputs until their proofs are built;
`next_batch_after` and `idle_before` stream held outputs as soon as they are proven.

Verification: a prefill-only request carrying a fingerprint captures its prefill rows (FULL mode
for that request only); rows [L-1, L-1+n) - the rows that produced the n response tokens - are
checked against the proofs (`prefill_verification.PrefillVerification`): on the device in the
worker's forward hook where the API planned its checks there (`worker_forward_after`), else
with toploc's verifier once the prefill is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from sglang_rl.adapters import transport
from sglang_rl.adapters.prefill_verification import (
    DeviceChecks,
    PrefillVerification,
    TokenCheckSettings,
    batch_rows,
    check_batch,
)
from sglang_rl.adapters.request_plan import checks_on_device
from sglang_rl.adapters.request_state import peek, state_of
from sglang_rl.fingerprint import FingerprintError, Thresholds, decode_fingerprint
from sglang_rl.fingerprint.builder import FingerprintBuilder
from sglang_rl.fingerprint.calibration import UNCALIBRATED, ThresholdPolicy, cached_policy
from sglang_rl.fingerprint.device_prover import DeviceProver
from sglang_rl.fingerprint.pipeline import FingerprintPipeline
from sglang_rl.fingerprint.seeded_sampling import SamplingClaim
from sglang_rl.fingerprint.device_tokens import SeededRequest
from sglang_rl.fingerprint.settings import PipelineSettings
from sglang_rl.fingerprint.termination import MAX_NEW_TOKENS_FIELD
from sglang_rl.request_options import DEVICE_CHECKS_KEY, FINGERPRINTS_FIELD, RESPONSE_START_KEY, TOKEN_LOGPROBS_FIELD

TO_VALIDATE_KEY = "toploc_verification_fingerprint_to_validate"
ATTR = "_sglang_rl_fingerprints"
"""The attribute that carries a scheduler's pipeline on the objects its hooks are handed."""
OWNERS = ("output_streamer", "tp_worker", "model_worker")
"""The scheduler's parts that carry its pipeline, besides the scheduler itself (its batch result
processor, frozen, reaches it through its output streamer)."""
CHECKS_ATTR = "_sglang_rl_device_checks"
"""The attribute that carries a worker's `DeviceChecks` (verification on the device)."""


@dataclass(kw_only=True, slots=True)
class RLOutputStreamer(SchedulerOutputStreamer):
    """sglang's output streamer with a field for its scheduler's fingerprint pipeline: sglang's
    class has slots, so it takes no attribute that is not a field."""

    _sglang_rl_fingerprints: Optional[FingerprintPipeline] = None


def thresholds_from_server_args(server_args: Any) -> ThresholdPolicy:
    """The pass/fail bounds in force: those of --toploc-verification-calibration (read once per
    process), else the uncalibrated defaults as adjusted by the --toploc-verification-max-* flags."""
    path = getattr(server_args, "toploc_verification_calibration", None)
    if path:
        return cached_policy(path)
    base = Thresholds.for_topk(
        server_args.toploc_verification_topk,
        mant_err_mean=server_args.toploc_verification_max_mant_err_mean,
        mant_err_median=server_args.toploc_verification_max_mant_err_median,
    )
    if server_args.toploc_verification_max_exp_mismatches is not None:
        base = Thresholds(
            max_exp_mismatches=server_args.toploc_verification_max_exp_mismatches,
            max_mant_err_mean=base.max_mant_err_mean,
            max_mant_err_median=base.max_mant_err_median,
        )
    source = UNCALIBRATED if base == Thresholds.for_topk(server_args.toploc_verification_topk) else (
        "uncalibrated, set by flags"
    )
    return ThresholdPolicy(full=base, source=source)


def new_pipeline(device: Optional[torch.device], settings: PipelineSettings = PipelineSettings(),
                 prover: Optional[DeviceProver] = None) -> FingerprintPipeline:
    """A pipeline whose fingerprints go out on their requests' responses."""
    return FingerprintPipeline(device, settings, _post_fingerprint, prover)


def _post_fingerprint(req: Any, fingerprint: str) -> None:
    transport.post(req, **{FINGERPRINTS_FIELD: [fingerprint]})


def scheduler_device(server_args: Any) -> Optional[torch.device]:
    """The accelerator the scheduler runs on (top-k selection runs there), None on a CPU server.
    Asked in the scheduler's own thread, which sglang has bound to its device by then."""
    if torch.cuda.is_available() and server_args.device not in ("cpu", None):
        return torch.device("cuda", torch.cuda.current_device())
    return None


def scheduler_init_after(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER Scheduler.__init__: one fingerprint pipeline per scheduler process of a
    --toploc-verification server, on the scheduler and on its parts whose hooks use it (the
    output streamer is an `RLOutputStreamer`: a streamer of another class fails here, loudly,
    rather than a server that never sends its fingerprints)."""
    if not getattr(scheduler.server_args, "toploc_verification", False):
        return
    pipeline = new_pipeline(scheduler_device(scheduler.server_args))
    setattr(scheduler, ATTR, pipeline)
    for name in OWNERS:
        owner = getattr(scheduler, name, None)
        if owner is not None:
            setattr(owner, ATTR, pipeline)
            checks = (DeviceChecks.of_worker(owner, scheduler.server_args.toploc_verification_max_sampling_z)
                      if checks_on_device(scheduler.server_args) else None)
            if checks is not None:
                setattr(owner, CHECKS_ATTR, checks)


def pipeline_of(owner: Any) -> Optional[FingerprintPipeline]:
    """The pipeline of the scheduler that `owner` (a part of it, or a batch result) belongs to;
    None on a server without --toploc-verification."""
    return getattr(owner, ATTR, None)


def processor_pipeline(processor: Any) -> Optional[FingerprintPipeline]:
    """The pipeline of a batch result processor's scheduler (found on its output streamer)."""
    return getattr(getattr(processor, "output_streamer", None), ATTR, None)


def worker_forward_after(result: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER a worker's forward_batch_generation: the batch result carries the worker's pipeline,
    for the hook on its copy to the host (`scheduler.copy_to_cpu_around`); a prefill's
    verification requests take their rows on the device and start their checks there
    (`prefill_verification.check_batch`, queued on the forward's stream, never waited for)."""
    pipeline = getattr(worker, ATTR, None)
    if pipeline is not None and result is not None:
        setattr(result, ATTR, pipeline)
        checks = getattr(worker, CHECKS_ATTR, None)
        batch = args[0] if args else kwargs.get("batch")
        rows = None if checks is None else batch_rows(batch, result)
        if rows is not None:
            check_batch(checks, batch, rows)
    return result


def finish_builders(pipeline: FingerprintPipeline, items: list[tuple[FingerprintBuilder, Any]]) -> list[Any]:
    """`FingerprintPipeline.finish_builders` for sglang requests finishing in one output batch:
    each fingerprint covers exactly the request's returned output ids; aborted requests get
    none. Returns the requests held back until their proofs are built."""
    return pipeline.finish_builders([
        (builder, req, 0 if isinstance(req.finished_reason, FINISH_ABORT) else len(req.output_ids_through_stop))
        for builder, req in items])


def decode_builders(reqs: list, stride: int, accepted: list[int] | None
                    ) -> tuple[list, list[int], list[int] | None]:
    """The fingerprint builders of a decode step's running requests, with the first row and
    the row count of each one's committed run. This runs for every request at every step."""
    builders, picked = [], []
    for i, req in enumerate(reqs):
        state = peek(req)
        builder = None if state is None else state.fingerprint
        if builder is not None and not builder.done and not (req.finished() or req.is_retracted):
            builders.append(builder)
            picked.append(i)
    counts = None if accepted is None else [accepted[i] for i in picked]
    return builders, picked if stride == 1 else [i * stride for i in picked], counts


def with_held_outputs(pipeline: FingerprintPipeline, reqs: list, args: tuple, kwargs: dict
                      ) -> tuple[list, tuple, dict]:
    """A batch's outputs (stream_output's requests and other arguments) without the requests
    held for their proofs, and with those released now, whose proofs are done, added."""
    ready = pipeline.release_finished()
    held = pipeline.held_ids()
    if held:
        reqs = [r for r in reqs if id(r) not in held]
    if ready:
        present = {id(r) for r in reqs}
        reqs = list(reqs) + [r for r in ready if id(r) not in present]
        args, kwargs = _with_logprobs_for(ready, args, kwargs)
    return reqs, args, kwargs


def _with_logprobs_for(reqs: list, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """stream_output's `return_logprob` (the batch's flag) raised when one of `reqs`, released
    into another batch's outputs, asked for log-probs (each request's own flag still decides)."""
    if not any(r.return_logprob for r in reqs):
        return args, kwargs
    if args:
        return (True, *args[1:]), kwargs
    return args, {**kwargs, "return_logprob": True}


def next_batch_after(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER Scheduler.get_next_batch_to_run: stream held outputs as soon as their proofs are
    done, rather than with the next batch's outputs, a whole step later (under the overlap
    schedule the requests that end a burst would reach their clients a step after they would
    without fingerprints). With no batch to launch, the scheduler's next move is to wait for the
    GPU anyway (the last batch's results) or to idle: it waits for the held proofs instead, short
    jobs on their own stream that were launched before that batch's results were due."""
    _stream_held(scheduler, wait=plan.batch_to_run is None)
    return plan


def idle_before(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE Scheduler.on_idle: the backstop for loops that idle without calling
    get_next_batch_to_run (disaggregated prefill and decode, multiplexing): no batch is left to
    carry held outputs, so wait for their proofs and stream them now."""
    _stream_held(scheduler, wait=True)


def _stream_held(scheduler: Any, wait: bool) -> None:
    """Stream the held requests whose proofs are done (all of them, waiting, with `wait`),
    outside a batch's own outputs (they are not held any more, and the pipeline is `releasing`,
    so `scheduler.stream_output_before` lets them through untouched)."""
    pipeline = pipeline_of(scheduler)
    if pipeline is None:
        return
    pipeline.release_to(
        lambda ready: scheduler.output_streamer.stream_output(ready, any(r.return_logprob for r in ready)), wait)


def adopt(req: Any, options: dict, server_args: Any, stores: bool) -> None:
    """A new scheduler request's TOPLOC state: a generation's fingerprint builder, or the
    verification of a fingerprint it carries. Its capture mode rises on every rank; the state is
    kept where outputs are sent (`stores`)."""
    if not getattr(server_args, "toploc_verification", False):
        return
    if options.get(TO_VALIDATE_KEY) is None:
        builder = builder_for_request(options, server_args)
        if builder is None:
            return
        needed = CaptureHiddenMode.LAST
        if stores:
            state_of(req).fingerprint = builder
    else:
        verification = verification_for_request(options, server_args)
        needed = verification.capture_mode
        if verification.on_device:  # on every rank: their radix caches decide alike
            state_of(req).add_rows(verification.prefix_guard(len(req.origin_input_ids)))
        if stores:
            state_of(req).verification = verification
    req.return_hidden_states_mode = max(req.return_hidden_states_mode, needed)


def builder_for_request(options: dict, server_args: Any) -> Optional[FingerprintBuilder]:
    """The fingerprint builder of a new generation (a benchmark's plugin may answer None)."""
    return FingerprintBuilder(server_args.toploc_verification_topk)


def verification_for_request(options: dict, server_args: Any) -> PrefillVerification:
    """The verification of the fingerprint a new prefill-only request carries."""
    topk = server_args.toploc_verification_topk
    try:
        fp = decode_fingerprint(options[TO_VALIDATE_KEY], expected_topk=topk)
    except FingerprintError as exc:
        return PrefillVerification.rejecting(str(exc))
    start = int(options.get(RESPONSE_START_KEY, -1))
    return PrefillVerification(fp, start, thresholds_from_server_args(server_args),
                               getattr(server_args, "toploc_verification_min_eos_prob", 0.0),
                               options.get(MAX_NEW_TOKENS_FIELD), device=_check_settings(options),
                               token_lists=bool(options.get(TOKEN_LOGPROBS_FIELD)))


def _check_settings(options: dict) -> Optional[TokenCheckSettings]:
    """The device checks the API planned for a verification (`request_plan`), or None."""
    planned = options.get(DEVICE_CHECKS_KEY)
    if planned is None:
        return None
    claim = planned.get("seeded")
    seeded = None if claim is None else SeededRequest(
        SamplingClaim(claim["temperature"], claim["top_p"], claim["top_k"], claim["min_p"]), claim["seed"])
    return TokenCheckSettings(bool(planned.get("sampled")), seeded, bool(planned.get("token_lists")))
