"""Training shards: one safetensors file of many samples, concatenated along the token axis (written by
`training_writer`, sample by sample; read, and checked, by `reader.ShardIndex` alone).

Tensors:
  input_ids      int32  [T]         prompt ids followed by completion ids, per sample
  loss_mask      uint8  [T]         1 exactly on generated tokens (every regenerated turn)
  hidden_states  dtype  [T, K, H]   output of decoder layer `layer_ids[k]` at each token
  offsets        int64  [N + 1]     sample i spans tokens offsets[i]:offsets[i + 1]
  hidden_scales  fp32   [T, K]      only when dtype is fp8_e4m3: states = fp8 * scale (see fp8.py)

Metadata (all strings, JSON where structured) says what the tensors mean: target model, layer ids and their
convention, what each captured entry is (`layer_states`: "decoder_output", the residual stream after decoder
layer i before any norm; "last_layer", the same for the last decoder layer, stored as the verifier's last state;
or "final_norm", the last layer after the model's final norm, which is Transformers' last `hidden_states`
entry), how the states were computed (`extraction`: "packed" or "padded") and the canary's
check of them (`canary`: samples recomputed alone and their relative error per layer), dtype, sample ids (a
sample stored as one sequence per regenerated turn has one row per turn, and `sample_turns` says which),
finish reasons, versions, and the quality gate's word per sample (`quality`:
flags, answer tokens, thinking state, so that training can filter flagged samples) and on the samples it
dropped (`dropped`: id and failed checks; they are not in the tensors). A shard whose samples were all dropped
holds no tokens.

This module names the format; it imports nothing of the package, so that the writer and the reader both build
on it.
"""

from __future__ import annotations

FORMAT = "dflash-queue/hidden-states"
FORMAT_VERSION = "1"
# "Layer i" is the output of decoder layer i (before the final norm): Transformers' hidden_states[i + 1].
LAYER_CONVENTION = "decoder_layer_output"
HF_HIDDEN_STATES_INDEX = "layer_id + 1"
# What a captured entry is: the residual stream after its decoder layer (a layer the drafter conditions on); the
# last decoder layer's output before the final norm, stored as the verifier's last state (vLLM's aux layer N: what
# speculators' trainers normalise themselves); or the last layer after the final norm (Transformers' last
# hidden_states entry: what SpecForge's EAGLE-3 trainer takes as the target's hidden state).
DECODER_OUTPUT = "decoder_output"
LAST_LAYER = "last_layer"
FINAL_NORM = "final_norm"
LAYER_STATES = (DECODER_OUTPUT, LAST_LAYER, FINAL_NORM)
