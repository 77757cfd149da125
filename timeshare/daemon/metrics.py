"""Prometheus metrics of `timeshared`, served as text on a loopback port.

One registry per daemon (not the process-global one), so tests and benchmarks can run several.
Every sample carries a `node` label (the daemon's node of the job), so that the daemons of a job
over several nodes can be scraped into one dashboard.
The HTTP server is prometheus-client's own, in its own thread: a scrape never waits for the
event loop, and the loop never waits for a scrape (updating a metric takes a lock for a few
microseconds).
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from timeshare.cycle.steps import StepFigures
from timeshare.errors import WeightsMismatch
from timeshare.state import Phase
from timeshare.state.service import ServiceLifecycle
from timeshare.units import gbps

LOOPBACK = "127.0.0.1"
LIFECYCLE_STATES = [state.value for state in ServiceLifecycle]
PHASE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)


class NodeLabelled(Collector):
    """Every metric of `inner`, each sample labelled with the node it was measured on."""

    def __init__(self, inner: CollectorRegistry, node: int) -> None:
        self.inner = inner
        self.node = str(node)

    def collect(self) -> Iterator[Metric]:
        for metric in self.inner.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [
                sample._replace(labels={**sample.labels, "node": self.node})
                for sample in metric.samples
            ]
            yield labelled


class Metrics:
    """Every metric the daemon exports; methods say what happened, in the daemon's words.
    `registry` is what is served: every metric, labelled with `node`."""

    def __init__(self, node: int = 0) -> None:
        own = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(NodeLabelled(own, node))
        r = own
        self.lifecycle = Enum(
            "timeshare_lifecycle", "Where the job stands", states=LIFECYCLE_STATES, registry=r
        )
        self.phase_seconds = Histogram(
            "timeshare_phase_duration_seconds",
            "One rank's run of one phase, both workers included",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.sync_bytes = Counter(
            "timeshare_sync_bytes", "Weight bytes moved trainer to rollout", registry=r
        )
        self.sync_gbps = Gauge("timeshare_sync_gbps", "Rate of the last SYNC (GB/s)", registry=r)
        self.ack_seconds = Histogram(
            "timeshare_sync_ack_seconds",
            "Per bucket of a SYNC: from sending its header to the receiver's ACK",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "timeshare_failures", "Cycles that failed, by the error's kind", ["kind"], registry=r
        )
        self.timeouts = Counter(
            "timeshare_timeouts", "Failures that were deadlines, by kind", ["kind"], registry=r
        )
        self.committed_step = Gauge(
            "timeshare_committed_step", "Last step every rank checkpointed", registry=r
        )
        self.weight_version = Gauge(
            "timeshare_weight_version", "Weight version the rollout engines serve", registry=r
        )
        self.control_requests = Counter(
            "timeshare_control_requests",
            "Control-socket requests, by method and outcome",
            ["method", "outcome"],
            registry=r,
        )
        self.logprob_diff = Gauge(
            "timeshare_logprob_max_abs_diff",
            "The last step's largest trainer/rollout logprob difference (0 when batch-invariant)",
            registry=r,
        )
        self.invariance_drift = Gauge(
            "timeshare_invariance_max_abs_diff",
            "The last drift probe: a sequence's logprobs alone against those its batch sampled",
            registry=r,
        )
        self.completion_tokens = Gauge(
            "timeshare_completion_tokens_mean",
            "The last step's mean completion length in tokens (each ends at its EOS or the limit)",
            registry=r,
        )
        self.truncated = Gauge(
            "timeshare_truncated_fraction",
            "The last step's share of completions cut at max_completion_tokens (no stop token)",
            registry=r,
        )
        self.padding_share = Gauge(
            "timeshare_padding_share",
            "The last step's share of TRAIN's laid-out tokens that were padding",
            registry=r,
        )
        self.reward = Gauge(
            "timeshare_reward_mean",
            "The last step's mean reward of the samples trained on",
            registry=r,
        )
        self.val_reward = Gauge(
            "timeshare_val_reward_mean",
            "The last validation's mean reward ([engine.task] val_every)",
            registry=r,
        )
        self.reward_skipped = Gauge(
            "timeshare_reward_skipped_fraction",
            "The last step's share of samples whose reward was skipped (out of the loss)",
            registry=r,
        )
        self.weights_match = Gauge(
            "timeshare_weights_match",
            "1 when every rollout held its trainer's weights at the last step's SYNC, else 0",
            registry=r,
        )
        self.weights_mismatches = Counter(
            "timeshare_weights_mismatch",
            "Steps whose SYNC left a rollout not holding its trainer's weights "
            "([checks] on_weights_mismatch: the run failed, or warned and went on)",
            registry=r,
        )
        self.loop_lag = Gauge(
            "timeshare_event_loop_lag_max_seconds",
            "The daemon's event loop: the longest a ready task waited",
            registry=r,
        )
        build = Info("timeshare_build", "Build of this daemon", registry=r)
        build.info({"version": version("timeshare"), "python": platform.python_version()})
        self.lifecycle.state(ServiceLifecycle.STARTING.value)

    def phase_ended(self, phase: Phase, seconds: float) -> None:
        self.phase_seconds.labels(phase.value).observe(seconds)

    def synced(self, nbytes: int, seconds: float, acks: list[float], version: int) -> None:
        self.sync_bytes.inc(nbytes)
        if seconds > 0:
            self.sync_gbps.set(gbps(nbytes, seconds))
        for ack in acks:
            self.ack_seconds.observe(ack)
        self.weight_version.set(version)

    def stepped(self, figures: StepFigures) -> None:
        """A step's figures, every rank's phases done (a figure the step lacks leaves its last)."""
        self.weights_checked(match=figures.weights_match)
        if figures.logprob_max_abs_diff is not None:
            self.logprob_diff.set(figures.logprob_max_abs_diff)
        if figures.invariance_max_abs_diff is not None:
            self.invariance_drift.set(figures.invariance_max_abs_diff)
        if figures.reward_mean is not None:
            self.reward.set(figures.reward_mean)
        if figures.val_reward_mean is not None:
            self.val_reward.set(figures.val_reward_mean)
        if figures.rewards is not None:
            self.reward_skipped.set(figures.rewards.skipped_fraction)
        if (lengths := figures.lengths) is not None:
            self.completion_tokens.set(lengths.completion_tokens_mean)
            self.truncated.set(lengths.truncated_fraction)
            self.padding_share.set(lengths.padding_share)

    def weights_checked(self, *, match: bool) -> None:
        self.weights_match.set(1 if match else 0)
        if not match:
            self.weights_mismatches.inc()

    def failed(self, kind: str) -> None:
        """A cycle failed with a cause of `kind` (its class's name)."""
        self.failures.labels(kind).inc()
        if kind == WeightsMismatch.__name__:  # the step's figures never come: its SYNC ended it
            self.weights_checked(match=False)
        if "Timeout" in kind or "Stalled" in kind:
            self.timeouts.labels(kind).inc()


@dataclass
class MetricsServer:
    """The HTTP endpoint; `port` is the one bound (useful when 0 asked for any free one)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)


def serve_metrics(metrics: Metrics, port: int) -> MetricsServer:
    """Serve `metrics` on the loopback interface (never on every interface)."""
    server, thread = _start_http_server(port, addr=LOOPBACK, registry=metrics.registry)
    return MetricsServer(server, thread)
