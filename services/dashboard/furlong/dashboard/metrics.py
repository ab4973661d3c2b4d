"""Metric names the dashboard exports (Prometheus conventions, units in the name)."""

HOST_CPU_UTILIZATION_RATIO = "furlong_host_cpu_utilization_ratio"
HOST_MEMORY_USED_BYTES = "furlong_host_memory_used_bytes"
HOST_MEMORY_TOTAL_BYTES = "furlong_host_memory_total_bytes"
HOST_PROCESS_RSS_BYTES = "furlong_host_process_rss_bytes"
