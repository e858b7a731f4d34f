"""On-storage formats: staged prompts, generated completions, training shards."""
