"""DFlash-family drafter folders: export to z-lab's and speculators' layouts and load back with
bit-identical draft logits (fp32), legacy drafters, and published folders for another target
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

import bench.registry as registry
from bench.core.errors import BenchError
from methods.dflash.formats import export_drafter, read_drafter
from methods.dflash.model import BlockConfig, BlockDraftModel, zlab_taps
from methods.dflash.training import export_model


def our_drafter(target, folder, method="dflash", seed=0, **kwargs):
    torch.manual_seed(seed)
    config = BlockConfig.for_target(target.config, zlab_taps(30, 2), num_layers=2, block_size=5, mask_token_id=16,
                                    **kwargs)
    model = BlockDraftModel(config)
    with torch.no_grad():
        if config.draft_vocab_size:
            model.draft_to_target.copy_(torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values)
        if config.markov_rank:
            model.markov_head.markov_w2.weight.normal_(std=0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not all ones: a swapped norm would show
    export_model(model, folder, {"method": method, "target": {
        "name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}})
    return folder


def draft_outputs(target, folder, method="dflash") -> dict[str, torch.Tensor]:
    """Everything a round computes from a fixed context: logits over the full vocabulary
    (draft ids mapped to target ids), Markov-corrected logits and confidence logits."""
    from types import SimpleNamespace

    from methods.dflash import load_model

    model, _ = load_model(target, method, SimpleNamespace(drafter=str(folder), dtype="float32"))
    c = model.config
    generator = torch.Generator().manual_seed(5)
    taps = [torch.randn(1, 9, c.hidden_size, generator=generator) for _ in c.taps]
    with torch.no_grad():
        kv = model.context_kv(model.context(taps), torch.arange(9)[None])
        x = model.block_inputs(torch.tensor([42]), target.engine.embed, c.block_size)
        hidden = model.forward_block(x, torch.arange(9, 9 + c.block_size)[None], kv)[0]
        logits = model.logits(hidden, target.engine.lm_head[model.draft_to_target])
        full = torch.full((c.block_size, c.vocab_size), -torch.inf).index_copy(1, model.draft_to_target, logits)
        out = {"logits": full}
        if c.markov_rank:
            state = model.markov_state(torch.tensor([42, 7, 9, 11, 13]))
            out["markov"] = model.markov_bias(state)[:, model.draft_to_target.argsort()]
            out["confidence"] = model.confidence_logit(hidden, state)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


CASES = {  # name: (method, BlockConfig options, formats it exports to, formats it refuses)
    "zlab": ("dflash", {}, ("dflash", "speculators"), ()),
    "draft-vocab": ("dflash", {"draft_vocab_size": 1000}, ("speculators",), ("dflash",)),
    "anchor": ("dflash", {"sample_from_anchor": True}, ("speculators",), ("dflash",)),
    "dspark": ("dspark", {"markov_rank": 8, "enable_confidence_head": True, "sample_from_anchor": True,
                          "draft_vocab_size": 1000}, ("speculators",), ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_then_load_gives_identical_draft_logits(case, default_target, tmp_path, one_thread):
    method, options, formats, refused = CASES[case]
    target = default_target
    folder = our_drafter(target, tmp_path / "ours", method, **options)
    expected = draft_outputs(target, folder, method)
    for fmt in formats:
        import importlib

        module = importlib.import_module(registry.get_method(method).module)
        assert fmt in module.EXPORT_FORMATS
        out = module.export(target, str(folder), fmt, tmp_path / fmt)
        assert_same(draft_outputs(target, out, method), expected)
        config, _, info = read_drafter(target, out, (method,))
        assert info["layout"] == ("z-lab" if fmt == "dflash" else "speculators")
        assert config.to_dict() | {"rope_scaling": None} == read_drafter(target, folder, (method,))[0].to_dict()
    for fmt in refused:
        with pytest.raises(BenchError, match="cannot say: export it with --format speculators"):
            export_drafter(target, folder, fmt, tmp_path / f"refused-{fmt}", (method,))
    if method == "dspark":
        from methods import dspark

        with pytest.raises(BenchError, match="dspark exports to speculators, not 'dflash'"):
            dspark.export(target, str(folder), "dflash", tmp_path / "x")
        with pytest.raises(BenchError, match="DSpark heads"):
            export_drafter(target, folder, "dflash", tmp_path / "y", ("dspark",))
        written = json.loads((tmp_path / "speculators" / "config.json").read_text())
        assert written["speculators_model_type"] == "dspark" and written["markov_rank"] == 8
        assert written["sample_from_anchor"] and written["confidence_head_with_markov"]
        assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # B drafts


def test_zlab_folders_old_and_new_config_placement(default_target, tmp_path, one_thread):
    target = default_target
    folder = our_drafter(target, tmp_path / "ours")
    new = export_drafter(target, folder, "dflash", tmp_path / "new", ("dflash",))
    config = json.loads((new / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == 30
    assert config["dflash_config"] == {"target_layer_ids": [1, 27], "mask_token_id": 16, "block_size": 5}
    old = tmp_path / "old"  # older z-lab folders: block_size, target_layer_ids, mask_token_id at the top level
    old.mkdir()
    (old / "model.safetensors").write_bytes((new / "model.safetensors").read_bytes())
    nested = config.pop("dflash_config")
    (old / "config.json").write_text(json.dumps({**config, "target_layer_ids": nested["target_layer_ids"],
                                                 "mask_token_id": nested["mask_token_id"]}))
    assert_same(draft_outputs(target, old), draft_outputs(target, folder))
    decoder = registry.build_decoder("ddtree", target, {"drafter": str(old), "dtype": "float32"})
    assert decoder.info["convention"] == "z-lab" and decoder.info["layout"] == "z-lab"


def edited(source, dest, change=None, files=None):
    dest.mkdir()
    (dest / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    config = json.loads((source / "config.json").read_text())
    if change:
        change(config)
    (dest / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (dest / name).write_text(text)
    return str(dest)


def test_a_published_folder_for_another_target_is_refused(default_target, tmp_path):
    target = default_target
    folder = our_drafter(target, tmp_path / "ours")
    zlab = export_drafter(target, folder, "dflash", tmp_path / "zlab", ("dflash",))
    spec = export_drafter(target, folder, "speculators", tmp_path / "spec", ("dflash",))
    cases = [
        (zlab, lambda c: c.update(num_target_layers=32), "target layer count 32; target 'smollm2-135m' has 30"),
        (zlab, lambda c: c.update(hidden_size=960), "hidden size 960"),
        (zlab, lambda c: c.update(vocab_size=32000), "vocabulary 32000"),
        (zlab, lambda c: c["dflash_config"].update(target_layer_ids=[1, 40]), "taps target layer 41"),
        (zlab, lambda c: c["dflash_config"].pop("mask_token_id"), "no mask_token_id"),
        (zlab, lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2"),
        (zlab, lambda c: c.update(architectures=["LlamaForCausalLM"]), "not a DFlash-family folder"),
        (zlab, lambda c: c.update(attention_bias=True), "attention biases"),
        (spec, lambda c: c["transformer_layer_config"].update(hidden_size=960), "hidden size 960"),
        (spec, lambda c: c.update(aux_hidden_state_layer_ids=[2, 31]), "taps target layer 31"),
        (spec, lambda c: c.update(speculators_model_type="eagle3"), "speculators 'eagle3' drafter"),
    ]
    for i, (source, change, message) in enumerate(cases):
        with pytest.raises(BenchError, match=message) as caught:
            registry.build_decoder("dflash", target, {"drafter": edited(source, tmp_path / f"case{i}", change)})
        assert "\n" not in str(caught.value)
    other_tokenizer = json.dumps({"model": {"vocab": {"hello": 0, "world": 1}}})
    with pytest.raises(BenchError, match="ships a tokenizer that differs"):
        registry.build_decoder("dflash", target, {"drafter": edited(zlab, tmp_path / "tok", files={
            "tokenizer.json": other_tokenizer})})


def test_legacy_drafters_load_as_their_config_says(default_target, tmp_path):
    """The shipped drafters predate the z-lab convention: their manifests lack the new fields,
    which means the old convention; they load, are recorded as legacy, and do not export."""
    from bench.core.drafters import find_drafter
    from methods.dflash.model import upgrade_legacy_names

    for method in ("dflash", "dspark"):
        folder = find_drafter(default_target.name, method)
        manifest = json.loads((folder / "drafter.json").read_text())
        if "qk_norm" in manifest["architecture"]:
            continue  # retrained under the z-lab convention
        config, state, info = read_drafter(default_target, folder, (method,))
        assert config.convention == "legacy" and config.sample_from_anchor and not config.qk_norm
        assert config.mask_token_id is None and "mask_embed" in state and info["drafts_per_block"] == 16
        with pytest.raises(BenchError, match="legacy convention .* retrain it"):
            export_drafter(default_target, folder, "speculators", tmp_path / method, (method,))
    renamed = upgrade_legacy_names({"context_norm": 1, "layers.3.q_proj.weight": 2, "layers.0.post_norm": 3,
                                    "markov_in.weight": 4, "confidence_head.bias": 5, "fc.weight": 6})
    assert renamed == {"hidden_norm.weight": 1, "layers.3.self_attn.q_proj.weight": 2,
                       "layers.0.post_attention_layernorm.weight": 3, "markov_head.markov_w1.weight": 4,
                       "confidence_head.proj.bias": 5, "fc.weight": 6}


def test_bench_export_and_list(default_target, tmp_path):
    from click.testing import CliRunner

    from bench.cli import main

    folder = our_drafter(default_target, tmp_path / "ours")
    runner = CliRunner()
    result = runner.invoke(main, ["export", "--method", "dflash", "--format", "dflash", "--out",
                                  str(tmp_path / "out"), "--drafter", str(folder)])
    assert result.exit_code == 0, result.output
    assert_same(draft_outputs(default_target, tmp_path / "out"), draft_outputs(default_target, folder))
    result = runner.invoke(main, ["export", "--method", "ddtree", "--format", "dflash", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "ddtree exports to no published format" in result.output
    listing = runner.invoke(main, ["list"]).output
    assert "convention: z-lab DFlash" in listing and "convention: DSpark paper" in listing
