"""trainguard.agent.watchers."""
