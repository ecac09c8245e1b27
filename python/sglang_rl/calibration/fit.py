"""Calibrate the TOPLOC thresholds for one model and measure what they catch.

    sglang-rl calibrate --model-path MODEL_DIR --out calibration.json [--plot roc.png]

Measures on the CPU with transformers (``sglang_rl.calibration.measure``): honest recomputation noise
(decode vs prefill, batch sizes, chunked prefill) and cheats (bf16 instead of float32, weight
noise, another model), then picks per-chunk bounds for a per-response false-rejection budget
(rule: ``calibration.choose_bound``) and writes a calibration file for
``--toploc-verification-calibration``. Records measured elsewhere (GPU servers: fp8 weights, fp8 KV
cache, CUDA graphs, TP, attention backends) are JSON lines with the fields of a verification result
plus ``config`` and ``honest``; pass them with ``--stats`` (and ``--no-measure`` to use only them).

Detection numbers are measured out of sample: bounds and score histograms are fitted on the
even-numbered prompts and evaluated on the odd ones (the file itself is fitted on all).
"""

from __future__ import annotations

from dataclasses import asdict
import json
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_rl.arguments import ArgumentParser
from sglang_rl.fingerprint.calibration import (
    BOUND_NAMES,
    MIN_SAMPLES,
    RULE_TEXT,
    STATISTICS,
    Calibration,
    ScoreHistogram,
    ThresholdPolicy,
    choose_thresholds,
    per_check_budget,
    save_calibration,
    summarize,
)
from sglang_rl.fingerprint.evidence import (
    DEFAULT_EDGES,
    REJECT,
    EvidencePolicy,
    WorkerEvidence,
    histogram,
    log_likelihood_ratios,
    response_score,
)
from sglang_rl.fingerprint.verify import ChunkResult, Thresholds

CHUNK = 32
WORKER_RESPONSES = (1, 2, 3, 4, 8, 16, 32)


def _chunk_classes(records: Sequence[dict]) -> tuple[list[ChunkResult], list[ChunkResult]]:
    """The chunks of some records, split into full chunks and short final chunks."""
    full, short = [], []
    for rec in records:
        n = rec.get("response_tokens", CHUNK * len(rec["chunks"]))
        for index, chunk in enumerate(rec["chunks"]):
            result = ChunkResult(*(chunk[s] for s in STATISTICS))
            last_rows = n - CHUNK * (len(rec["chunks"]) - 1)
            (short if index == len(rec["chunks"]) - 1 and last_rows < CHUNK else full).append(result)
    return full, short


