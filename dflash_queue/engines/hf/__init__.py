"""The Transformers engines: generation (`generate`, `causal_lm`) and extraction in packed forward passes (`extract`, `packed_attention`, `probe`)."""
