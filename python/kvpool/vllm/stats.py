"""The connector's telemetry in vLLM's own metrics: one record per pool operation (``lookup`` on the
scheduler side, ``load`` and ``save`` on the workers), summed by vLLM's periodic log line
(``KV Transfer metrics: ...``) and exported to Prometheus as ``vllm:kvpool_*`` series.

Besides these, each side can write cumulative counters to a JSON file (``stats_path``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# Records kept per interval and operation: vLLM collects every step, so this only bounds an
# interval in which nobody collects.
MAX_RECORDS = 4096


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(q * len(v) + 0.5) - 1))]


@dataclass
class KVPoolConnectorStats(KVConnectorStats):
    """``data[operation]`` is a list of records ``{seconds, blocks, bytes, failed, hit}``: for
    ``lookup``, ``blocks`` asked and ``hit`` found; for ``load``/``save``, blocks moved and
    bytes, ``failed`` blocks that could not be moved (a save the pool refused counts as failed;
    one it already held does not)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[dict[str, float]]] = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def record(self, op: str, seconds: float, blocks: int, nbytes: int = 0, failed: int = 0, hit: int = 0) -> None:
        rows = self.data.setdefault(op, [])
        if len(rows) < MAX_RECORDS:
            rows.append({"seconds": seconds, "blocks": blocks, "bytes": nbytes, "failed": failed, "hit": hit})

    def aggregate(self, other: KVConnectorStats) -> "KVPoolConnectorStats":
        for op, rows in (other.data or {}).items():
            self.data.setdefault(op, []).extend(rows)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for op, rows in sorted(self.data.items()):
            if not rows:
                continue
            ms = [float(r["seconds"]) * 1e3 for r in rows]
            out[f"kvpool_{op}_count"] = len(rows)
            out[f"kvpool_{op}_p50_ms"] = round(_percentile(ms, 0.5), 3)
            out[f"kvpool_{op}_p99_ms"] = round(_percentile(ms, 0.99), 3)
            out[f"kvpool_{op}_blocks"] = int(sum(r["blocks"] for r in rows))
            if op == "lookup":
                out["kvpool_lookup_hit_blocks"] = int(sum(r["hit"] for r in rows))
            else:
                out[f"kvpool_{op}_bytes"] = int(sum(r["bytes"] for r in rows))
                out[f"kvpool_{op}_failed_blocks"] = int(sum(r["failed"] for r in rows))
        return out


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpool_operation_seconds`` (histogram), ``vllm:kvpool_blocks_total``,
    ``vllm:kvpool_bytes_total``, ``vllm:kvpool_failed_blocks_total`` and
    ``vllm:kvpool_lookup_hit_blocks_total``, by operation."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = labelnames + ["operation"]
        self._time = self._histogram_cls(
            name="vllm:kvpool_operation_seconds",
            documentation="Time of kvpool connector operations (lookup, load, save).",
            buckets=[1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0],
            labelnames=names,
        )
        self._blocks = self._counter_cls(
            name="vllm:kvpool_blocks_total", documentation="Blocks asked (lookup) or moved.", labelnames=names
        )
        self._bytes = self._counter_cls(
            name="vllm:kvpool_bytes_total", documentation="Bytes moved.", labelnames=names
        )
        self._failed = self._counter_cls(
            name="vllm:kvpool_failed_blocks_total", documentation="Blocks that could not be moved.", labelnames=names
        )
        self._hit = self._counter_cls(
            name="vllm:kvpool_lookup_hit_blocks_total",
            documentation="Blocks lookups found in the pool.",
            labelnames=labelnames,
        )
        self._cache: dict[tuple[int, str], tuple[Any, Any, Any, Any]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for op, rows in (transfer_stats_data or {}).items():
            key = (engine_idx, op)
            if key not in self._cache:
                labels = self.per_engine_labelvalues[engine_idx] + [op]
                self._cache[key] = (
                    self._time.labels(*labels),
                    self._blocks.labels(*labels),
                    self._bytes.labels(*labels),
                    self._failed.labels(*labels),
                )
            t, b, n, f = self._cache[key]
            for r in rows:
                t.observe(float(r["seconds"]))
                b.inc(int(r["blocks"]))
                n.inc(int(r["bytes"]))
                f.inc(int(r["failed"]))
                if op == "lookup" and r["hit"]:
                    self._hit.labels(*self.per_engine_labelvalues[engine_idx]).inc(int(r["hit"]))


def take(side: Any) -> Optional[KVPoolConnectorStats]:
    """A side's (scheduler's or worker's) figures since the last call, under its lock; a fresh
    collection takes their place."""
    with side.lock:
        if side.stats.is_empty():
            return None
        s, side.stats = side.stats, KVPoolConnectorStats()
    return s


def dump(path: Optional[str], side: str, counters: dict[str, Any]) -> None:
    """Write a side's cumulative counters to ``<path>.<side>.json`` (atomically), when asked to."""
    if not path:
        return
    target = f"{path}.{side}.json"
    # Per thread: loads and saves of several threads write at once.
    tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(counters, f)
    os.replace(tmp, target)
