"""Metric names the dashboard exports.

Two families: Furlong's own (`furlong_host_*`, `furlong_gpu_*`, base units, a `vendor` label on GPU
series) and dcgm-exporter-compatible `DCGM_FI_*` series (dcgm's units: percent, MiB, W, degrees C;
its labels `gpu`, `UUID`, `modelName`, `Hostname`) so dashboards built for dcgm-exporter work for
AMD GPUs too.
"""

HOST_CPU_UTILIZATION_RATIO = "furlong_host_cpu_utilization_ratio"
HOST_MEMORY_USED_BYTES = "furlong_host_memory_used_bytes"
HOST_MEMORY_TOTAL_BYTES = "furlong_host_memory_total_bytes"
HOST_PROCESS_RSS_BYTES = "furlong_host_process_rss_bytes"

GPU_UTILIZATION_RATIO = "furlong_gpu_utilization_ratio"
GPU_MEMORY_USED_BYTES = "furlong_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = "furlong_gpu_memory_total_bytes"
GPU_POWER_WATTS = "furlong_gpu_power_watts"
GPU_TEMPERATURE_CELSIUS = "furlong_gpu_temperature_celsius"
GPU_PROCESS_MEMORY_BYTES = "furlong_gpu_process_memory_bytes"
GPU_DEVICES = "furlong_gpu_devices"

DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"  # percent
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"  # MiB
DCGM_FB_FREE = "DCGM_FI_DEV_FB_FREE"  # MiB
DCGM_FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"  # MiB
DCGM_POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"  # W
DCGM_GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"  # degrees C

DCGM_LABELS = ("gpu", "UUID", "modelName", "Hostname")
GPU_LABELS = ("gpu", "uuid", "model_name", "vendor", "hostname")
