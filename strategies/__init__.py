"""trainguard.strategies."""
