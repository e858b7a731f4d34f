"""How each architecture is extracted (packed, padded) or refused, from its config, the same in the engine, in
`doctor` and in a worker that refuses to start."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, BertConfig, BertForMaskedLM, T5Config

from dflash_queue.doctor.model import check_architecture, check_model
from dflash_queue.engines.architecture import profile_config
from dflash_queue.engines.hf.extract import HiddenStateExtractor
from dflash_queue.errors import UnsupportedArchitecture


@pytest.mark.parametrize(
    ("name", "mode", "features", "reference"),
    [
        ("qwen3", "packed", {}, "sdpa"),
        ("qwen3_moe", "packed", {"MoE": "4 experts"}, "sdpa"),
        ("qwen3_5", "packed", {"linear attention": "4 layers"}, "sdpa"),
        ("qwen3_next", "packed", {"linear attention": "4 layers", "MoE": "4 experts"}, "sdpa"),
        ("mistral", "packed", {"sliding window": "16"}, "sdpa"),
        ("gemma3", "packed", {"sliding window": "16"}, "sdpa"),
        ("gemma2", "packed", {"sliding window": "16", "softcap": "5"}, "eager"),
        ("gpt_oss", "packed", {"sliding window": "16", "sinks": "per head", "MoE": "4 experts"}, "eager"),
        ("lfm2", "padded", {}, "sdpa"),
        ("deepseek_v3", "packed", {"MoE": "8 experts"}, "sdpa"),
        ("qwen3_vl", "packed", {}, "sdpa"),
        ("qwen3_5_moe", "packed", {"linear attention": "4 layers", "MoE": "4 experts"}, "sdpa"),
        ("bamba", "padded", {"linear attention": "4 layers", "state-space chunk": "16"}, "sdpa"),
    ],
)
def test_each_family_gets_its_mode_features_and_reference_attention(tiny_family, name, mode, features, reference):
    profile = profile_config(AutoConfig.from_pretrained(tiny_family(name)))
    assert (profile.mode, profile.features, profile.reference_attention, profile.refusal) == (
        mode, features, reference, ""
    )
    assert profile.num_layers == 6 and profile.hidden_size == 64


def test_a_multimodal_checkpoint_is_described_by_its_text_decoder(tiny_family):
    profile = profile_config(AutoConfig.from_pretrained(tiny_family("qwen3_5")))
    assert profile.multimodal and (profile.model_type, profile.text_model_type) == ("qwen3_5", "qwen3_5_text")
    assert profile.describe() == (
        "qwen3_5 (text decoder qwen3_5_text): 6 layers (4 linear_attention, 2 full_attention), hidden 64; "
        "linear attention 4 layers; extraction packed"
    )


def test_layer_types_without_a_packed_implementation_run_padded_or_are_refused_when_packing_is_demanded(tiny_family):
    config = AutoConfig.from_pretrained(tiny_family("lfm2"))
    assert "layer types ['conv'] have no packed implementation" in profile_config(config).describe()
    demanded = profile_config(config, packing="packed")
    assert demanded.refusal == "extract.packing = 'packed' but layer types ['conv'] have no packed implementation"
    forced = profile_config(AutoConfig.from_pretrained(tiny_family("qwen3")), packing="padded")
    assert (forced.mode, forced.why_padded) == ("padded", "extract.packing = 'padded'")


def test_linear_attention_of_an_unknown_model_runs_padded(tiny_family):
    config = AutoConfig.from_pretrained(tiny_family("qwen3_next"))
    config.model_type = "kimi_linear"
    profile = profile_config(config)
    assert profile.mode == "padded"
    assert profile.why_padded == "the linear-attention layers of kimi_linear have no per-sequence packed implementation"


def test_an_unproven_model_type_declaring_another_token_mixer_runs_padded(tiny_family):
    """A model type the conformance suite does not prove, whose layer types say attention only but whose config
    declares a state space: padded, naming the settings; without them it may be packed (after the probe)."""
    config = AutoConfig.from_pretrained(tiny_family("qwen3"))
    config.model_type = "new_hybrid"
    assert profile_config(config).mode == "packed"
    config.mamba_d_state = 16
    profile = profile_config(config)
    assert profile.mode == "padded"
    assert profile.why_padded == "new_hybrid is not proven packed and its config declares other token mixers " \
        "(mamba_d_state)"
    config.model_type = "qwen3"  # a proven type is judged by its layer types
    assert profile_config(config).mode == "packed"


@pytest.mark.parametrize("proven", [True, False])
def test_an_unproven_model_type_is_packed_only_when_the_probe_reaches_past_its_window(tiny_family, caplog, proven):
    """Mistral's window is 16 tokens; with 12 positions the probe cannot run a sequence past it. Mistral itself is
    proven packed; the same model under a model type the suite does not prove runs padded."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_family("mistral"), dtype=torch.float32)
    model.config.max_position_embeddings = 12
    if not proven:
        model.config.model_type = "new_windowed"
    with caplog.at_level("INFO"):
        extractor = HiddenStateExtractor.from_model(model, layer_ids=(1, 3))
    assert extractor.mode == ("packed" if proven else "padded")
    assert ("the probe's 11 tokens cannot reach past its mixers' span of 16 tokens" in caplog.text) != proven


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (T5Config(num_layers=2), "an encoder-decoder model has no causal decoder states"),
        (BertConfig(architectures=["BertForMaskedLM"]), "an encoder (BertForMaskedLM), not a causal decoder"),
    ],
)
def test_models_without_causal_decoder_states_are_refused(config, why):
    assert why in profile_config(config).refusal


