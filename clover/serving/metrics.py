"""`/metrics`: Prometheus metrics of one server (prometheus_client, a registry per app).

Where vLLM has the metric, the name, type, buckets' meaning and the `model_name` label are vLLM's, so
dashboards and alerts written for vLLM read a Clover server: running and waiting requests, prompt and
generation tokens, finished requests by reason, and the histograms of time to first token,
inter-token latency, end-to-end latency, queue time and request sizes. Clover's own (`clover_*`):
forwards (NFE) and tokens per forward, verify's drafts, rejected / aborted requests, HTTP errors by
status, engine steps and the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from clover.serving.async_engine import AsyncEngine, RequestRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_TPF = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 16, 32)


class ServerMetrics:
    """The metrics of one server over `engine`; the async engine reports each finished request."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def counter(name: str, help_: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help_, [*label, *extra], registry=r)

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_, label, buckets=buckets, registry=r)

        def gauge(name: str, help_: str, read: object) -> None:
            Gauge(name, help_, label, registry=r).labels(model_name).set_function(read)

        # vLLM's names
        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              lambda: engine.engine.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: engine.queue_depth)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = counter("vllm:request_success", "Count of successfully processed requests.",
                               ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LATENCY)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", _E2E)
        self.prompt_size = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS)
        self.generation_size = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                         _TOKENS)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # Clover's own
        self.http_errors = counter("clover_http_errors", "HTTP error responses by status.", ("status",))
        self.nfe = counter("clover_nfe", "Model forwards of finished requests (previews, commits, checks).")
        self.tpf = histogram("clover_request_tpf", "Tokens per forward of finished requests.", _TPF)
        self.drafts_proposed = counter("clover_drafts_proposed", "verify: draft tokens checked by the causal head.")
        self.drafts_accepted = counter("clover_drafts_accepted", "verify: draft tokens the causal head agreed with.")
        self.lookup_proposed = counter("clover_lookup_drafts_proposed",
                                       "verify: those of the draft tokens checked that came from the context.")
        self.lookup_accepted = counter("clover_lookup_drafts_accepted",
                                       "verify: those of the drafts from the context the causal head agreed with.")
        r.register(_LiveCounters(engine, model_name))
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue,
                       self.prompt_size, self.generation_size, self.prefix_queries, self.prefix_hits, self.nfe,
                       self.tpf, self.drafts_proposed, self.drafts_accepted, self.lookup_proposed,
                       self.lookup_accepted):
            metric.labels(model_name)   # every series exists (at zero) from the start, as vLLM's do
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        engine.observers.append(self)

    def request_finished(self, rec: RequestRecord) -> None:
        m = self.model_name
        stats = rec.result.stats
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens - stats.cached_tokens)
        self.generation_tokens.labels(m).inc(rec.result.completion_tokens)   # (as usage counts them: the stop token too)
        self.success.labels(m, rec.result.finish_reason).inc()
        if rec.first_token is not None:
            self.ttft.labels(m).observe(rec.first_token - rec.submitted)
        for gap in rec.token_gaps:
            self.itl.labels(m).observe(gap)
        self.e2e.labels(m).observe(rec.finished - rec.submitted)
        self.queue.labels(m).observe(max(0.0, rec.finished - stats.wall_time - rec.submitted))
        self.prompt_size.labels(m).observe(stats.prompt_tokens)
        self.generation_size.labels(m).observe(rec.result.completion_tokens)
        self.prefix_queries.labels(m).inc(stats.prompt_tokens)
        self.prefix_hits.labels(m).inc(stats.cached_tokens)
        self.nfe.labels(m).inc(stats.nfe)
        self.tpf.labels(m).observe(stats.tpf)
        self.drafts_proposed.labels(m).inc(stats.drafts_proposed)
        self.drafts_accepted.labels(m).inc(stats.drafts_accepted)
        self.lookup_proposed.labels(m).inc(stats.lookup_drafts)
        self.lookup_accepted.labels(m).inc(stats.lookup_accepted)

    def request_ended(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


class _LiveCounters(Collector):
    """Counters the engine keeps itself, read at each scrape: requests, refusals, aborts, engine steps and
    the prefix cache's."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self.engine.stats
        rows = [("clover_requests", "Requests accepted by the engine.", s.requests),
                ("clover_requests_rejected", "Requests refused because the queue was full.", s.rejected),
                ("clover_requests_aborted", "Requests cancelled before the end (disconnects).", s.aborted),
                ("clover_engine_steps", "Engine steps.", s.steps)]
        prefix = self.engine.engine.prefix
        if prefix is not None:
            rows += [("clover_prefix_cache_lookups", "Prompt lookups in the prefix cache.", prefix.stats.lookups),
                     ("clover_prefix_cache_hits", "Lookups that reused at least one cached block.", prefix.stats.hits),
                     ("clover_prefix_cache_tokens_reused", "Prompt tokens restored from the prefix cache instead of "
                      "prefilled.", prefix.stats.tokens_reused),
                     ("clover_prefix_cache_evictions", "Blocks evicted from the prefix cache.", prefix.stats.evictions),
                     ("clover_prefix_cache_state_evictions", "Gated DeltaNet states evicted from cached blocks that "
                      "others continue (their K/V kept).", prefix.stats.state_evictions)]
        for name, help_, value in rows:
            family = CounterMetricFamily(name, help_, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if prefix is not None:
            for name, help_, value in [
                    ("clover_prefix_cache_bytes", "Bytes held by the prefix cache.", prefix.nbytes),
                    ("clover_prefix_cache_blocks", "Blocks held by the prefix cache (their attention K/V).",
                     len(prefix.entries)),
                    ("clover_prefix_cache_gdn_states", "Cached blocks holding Gated DeltaNet states (where a "
                     "restore can end).", prefix.stats.snapshots)]:
                family = GaugeMetricFamily(name, help_, labels=["model_name"])
                family.add_metric([self.model_name], value)
                yield family
