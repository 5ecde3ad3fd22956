"""Prometheus metrics of one server, named specdec_*, in the server's own registry (no global state).
The engine loop updates them; it never logs."""
from __future__ import annotations

from specdec.errors import missing_dependency

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
STATUSES = ("success", "cancelled", "rejected", "invalid", "error")


class Metrics:
    def __init__(self):
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise missing_dependency("prometheus_client", "serve") from exc
        self.registry = registry = prom.CollectorRegistry()
        self.requests = prom.Counter("specdec_requests", "Requests by final status", ["status"], registry=registry)
        self.ttft = prom.Histogram("specdec_time_to_first_token_seconds", "Arrival to the first committed token",
                                   buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = prom.Histogram("specdec_time_per_output_token_seconds", "Per output token after the first",
                                   buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = prom.Counter("specdec_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.prompt_tokens_reused = prom.Counter("specdec_prompt_tokens_reused",
                                                 "Prompt tokens whose K/V an earlier request left in the slot (not fed)",
                                                 registry=registry)
        self.generation_tokens = prom.Counter("specdec_generation_tokens", "Tokens generated", registry=registry)
        self.proposed = prom.Counter("specdec_draft_tokens_proposed", "Draft tokens verified", registry=registry)
        self.accepted = prom.Counter("specdec_draft_tokens_accepted", "Draft tokens accepted", registry=registry)
        self.verify_passes = prom.Counter("specdec_verify_passes", "Row verify passes", registry=registry)
        self.acceptance_rate = prom.Gauge("specdec_acceptance_rate", "Accepted / proposed drafts so far",
                                          registry=registry)
        self.mean_acceptance_length = prom.Gauge("specdec_mean_acceptance_length",
                                                 "Emitted tokens per verify pass so far", registry=registry)
        self.queue_depth = prom.Gauge("specdec_queue_depth", "Requests waiting for a row", registry=registry)
        self.active_rows = prom.Gauge("specdec_active_rows", "Rows in the running batch", registry=registry)
        self.gamma = prom.Gauge("specdec_gamma", "γ chosen for the latest round", registry=registry)
        self.rounds = prom.Counter("specdec_rounds", "Engine rounds by γ", ["gamma"], registry=registry)
        self.round_rows = prom.Histogram("specdec_round_rows", "Rows in one engine round",
                                         buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=registry)
        self.round_seconds = prom.Histogram("specdec_round_seconds", "Wall time of one engine round",
                                            buckets=LATENCY_BUCKETS, registry=registry)
        for status in STATUSES:
            self.requests.labels(status)  # every status shows, at 0, from the start
        self._emitted = self._passes = self._proposed = self._accepted = 0

    def observe_round(self, record, seconds: float) -> None:
        """Counters of one Round record (specdec.runtime.state.Round)."""
        rows = [row for row in record.rows if row is not None]
        proposed = sum(row.proposed for row in rows)
        accepted = sum(row.accepted for row in rows)
        self.proposed.inc(proposed)
        self.accepted.inc(accepted)
        self.verify_passes.inc(len(rows))
        self.generation_tokens.inc(sum(len(row.committed) for row in rows))
        self.rounds.labels(str(record.gamma)).inc()
        self.gamma.set(record.gamma)
        self.round_seconds.observe(seconds)
        self.round_rows.observe(len(rows))
        self._proposed += proposed
        self._accepted += accepted
        self._passes += len(rows)
        self._emitted += accepted + len(rows)
        if self._proposed:
            self.acceptance_rate.set(self._accepted / self._proposed)
        self.mean_acceptance_length.set(self._emitted / self._passes)

    def observe_finish(self, status: str, ttft: float | None, tpot: float | None) -> None:
        self.requests.labels(status).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def exposition(self) -> tuple[bytes, str]:
        import prometheus_client as prom

        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