def test_sinks_under_flash_attention_are_refused(tiny_family):
    config = AutoConfig.from_pretrained(tiny_family("gpt_oss"))
    assert "flash_attention_2 has no attention sinks" in profile_config(config, attn_implementation="flash_attention_2").refusal


@pytest.fixture(scope="module")
def bert_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(path)
    return path


def test_the_engine_and_doctor_refuse_an_encoder_before_any_work(bert_checkpoint, make_config):
    with pytest.raises(UnsupportedArchitecture, match="cannot extract exact hidden states of bert: .* an encoder"):
        HiddenStateExtractor(str(bert_checkpoint), layer_ids=(0, 1), device="cpu", dtype="float32")
    config = make_config("bert.toml", model={"path": str(bert_checkpoint)})
    checks, _ = check_model(config.model, config.extract)
    [architecture] = [c for c in checks if c.name == "architecture"]
    assert architecture.verdict == "fail" and "refused: an encoder (BertForMaskedLM)" in architecture.detail


def test_an_extract_worker_with_an_unsupported_model_exits_at_start_naming_it(bert_checkpoint, make_config, start_worker):
    config = make_config("bert.toml", model={"path": str(bert_checkpoint)})
    with pytest.raises(RuntimeError, match="extract worker exited") as failed:
        start_worker(config, "extract")
    assert "cannot extract exact hidden states of bert" in str(failed.value)
    assert "an encoder (BertForMaskedLM), not a causal decoder" in str(failed.value)


def test_doctor_says_how_each_family_is_extracted(tiny_family, make_config):
    config = make_config("q35.toml", model={"path": str(tiny_family("qwen3_5"))})
    check = check_architecture(AutoConfig.from_pretrained(tiny_family("qwen3_5")), config.extract)
    assert check.verdict == "pass" and check.detail.endswith("extraction packed")


def test_the_probe_falls_back_to_padded_batches_when_packing_is_not_exact(tiny_family, caplog, monkeypatch):
    """A model whose packed path leaks between sequences (its windows ignored here) is caught at load."""
    from transformers import AutoModel

    from dflash_queue.engines.hf import packed_attention as packed_attention

    original = packed_attention.packed_attention
    monkeypatch.setattr(
        packed_attention, "packed_attention", lambda *a, sliding_window=None, **k: original(*a, **k)
    )
    from transformers import AttentionInterface

    AttentionInterface.register(packed_attention.PACKED_ATTENTION, packed_attention.packed_attention)
    try:
        model = AutoModel.from_pretrained(tiny_family("mistral"), dtype=torch.float32)
        with caplog.at_level("INFO"):
            extractor = HiddenStateExtractor.from_model(model, layer_ids=(1, 3))
    finally:
        AttentionInterface.register(packed_attention.PACKED_ATTENTION, original)
    assert extractor.mode == "padded"
    # The window reaches the probe's first sequence too: its difference alone is beyond rounding, so no tolerance is
    # calibrated from it.
    assert "packed sequences (per-sequence attention) is not exact (probe: a sequence first in its pass differs from " \
        "it alone by" in caplog.text
    assert "padded batches (packing was not exact), sdpa attention (probe of 70/9/21 tokens: max relative error" \
        in caplog.text


def test_the_shipped_h200_config_runs_the_27b_class_hybrid_packed_on_the_dflash_layers(tmp_path):
    """worker_configs/qwen3.6-27b-h200.toml against the architecture of its target (examples/qwen3.6-27b-class:
    the config alone, no weights)."""
    from pathlib import Path

    from dflash_queue.config import load_config
    from dflash_queue.engines.layers import resolve_layer_ids

    repo = Path(__file__).resolve().parents[2]
    text = (repo / "worker_configs" / "qwen3.6-27b-h200.toml").read_text()
    target = repo / "examples" / "qwen3.6-27b-class"
    local = tmp_path / "h200.toml"
    local.write_text(text.replace('path = "/models/Qwen3.6-27B"', f'path = "{target}"'))
    config = load_config(local, env={})
    model_config = AutoConfig.from_pretrained(target)
    text_config = model_config.get_text_config()
    layer_ids = resolve_layer_ids(config.extract.layer_ids, text_config.num_hidden_layers, config.extract.num_draft_layers)
    assert layer_ids == [1, 16, 31, 46, 61]
    check = check_architecture(model_config, config.extract)
    assert check.verdict == "pass"
    assert check.detail == (
        "qwen3_5 (text decoder qwen3_5_text): 64 layers (48 linear_attention, 16 full_attention), hidden 5120; "
        "linear attention 48 layers; extraction packed"
    )
