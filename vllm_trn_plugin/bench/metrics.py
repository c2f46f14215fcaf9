"""A server's Prometheus `/metrics`, read with prometheus_client's parser.

vLLM labels each series by engine (and model, finish reason, ...); the readers here add the series up over
the labels they do not ask for, so a server with several engines reads as one.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Metrics:
    """The samples of one scrape. Sample names are as exposed: a counter's carry `_total`, a histogram's
    `_sum`, `_count` and `_bucket`."""

    def __init__(self, text: str) -> None:
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def total(self, name: str) -> float:
        """The sum of every series of sample `name` (0 when there is none)."""
        return sum(s.value for s in self.samples if s.name == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sample `name` summed per value of `label`."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


def scrape(base_url: str, timeout: float = 30.0) -> Metrics:
    """GET {base_url}/metrics."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return Metrics(r.read().decode())
