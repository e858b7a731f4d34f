"""The recipes of docs/output-format.md, one per trainer and method, run as written.

For the target they are written for (the Qwen3.6-27B class, examples/qwen3.6-27b-class): the worker config with
the recipe's [extract] table stores what the export needs, and the trainer's command gives the layers the export
names. On the tiny Qwen3 family: the recipe's export command on real shards, then the trainer's own command
(speculators' train command, SpecForge's config validation and offline loader) with the paths and layer ids of
the tiny model put in.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.config import load_config
from dflash_queue.exports import export_format
from dflash_queue.exports.formats import StoredLayers
from dfq_testing.configs import to_toml
from dfq_testing.peers import run_speculators_train

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "output-format.md"
TARGET = REPO / "examples" / "qwen3.6-27b-class"
RECIPES = {
    "speculators, DFlash": ("speculators", "dflash"),
    "speculators, EAGLE-3": ("speculators", "eagle3"),
    "SpecForge, DFlash": ("specforge", "dflash"),
    "SpecForge, EAGLE-3": ("specforge", "eagle3"),
}
pytestmark = pytest.mark.slow


def recipe(title: str) -> dict[str, str]:
    """The code blocks of a recipe's section: {"toml": ..., "bash": ..., "yaml": ...}."""
    text = DOC.read_text()
    section = text.split(f"##### {title}\n", 1)[1].split("\n#####", 1)[0].split("\n### ", 1)[0]
    return {kind: body for kind, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S)}


def command(bash: str, program: str) -> list[str]:
    (line,) = [line for line in bash.splitlines() if line.startswith(program)]
    return shlex.split(line)


def option(words: list[str], name: str) -> list[str]:
    """The values after `name`, up to the next option."""
    start = words.index(name) + 1
    end = next((i for i in range(start, len(words)) if words[i].startswith("--")), len(words))
    return words[start:end]


