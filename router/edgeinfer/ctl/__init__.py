"""``edgectl``: the operator's command line (compress checkpoints; more commands to come)."""
