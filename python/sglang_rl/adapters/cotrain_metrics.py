"""Prometheus gauges of drafter co-training (`--enable-metrics` servers), mirroring its stats."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["CotrainMetrics"]


class CotrainMetrics:
    """Prometheus gauges mirroring the stats (only when the server runs with --enable-metrics)."""

    def __init__(self, gauges: dict, labels: Optional[dict] = None) -> None:
        self.gauges = gauges
        self.labels = labels  # {"dp_rank": "N"} on a DP server: one series per replica

    @classmethod
    def create(cls, server_args: Any, dp_rank: int = 0) -> "CotrainMetrics":
        if not getattr(server_args, "enable_metrics", False):
            return cls({})
        from prometheus_client import Gauge

        names = {
            "rounds": "Drafter co-training rounds applied to the draft model",
            "samples": "Rollout samples sent to drafter co-training",
            "policy_version": "Policy versions (RL steps: runs of target weight updates) seen by drafter co-training",
            "loss": "Drafter training loss of the last round",
            "acceptance_length": "Tokens per verify step under the current co-trained draft",
            "held_out_acceptance_length": "Tokens per verify step of opted-out (held-out) requests",
        }
        per_replica = int(getattr(server_args, "dp_size", 1) or 1) > 1
        labelnames = ("dp_rank",) if per_replica else ()
        return cls({key: Gauge(f"sglang_rl:drafter_cotrain_{key}", doc, labelnames, multiprocess_mode="mostrecent")
                    for key, doc in names.items()}, {"dp_rank": str(dp_rank)} if per_replica else None)

    def publish(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            value = stats[key]
            if isinstance(value, list):
                value = next((v for v in reversed(value) if v is not None), None)
            if value is not None:
                (gauge.labels(**self.labels) if self.labels else gauge).set(value)
