"""Regenerate completions with a target model and extract its hidden states for drafter training."""

__version__ = "0.1.0"
