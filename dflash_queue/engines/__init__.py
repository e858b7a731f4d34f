"""Model engines: generation (regenerate replies) and extraction (capture hidden states)."""
