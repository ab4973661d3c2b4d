"""TCP ports: `free_port` and `check_port` live in `furlong.service_main.ports` (the dashboard, which
speaks no gRPC, needs them too); re-exported here for gRPC code."""

from furlong.service_main.ports import check_port, free_port

__all__ = ["check_port", "free_port"]
