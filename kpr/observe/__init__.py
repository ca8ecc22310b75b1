"""Observability: Prometheus metrics, and the telemetry fed from each sync's result."""
