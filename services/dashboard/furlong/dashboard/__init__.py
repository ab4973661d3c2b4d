"""The Furlong dashboard: GPU (NVML, AMD SMI) and host telemetry for Prometheus, and a web UI."""
