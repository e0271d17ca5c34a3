"""Ingest: find per-rank trace files, parse each once into a columnar table."""
from diagnose.ingest.discover import discover_traces
from diagnose.ingest.load import RankTrace, load_trace

__all__ = ["discover_traces", "load_trace", "RankTrace"]
