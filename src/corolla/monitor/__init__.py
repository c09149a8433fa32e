"""The swarm monitor: a live web page, its JSON and Prometheus metrics, read straight from the DHT and the servers."""

from corolla.monitor.config import MonitorConfig

__all__ = ["MonitorConfig"]
