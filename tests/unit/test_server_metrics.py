"""A fresh server's /metrics: every counter and histogram whose labels are known exists at
0 from start-up, as vLLM's do. Prometheus takes a series' first sample as its baseline, so
a series that appeared with its first event hid that event from increase() and rate(): a
fresh server's first burst of 503s read as no rejections at all (fuzz48)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.errors import ServerOverloaded
from engine.protocol import FinishReason
from server.admission import FeatureRequestsOverloaded, ServerDraining
from server.metric_names import KNOWN_LABEL_VALUES, METRICS, MODEL_LABEL
from server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render()[0].decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_series_with_known_labels_starts_at_zero():
    samples = _samples(ServerMetrics("m"))
    model = (MODEL_LABEL, "m")
    for spec in METRICS:
        if spec.type == "gauge" or spec.name == "tessera:api_server_cpu_seconds_total":
            continue  # the CPU counter counts itself at each scrape
        first = f"{spec.name}_count" if spec.type == "histogram" else spec.name
        label_sets = [(model,)] if spec.labels == (MODEL_LABEL,) else []
        label_sets += [
            tuple(sorted((model, (spec.labels[1], value))))
            for value in KNOWN_LABEL_VALUES.get(spec.name, ())
        ]
        for labels in label_sets:
            assert samples[(first, labels)] == 0, (spec.name, labels)


def test_the_known_label_values_are_the_ones_the_server_counts():
    finish_reasons = {reason.value for reason in FinishReason} - {"error"}  # errors: a 5xx
    assert set(KNOWN_LABEL_VALUES["tessera:request_success_total"]) == finish_reasons
    assert set(KNOWN_LABEL_VALUES["tessera:requests_rejected_total"]) == {
        ServerOverloaded.reason, FeatureRequestsOverloaded.reason, ServerDraining.reason}  # fmt: skip
