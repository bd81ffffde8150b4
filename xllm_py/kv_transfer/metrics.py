"""KV transfer metrics as plain thread-safe counters with Prometheus text rendering.

No prometheus_client dependency: the engine appends ``metrics.render()`` to its
``/metrics`` output. Families (label ``op`` = pull | push):

- ``xllm_kv_transfer_bytes_total``    counter
- ``xllm_kv_transfer_blocks_total``   counter
- ``xllm_kv_transfer_seconds``        histogram (successful transfers)
- ``xllm_kv_transfer_failures_total`` counter (label ``reason`` = invalid_argument | timeout | error)
"""
from __future__ import annotations

import bisect
import threading
from collections import defaultdict

DEFAULT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVTransferMetrics:
    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self.bytes_total: dict[str, int] = defaultdict(int)
        self.blocks_total: dict[str, int] = defaultdict(int)
        self.failures_total: dict[tuple[str, str], int] = defaultdict(int)
        self._hist_counts: dict[str, list[int]] = {}
        self._hist_sum: dict[str, float] = defaultdict(float)

    def observe_success(self, op: str, num_bytes: int, num_blocks: int, seconds: float) -> None:
        with self._lock:
            self.bytes_total[op] += num_bytes
            self.blocks_total[op] += num_blocks
            counts = self._hist_counts.setdefault(op, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._hist_sum[op] += seconds

    def observe_failure(self, op: str, reason: str) -> None:
        with self._lock:
            self.failures_total[(op, reason)] += 1

    def render(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        with self._lock:
            lines = ["# HELP xllm_kv_transfer_bytes_total Bytes of KV cache moved by successful transfers.",
                     "# TYPE xllm_kv_transfer_bytes_total counter"]
            lines += [f'xllm_kv_transfer_bytes_total{{op="{op}"}} {v}' for op, v in sorted(self.bytes_total.items())]
            lines += ["# HELP xllm_kv_transfer_blocks_total KV blocks moved by successful transfers.",
                      "# TYPE xllm_kv_transfer_blocks_total counter"]
            lines += [f'xllm_kv_transfer_blocks_total{{op="{op}"}} {v}' for op, v in sorted(self.blocks_total.items())]
            lines += ["# HELP xllm_kv_transfer_failures_total Failed KV transfers.",
                      "# TYPE xllm_kv_transfer_failures_total counter"]
            lines += [f'xllm_kv_transfer_failures_total{{op="{op}",reason="{r}"}} {v}'
                      for (op, r), v in sorted(self.failures_total.items())]
            lines += ["# HELP xllm_kv_transfer_seconds Duration of successful KV transfers.",
                      "# TYPE xllm_kv_transfer_seconds histogram"]
            for op, counts in sorted(self._hist_counts.items()):
                cum = 0
                for le, c in zip(self.buckets, counts):
                    cum += c
                    lines.append(f'xllm_kv_transfer_seconds_bucket{{op="{op}",le="{le}"}} {cum}')
                cum += counts[-1]
                lines.append(f'xllm_kv_transfer_seconds_bucket{{op="{op}",le="+Inf"}} {cum}')
                lines.append(f'xllm_kv_transfer_seconds_sum{{op="{op}"}} {self._hist_sum[op]}')
                lines.append(f'xllm_kv_transfer_seconds_count{{op="{op}"}} {cum}')
            return "\n".join(lines) + "\n"
