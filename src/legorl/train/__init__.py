"""Training: advantages, losses, sequence building, the trainer.

Kept import-light on purpose: `sequences` and `advantages` need no torch, so the
orchestrator and the dashboard can use them without paying for a torch import.
"""
