"""Server-info aggregation of the DP ranks' stats into one dict."""

from __future__ import annotations

from typing import Sequence

# the same setting on every rank: reported once
_SHARED_STATS = {"page_size", "kv_bytes_per_token"}
# The KV cache's size (model_executor/memory_report.report_kv_capacity), which /get_server_info
# also reports beside the server args: capacities summed over DP ranks.
KV_CAPACITY_STATS = ("kv_bytes_per_token", "kv_capacity_tokens", "kv_capacity_requests")


def aggregate_stats(per_rank: Sequence[dict]) -> dict:
    """All ranks' stats in one dict: numbers summed (counters and capacities; step counts such
    as dp_breakable_steps then count rank-steps), dicts merged the same way, seconds (*_seconds and
    the values of *_seconds_by_bucket) as the max (ranks capture in parallel), anything else
    kept when every rank agrees, else listed."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    out = {}
    for key in dict.fromkeys(k for s in per_rank for k in s):
        values = [s[key] for s in per_rank if key in s]
        out[key] = _merge(key, values)
    if "prefix_cache_hit_rate" in out:  # a rate of the summed counts, not a sum of rates
        looked = out.get("prefix_cache_lookup_tokens", 0)
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0) / looked if looked else 0.0
    return out


def _merge(key: str, values: list, seconds: bool = False):
    seconds = seconds or "_seconds" in key
    if key in _SHARED_STATS or not values:
        return values[0] if values else None
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return max(values) if seconds else sum(values)
    if all(isinstance(v, dict) for v in values):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _merge(k, [v[k] for v in values if k in v], seconds) for k in keys}
    return values[0] if all(v == values[0] for v in values) else list(values)