def fit_bounds(records: Sequence[dict], budget: float, source: str = "fit") -> ThresholdPolicy:
    """Per-chunk bounds (full chunks, and short final chunks when at least MIN_SAMPLES were
    measured) from the honest records, by ``calibration.choose_thresholds``."""
    honest = [r for r in records if r["honest"]]
    full, short = _chunk_classes(honest)
    per_response = max(r.get("response_tokens", CHUNK * len(r["chunks"])) // CHUNK for r in honest)
    check = per_check_budget(budget, per_response)
    return ThresholdPolicy(
        full=choose_thresholds(full, check),
        short=choose_thresholds(short, check) if len(short) >= MIN_SAMPLES else None,
        source=source,
    )


def score_histogram(records: Sequence[dict], bounds: ThresholdPolicy) -> ScoreHistogram:
    """Histograms of the per-response score under ``bounds``: honest records, and each cheat."""
    by_config: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if not r["honest"]:
            by_config[r["config"]].append(response_score(r, bounds, CHUNK))
    return ScoreHistogram(
        edges=DEFAULT_EDGES,
        honest=histogram([response_score(r, bounds, CHUNK) for r in records if r["honest"]]),
        cheats={name: histogram(scores) for name, scores in sorted(by_config.items())},
    )


def _worker_statistics(scores: Sequence[float], evidence: WorkerEvidence, n: int, workers: int, rng: random.Random) -> tuple[list[float], float]:
    """Simulated workers drawing n responses (with replacement) from ``scores``: the statistic
    after n responses of each, and the fraction rejected within n."""
    finals, rejected = [], 0
    for _ in range(workers):
        w = WorkerEvidence(edges=evidence.edges, llr=evidence.llr, thresholds=evidence.thresholds,
                           policy=evidence.policy)
        for _ in range(n):
            w.add_score(rng.choice(scores))
        finals.append(w.statistic)
        rejected += w.verdict == REJECT
    return finals, rejected / workers


def roc(negatives: Sequence[float], positives: Sequence[float]) -> tuple[list[tuple[float, float]], float]:
    """ROC points (false positive rate, true positive rate) of the rule "positive when the value
    is at least t", over every threshold t, and the area under the curve (ties count half)."""
    labelled = sorted([(v, 0) for v in negatives] + [(v, 1) for v in positives], reverse=True)
    n_neg, n_pos = len(negatives), len(positives)
    points = [(0.0, 0.0)]
    fp = tp = 0
    auc = 0.0
    i = 0
    while i < len(labelled):
        value, new_fp, new_tp = labelled[i][0], 0, 0
        while i < len(labelled) and labelled[i][0] == value:
            new_fp += labelled[i][1] == 0
            new_tp += labelled[i][1] == 1
            i += 1
        auc += new_fp * (tp + 0.5 * new_tp)
        fp, tp = fp + new_fp, tp + new_tp
        points.append((fp / n_neg, tp / n_pos))
    return points, auc / (n_neg * n_pos)


def evaluate(
    records: Sequence[dict], budget: float, workers: int, seed: int, policy: EvidencePolicy,
    fixed_bounds: ThresholdPolicy | None = None,
) -> dict[str, Any]:
    """Out-of-sample results: fit on even prompts, score the odd ones; per-response and
    per-worker detection of each cheat, honest false rejections and accusations, ROC curves.
    ``fixed_bounds`` replaces the fitted bounds (the score histograms are still fitted)."""
    fit_set = [r for r in records if r.get("prompt", 0) % 2 == 0]
    test_set = [r for r in records if r.get("prompt", 0) % 2 == 1] or list(records)
    bounds = fixed_bounds or fit_bounds(fit_set, budget)
    hist = score_histogram(fit_set, bounds)
    evidence = WorkerEvidence(edges=hist.edges, llr=log_likelihood_ratios(hist, policy), thresholds=bounds,
                              policy=policy)
    honest = [response_score(r, bounds, CHUNK) for r in test_set if r["honest"]]
    cheats: dict[str, list[float]] = defaultdict(list)
    for r in test_set:
        if not r["honest"]:
            cheats[r["config"]].append(response_score(r, bounds, CHUNK))
    rng = random.Random(seed)
    out: dict[str, Any] = {
        "fitted_on": "even prompts", "evaluated_on": "odd prompts",
        "bounds": {"full": asdict(bounds.full), "short": asdict(bounds.short) if bounds.short else None},
        "honest_responses": len(honest),
        "honest_false_rejection_rate": sum(s > 1 for s in honest) / max(1, len(honest)),
        "honest_worst_score": max(honest) if honest else None,
        "honest_workers": {}, "cheats": {}, "roc": {},
    }
    honest_final: dict[int, list[float]] = {}
    for n in WORKER_RESPONSES:
        finals, accused = _worker_statistics(honest, evidence, n, workers, rng)
        honest_final[n] = finals
        out["honest_workers"][n] = {"accused": accused, "bound": policy.honest_bound(n)}
    for name, scores in sorted(cheats.items()):
        points, auc = roc(honest, scores)
        entry: dict[str, Any] = {
            "responses": len(scores),
            "detected_per_response": sum(s > 1 for s in scores) / len(scores),
            "response_auc": auc,
            "workers_rejected_within": {},
        }
        curves = {"response": points}
        for n in WORKER_RESPONSES:
            finals, rejected = _worker_statistics(scores, evidence, n, workers, rng)
            entry["workers_rejected_within"][n] = rejected
            curves[f"worker_{n}"], entry.setdefault("worker_auc", {})[n] = roc(honest_final[n], finals)
        out["cheats"][name] = entry
        out["roc"][name] = curves
    return out


def summary(records: Sequence[dict], policy: ThresholdPolicy, defaults: ThresholdPolicy) -> dict[str, Any]:
    """Per configuration: responses, per-statistic summaries of full and short chunks, and the
    fraction of responses the bounds (and the uncalibrated defaults) reject, in sample."""
    out: dict[str, Any] = {}
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["config"]].append(r)
    for name, recs in groups.items():
        full, short = _chunk_classes(recs)
        out[name] = {
            "honest": recs[0]["honest"],
            "responses": len(recs),
            "rejected_per_response": sum(response_score(r, policy, CHUNK) > 1 for r in recs) / len(recs),
            "rejected_per_response_at_defaults": sum(response_score(r, defaults, CHUNK) > 1 for r in recs)
            / len(recs),
            "full": {s: summarize([getattr(c, s) for c in full]) for s in STATISTICS},
            "short": {s: summarize([getattr(c, s) for c in short]) for s in STATISTICS},
        }
    return out


