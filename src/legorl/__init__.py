"""legorl: RL for LLM coding agents inside the harnesses people already use."""

__version__ = "0.1.0"
