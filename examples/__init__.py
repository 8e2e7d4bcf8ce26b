"""trainguard.examples."""
