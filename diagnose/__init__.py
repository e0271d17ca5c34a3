"""diagnose: why is this distributed PyTorch job slow?

Pipeline (one way): ingest (per-rank traces -> Run) -> timeline (per-rank lanes,
steps, collectives) -> analyzers (the checklist, in the field's order) -> ranking
-> Diagnosis -> reports. Nothing here imports torch.
"""
__version__ = "0.1.0"
