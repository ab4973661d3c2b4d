"""The Furlong dashboard: host telemetry (CPU, memory, per-process RSS) exported for Prometheus."""