def value(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def replaced(words: list[str], name: str, values: list[str]) -> list[str]:
    start = words.index(name) + 1
    return words[:start] + values + words[start + len(option(words, name)):]


def test_every_trainer_and_method_has_a_recipe():
    text = DOC.read_text()
    assert sorted(re.findall(r"^##### (.+)$", text, re.M)) == sorted(RECIPES)


@pytest.mark.parametrize("title", list(RECIPES))
def test_the_recipe_fits_the_target_it_is_written_for(title, tmp_path):
    name, method = RECIPES[title]
    blocks = recipe(title)
    shipped = tomllib.loads((REPO / "worker_configs" / "qwen3.6-27b-h200.toml").read_text())
    shipped["model"]["path"] = str(TARGET)
    shipped["extract"] = {**{k: v for k, v in shipped["extract"].items() if k in ("hidden_dtype",)},
                          **tomllib.loads(blocks["toml"])["extract"]}
    path = tmp_path / "config.toml"
    path.write_text(to_toml(shipped))
    config = load_config(path, env={})
    entries = config.extract.captured_entries(64)
    layers = StoredLayers(tuple(layer for layer, _ in entries), tuple(kind for _, kind in entries), 64)
    selection = export_format(name, method).select(layers)  # refuses when the config does not store what it needs

    export = command(blocks["bash"], "dflash-queue export")
    assert value(export, "--format") == name and value(export, "--method") == method
    if name == "speculators":
        from speculators.train.config.resolution import build_parser

        train = command(blocks["bash"], "speculators train")
        parsed = build_parser().parse_args(train[2:])  # speculators' own parser: an unknown flag exits
        assert parsed.speculator_type == method and parsed.on_missing == "raise"
        assert parsed.target_layer_ids == list(selection.trainer_layer_ids)
        assert parsed.data_path == export[-1]
        # The exported vocabulary is used: its counts, and the draft vocabulary size without which they are ignored.
        assert parsed.token_freq_path == f"{export[-1]}/token_freq.pt" and parsed.draft_vocab_size > 0
    else:
        from specforge.modeling.draft.dflash import build_target_layer_ids

        run = yaml.safe_load(blocks["yaml"])
        assert run["training"]["strategy"] == method and run["data"]["hidden_states_path"] == export[-1]
        if method == "dflash":
            derived = build_target_layer_ids(64, run["model"]["draft_num_hidden_layers"])
            assert derived == list(selection.trainer_layer_ids)
        else:
            assert run["model"]["aux_hidden_state_layer_ids"] == list(selection.trainer_layer_ids)


@pytest.mark.parametrize("title", list(RECIPES))
def test_the_recipe_runs_on_real_shards_through_the_trainers_own_code(
    title, peer_shards, tiny_family, tmp_path, monkeypatch
):
    name, method = RECIPES[title]
    blocks = recipe(title)
    out = tmp_path / "export"
    export = command(blocks["bash"], "dflash-queue export")
    export[export.index("export") + 1] = peer_shards["bfloat16"].storage.url
    export[-1] = str(out)
    result = CliRunner().invoke(main, export[1:])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "export.json").read_text())
    ids = [str(i) for i in manifest["layer_ids"]]
    verifier = tiny_family("qwen3")

    if name == "speculators":
        train = command(blocks["bash"], "speculators train")[2:]
        # The recipe passes every argument the export names.
        flags = [word for word in manifest["trainer"]["arguments"] if word.startswith("--")]
        assert "--token-freq-path" in flags and "--draft-vocab-size" in flags and set(flags) <= set(train)
        assert manifest["trainer"]["arguments"][:2] == train[train.index("--speculator-type"):][:2]
        train = replaced(train, "--verifier-name-or-path", [str(verifier)])
        train = replaced(train, "--data-path", [str(out)])
        train = replaced(train, "--target-layer-ids", ids)
        train = replaced(train, "--save-path", [str(tmp_path / "save")])
        # The exported token counts, and a draft vocabulary below the tiny model's, chosen among counted tokens.
        frequencies = torch.load(out / "token_freq.pt", weights_only=True)
        size = min(64, len(frequencies) // 2)
        train = replaced(train, "--token-freq-path", [str(out / "token_freq.pt")])
        train = replaced(train, "--draft-vocab-size", [str(size)])
        built = run_speculators_train(train, monkeypatch)
        assert len(built["train"].dataset) + len(built["val"].dataset) == manifest["num_samples"]
        assert built["loss"] == built["loss"]  # a number: the draft trained on the recipe's data
        # The draft predicts over the `size` tokens the export counted most.
        most = sorted(frequencies, key=lambda token: (-frequencies[token], token))[:size]
        assert built["model"].t2d.nonzero().flatten().tolist() == sorted(most)
        assert (out / f"d2t-{size}.npy").is_file()
        return

    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.application.planning import validate_resolved_run
    from specforge.config import load_config as load_specforge_config

    run = yaml.safe_load(blocks["yaml"])
    run["model"]["target_model_path"] = str(verifier)
    run["data"]["hidden_states_path"] = str(out)
    if method == "dflash":
        run["model"]["draft_num_hidden_layers"] = len(ids)  # the tiny model's DFlash layers [1, 2, 3]: K = 3
    else:
        run["model"]["aux_hidden_state_layer_ids"] = [int(i) for i in ids]
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(run))
    # The recipe's command as SpecForge's own command line reads it, up to its launch plan (training needs a GPU).
    from specforge.cli import main as specforge

    words = command(blocks["bash"], "specforge train")[1:]
    words[words.index("--config") + 1] = str(path)
    assert specforge([*words, "--plan"]) == 0
    config = load_specforge_config(str(path))
    algorithm = builtin_algorithm_registry().resolve(config.training.strategy)
    validate_resolved_run(config, algorithm)
    provider = algorithm.providers.offline_for(config.model.input_modality)
    refs = provider.build_reader(
        config.data.hidden_states_path, run_id="recipe", ttt_length=config.training.ttt_length,
        max_len=config.data.max_length,
    ).read()
    normalize = provider.build_normalizer(config.data.max_length, ttt_length=config.training.ttt_length,
                                          use_usp_preprocess=False)
    for ref in refs:
        normalize(torch.load(Path(ref.feature_store_uri.removeprefix("file://")), weights_only=True))
    assert len(refs) == manifest["num_samples"]