def plot(records: Sequence[dict], results: dict[str, Any], cal: Calibration, path: str,
         title: str = "cheats vs honest recomputation") -> bool:
    """Top row: ROC per response and per worker after N responses, one panel per cheat (held-out
    prompts, calibrated bounds). Bottom row: the per-chunk distribution of each statistic, honest
    vs each cheat, with the calibrated and the default full-chunk bounds. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = results["calibrated"]
    names = sorted(res["roc"])
    cols = max(len(names), len(STATISTICS))
    fig, axes = plt.subplots(2, cols, figsize=(4.0 * cols, 7.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for key, points in res["roc"][name].items():
            if key not in ("response", "worker_2", "worker_4", "worker_16"):
                continue
            xs, ys = zip(*points)
            entry = res["cheats"][name]
            if key == "response":
                label = f"per response (AUC {entry['response_auc']:.3f})"
            else:
                n = int(key.split("_")[1])
                label = f"worker, {n} responses (AUC {entry['worker_auc'][n]:.3f})"
            ax.plot(xs, ys, drawstyle="steps-post", label=label, lw=2.2 if key == "response" else 1.2)
        ax.plot([0, 1], [0, 1], color="0.8", lw=0.8, ls="--")
        ax.set_title(f"ROC: {name} vs honest (held-out prompts)", fontsize=10)
        ax.legend(loc="lower right", fontsize=7)
        ax.set_xlabel("honest flagged (FPR)")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("cheat flagged (TPR)")
    defaults = Thresholds.for_topk(cal.topk)
    for ax, stat in zip(axes[1], STATISTICS):
        groups = defaultdict(list)
        for r in records:
            full, _ = _chunk_classes([r])
            groups["honest" if r["honest"] else r["config"]].extend(min(getattr(c, stat), 64.0) for c in full)
        top = max(max(v) for v in groups.values())
        bins = [i * max(top, 1.0) / 40 for i in range(41)]
        for label, values in groups.items():
            ax.hist(values, bins=bins, histtype="step", lw=1.5, label=label, weights=[1 / len(values)] * len(values))
        bound = BOUND_NAMES[stat]
        ax.axvline(getattr(cal.full, bound), color="k", ls="--", lw=1, label="calibrated bound")
        if getattr(defaults, bound) <= top:
            ax.axvline(getattr(defaults, bound), color="r", ls=":", lw=1, label="default bound")
        ax.set_xlabel(f"{stat} per full chunk (clipped at 64)")
        ax.set_yscale("log")
    axes[1][0].set_ylabel("fraction of full chunks")
    axes[1][0].legend(fontsize=7)
    for row in axes:
        for ax in row[len(names) if row is axes[0] else len(STATISTICS):]:
            ax.axis("off")
    fig.suptitle(f"{cal.model_name}, topk {cal.topk}: {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def _print_report(cal: Calibration, results: dict[str, Any]) -> None:
    print(f"model {cal.model_name}: topk {cal.topk}, budget {cal.false_rejection_budget:g} per response")
    print(f"  full-chunk bounds {asdict(cal.full)}")
    print(f"  short-chunk bounds {asdict(cal.short) if cal.short else None}")
    print("configuration          responses  rejected  at-defaults  worst exp/mean/median (full | short)")
    for name, s in cal.summary["configs"].items():
        worst = " | ".join(
            "/".join(f"{s[k][st].get('max', float('nan')):.4g}" for st in STATISTICS) for k in ("full", "short")
        )
        print(f"  {name:21s}{s['responses']:>9d}{s['rejected_per_response']:>10.3f}"
              f"{s['rejected_per_response_at_defaults']:>13.3f}  {worst}")
    for kind, ev in results.items():
        print(f"held out, {kind} bounds {json.dumps(ev['bounds']['full'])}: honest false rejections "
              f"{ev['honest_false_rejection_rate']:.3f} of {ev['honest_responses']}; honest workers accused "
              + json.dumps({n: v["accused"] for n, v in ev["honest_workers"].items()}))
        for name, c in ev["cheats"].items():
            print(f"  {name}: detected per response {c['detected_per_response']:.3f} (AUC {c['response_auc']:.3f}), "
                  f"workers rejected within N {json.dumps(c['workers_rejected_within'])}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True, help="model folder (transformers format)")
    parser.add_argument("--out", required=True, help="calibration file to write")
    parser.add_argument("--name", help="model name stored in the file (default: the folder name)")
    parser.add_argument("--prompts", type=int, default=32, help="GSM8K prompts (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per response (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="batch size of the batched configurations")
    parser.add_argument("--prefill-chunk", type=int, default=16, help="chunk of the chunked-prefill verifier")
    parser.add_argument("--noise", type=float, nargs="*", default=[0.01, 0.001],
                        help="relative weight-noise cheats (default 0.01 0.001)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16-vs-float32 cheat")
    parser.add_argument("--other-model", action="append", default=[],
                        help="another model with the same tokenizer, as a cheat (repeatable)")
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--budget", type=float, default=1e-3,
                        help="false-rejection budget per response (default 1e-3)")
    parser.add_argument("--stats", action="extend", nargs="+", default=[],
                        help="JSON-lines files of pre-measured records to add (e.g. from a GPU run); repeatable")
    parser.add_argument("--no-measure", action="store_true", help="use only the --stats records")
    parser.add_argument("--save-stats", help="write all records (measured and read) as JSON lines")
    parser.add_argument("--results", help="write the held-out evaluation (detection, ROC) as JSON")
    parser.add_argument("--plot", help="write ROC curves as PNG (needs matplotlib)")
    parser.add_argument("--plot-title", default="cheats vs honest recomputation",
                        help="what the plot compares (its title after the model name)")
    parser.add_argument("--workers", type=int, default=2000, help="simulated workers per case")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from sglang_rl.calibration.measure import measure, read_records, write_records

    if not args.no_measure and not (Path(args.model_path) / "config.json").is_file():
        parser.error(f"--model-path {args.model_path}: not a model folder (no config.json)")
    try:
        records = read_records(args.stats)
    except (OSError, ValueError) as exc:  # a missing or malformed --stats file: one line, exit 2
        parser.error(f"--stats: {exc}")
    if not args.no_measure:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        records += measure(
            args.model_path, prompts=args.prompts, max_tokens=args.max_tokens, batch=args.batch,
            prefill_chunk=args.prefill_chunk, noise=args.noise, bf16=not args.no_bf16,
            other_models=args.other_model, topk=args.topk, seed=args.seed,
        )
    if not any(r["honest"] for r in records):
        print("error: no honest records to calibrate on", file=sys.stderr)
        return 2
    if args.save_stats:
        write_records(records, args.save_stats)
    name = args.name or Path(args.model_path).name
    policy = fit_bounds(records, args.budget, source=name)
    hist = score_histogram(records, policy)
    defaults = ThresholdPolicy(Thresholds.for_topk(args.topk))
    evidence_policy = EvidencePolicy()
    results = {
        "calibrated": evaluate(records, args.budget, args.workers, args.seed, evidence_policy),
        "defaults": evaluate(records, args.budget, args.workers, args.seed, evidence_policy, defaults),
    }
    cal = Calibration(
        model_name=name,
        model_path=str(args.model_path),
        topk=args.topk,
        chunk_size=CHUNK,
        false_rejection_budget=args.budget,
        full=policy.full,
        short=policy.short,
        summary={
            "command": "sglang-rl calibrate " + " ".join(sys.argv[1:] if argv is None else argv),
            "configs": summary(records, policy, defaults),
            "held_out": {
                kind: {k: v for k, v in res.items() if k != "roc"} for kind, res in results.items()
            },
        },
        histogram=hist,
        rule=RULE_TEXT,
    )
    save_calibration(cal, args.out)
    if args.results:
        Path(args.results).write_text(json.dumps(results) + "\n")
    _print_report(cal, results)
    if args.plot:
        if plot(records, results, cal, args.plot, args.plot_title):
            print(f"plot: {args.plot}")
        else:
            print("matplotlib is not installed: no plot")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
