"""Human-facing reports rendered from diagnosis.json (see `reports.html`)."""
