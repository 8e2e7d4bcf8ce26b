"""trainguard.metrics."""
