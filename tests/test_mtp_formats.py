"""MTP conventions and published layouts: DeepSeek-V3's fuse order by default and the legacy
one as a named option, the speculators export read back bit for bit, the DeepSeek-V3 /
Qwen3-Next / MiMo key layouts, `bench run` / `bench export` on them, and one-line refusals
of folders made for another target (tiny random targets throughout)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from sps_helpers import load_tiny_target, make_tiny_target_folder

from bench.cli import main
from bench.core.decode import DecodeConfig, DecodeState, Drafter, decode
from bench.core.drafters import MANIFEST, WEIGHTS
from bench.core.engine import rms_norm
from bench.core.errors import BenchError
from methods import mtp
from methods.mtp import CONVENTION, EXPORT_FORMATS, build
from methods.mtp.drafter import SequentialDrafter, make_drafter
from methods.mtp.layouts import DEEPSEEK, MIMO, QWEN3_NEXT, SPECULATORS, swap_halves, to_layout
from methods.mtp.model import FUSE_ORDERS, LayerShape
from methods.mtp.store import FORMAT, load_model
from methods.mtp.training import MtpSettings, init_model
from tasks import task_name

PROMPT = [1, 504, 3213, 28, 1790, 77, 9, 4000]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


def random_module(target, fuse_order: str = "embedding_first", seed: int = 0):
    torch.manual_seed(seed)
    model = init_model(target, MtpSettings(fuse_order=fuse_order, init="random"))
    with torch.no_grad():  # norms away from 1, so a swapped norm or half would show
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.3 * torch.randn_like(param))
    return model


def save_ours(folder, target, model, fuse_order: str | None = "embedding_first", **changes):
    """Our drafter folder (bf16 weights, drafter.json); fuse_order None: the field left out."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()},
              str(folder / WEIGHTS))
    manifest = {"format": FORMAT, "method": "mtp", "variant": "sequential", "tap": target.engine.num_layers,
                "architecture": dict(vars(LayerShape.of(target.engine)), kind="sequential"), "weights": WEIGHTS,
                "target": {"name": target.name, "fingerprint": target.fingerprint,
                           "vocab_size": target.config.vocab_size}, **changes}
    if fuse_order is not None:
        manifest["fuse_order"] = fuse_order
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def draft_logits(target, model, manifest, depth: int = 4) -> tuple[list[int], list[torch.Tensor]]:
    """One fp32 proposal from the end of PROMPT: the chain and the logits of every step."""
    logits = []

    class Recording(SequentialDrafter):
        def _choose(self, normed, state, step):
            logits.append(F.linear(normed, self.lm_head).float())
            return super()._choose(normed, state, step)

    drafter = make_drafter(target, model, manifest, depth, dtype=torch.float32)
    drafter.__class__ = Recording
    L = target.engine.num_layers
    prefill = target.engine.prefill(torch.tensor(PROMPT[:-1]), taps=(L,))
    state = DecodeState(tokens=list(PROMPT), prompt_len=len(PROMPT) - 1, engine=target.engine,
                        config=DecodeConfig(max_new_tokens=64), generator=None)
    drafter.begin(state, prefill)
    return drafter.propose(state).tokens, logits


def one_line(call, match: str) -> None:
    with pytest.raises(BenchError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------ the convention
def test_default_is_deepseek_order_and_legacy_is_the_same_function_swapped(tiny_target):
    assert FUSE_ORDERS == ("embedding_first", "hidden_first") and MtpSettings().fuse_order == "embedding_first"
    assert "\n" not in CONVENTION and "DeepSeek-V3" in CONVENTION and EXPORT_FORMATS == ("speculators",)
    model = random_module(tiny_target)
    assert model.fuse_order == "embedding_first"
    h, e = torch.randn(3, 64), torch.randn(3, 64)
    eps = model.shape.rms_norm_eps
    expected = torch.cat([rms_norm(e, model.norm_e, eps), rms_norm(h, model.norm_h, eps)], -1) @ model.proj.T
    assert torch.allclose(model.fuse(h, e), expected, atol=1e-6)  # eh_proj([enorm(e); hnorm(h)])
    legacy = random_module(tiny_target, "hidden_first")
    legacy.load_state_dict(model.state_dict())
    with torch.no_grad():
        legacy.proj.copy_(swap_halves(model.proj))
    assert torch.allclose(legacy.fuse(h, e), model.fuse(h, e), atol=1e-5)


def test_drafter_json_without_fuse_order_is_legacy(tiny_target, tmp_path):
    model = random_module(tiny_target, "hidden_first")
    old = save_ours(tmp_path / "old", tiny_target, model, fuse_order=None)
    new = save_ours(tmp_path / "new", tiny_target, model, fuse_order="embedding_first")
    old_info = build(tiny_target, {"drafter": str(old), "draft_dtype": "float32"}).info
    assert (old_info["fuse_order"], old_info["layout"]) == ("hidden_first", "spec-bench")
    assert build(tiny_target, {"drafter": str(new)}).info["fuse_order"] == "embedding_first"
    _, a = draft_logits(tiny_target, *load_model(tiny_target, old))
    _, b = draft_logits(tiny_target, *load_model(tiny_target, new))
    assert not torch.allclose(a[0], b[0])  # the same weights read in the other order: another function
    bad = save_ours(tmp_path / "bad", tiny_target, model, fuse_order="sideways")
    one_line(lambda: build(tiny_target, {"drafter": str(bad)}), "unknown fuse_order 'sideways'")


def test_shipped_drafter_reads_as_legacy(default_target):
    from methods.mtp.store import find_folder

    folder = find_folder(default_target, "sequential", None)
    if "checkpoints" not in str(folder) or "fuse_order" in json.loads((folder / MANIFEST).read_text()):
        pytest.skip("a user-trained or retrained drafter shadows the shipped legacy one")
    model, manifest = load_model(default_target, folder)
    assert manifest["fuse_order"] == "hidden_first" and model.fuse_order == "hidden_first"


# ------------------------------------------------------------------ speculators export
def test_speculators_export_reads_back_bit_identical(tiny_target, tmp_path):
    source = save_ours(tmp_path / "ours", tiny_target, random_module(tiny_target))
    out = mtp.export(tiny_target, str(source), "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["architectures"] == ["MTPDraftModel"]
    assert config["num_nextn_predict_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_size"], layer["num_hidden_layers"], layer["vocab_size"]) == (
        "llama", 64, 2, tiny_target.config.vocab_size)
    assert config["spec_bench"]["source_fuse_order"] == "embedding_first"
    weights = load_file(str(out / "model.safetensors"))
    assert all(k.startswith("mtp_layers.0.") for k in weights)  # no embedding / lm_head: the verifier's
    assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.token_layernorm.weight",
            "mtp_layers.0.hidden_layernorm.weight", "mtp_layers.0.final_layernorm.weight",
            "mtp_layers.0.self_attn.q_proj.weight", "mtp_layers.0.mlp.up_proj.weight"} <= set(weights)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    ours, theirs = load_model(tiny_target, source), load_model(tiny_target, out)
    assert (theirs[1]["layout"], theirs[1]["fuse_order"], theirs[1]["depth"]) == ("speculators", "embedding_first", 4)
    a, b = draft_logits(tiny_target, *ours), draft_logits(tiny_target, *theirs)
    assert a[0] == b[0] and len(a[1]) == 4
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))  # fp32: bit for bit


def test_legacy_export_swaps_the_projection_halves(tiny_target, tmp_path):
    model = random_module(tiny_target, "hidden_first")
    source = save_ours(tmp_path / "ours", tiny_target, model, fuse_order=None)
    out = mtp.export(tiny_target, str(source), "speculators", tmp_path / "spec")
    proj = load_file(str(out / "model.safetensors"))["mtp_layers.0.input_proj.weight"]
    assert torch.equal(proj, swap_halves(model.proj.detach().to(torch.bfloat16)))
    a, b = draft_logits(tiny_target, *load_model(tiny_target, source)), draft_logits(
        tiny_target, *load_model(tiny_target, out))
    assert a[0] == b[0]
    assert all(torch.allclose(x, y, atol=1e-4) for x, y in zip(a[1], b[1]))


# ------------------------------------------------------------------ native layouts
def write_native(folder, target, model, layout, whole_model: bool = False, **config_changes):
    """A checkpoint folder with `layout`'s MTP keys (and, whole_model, the target's own weights)."""
    from bench.core.target import load_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    weights = to_layout(model, layout, target.engine.num_layers)
    if whole_model:
        weights.update(load_state_dict(target.path))
        if layout is DEEPSEEK:  # DeepSeek-V3 also keeps a copy of both shared weights per module
            L = target.engine.num_layers
            weights[f"model.layers.{L}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
            weights[f"model.layers.{L}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    config = dict(target.config.to_dict(), num_nextn_predict_layers=1, **config_changes)
    (folder / "config.json").write_text(json.dumps(config, default=str))
    return folder


@pytest.mark.parametrize("layout", [DEEPSEEK, QWEN3_NEXT, MIMO], ids=lambda lay: lay.name)
def test_native_layouts_load_as_the_same_module(tiny_target, tmp_path, layout):
    model = random_module(tiny_target, layout.fuse_order)
    folder = write_native(tmp_path / layout.name, tiny_target, model, layout, whole_model=True)
    loaded, manifest = load_model(tiny_target, folder)
    assert (manifest["layout"], loaded.fuse_order) == (layout.name, layout.fuse_order)
    assert all(torch.equal(p, dict(loaded.named_parameters())[n]) for n, p in model.named_parameters())
    if layout is DEEPSEEK:  # the per-module copies of the shared weights are checked, not used
        assert "model.layers.2.shared_head.head.weight" in load_file(str(folder / "model.safetensors"))


def test_speculators_folder_runs_lossless_through_bench_run(tiny_target, tmp_path, tiny_task):
    source = save_ours(tmp_path / "ours", tiny_target, random_module(tiny_target))
    spec = tmp_path / "spec"
    result = CliRunner().invoke(main, ["export", "--method", "mtp", "--format", "speculators", "--out", str(spec),
                                       "--drafter", str(source), "--target", str(tiny_target.path)])
    assert result.exit_code == 0, result.output
    base = decode(tiny_target.engine, Drafter(), PROMPT, DecodeConfig(max_new_tokens=24))
    decoder = build(tiny_target, {"drafter": str(spec), "draft_dtype": "float32"})
    assert decoder.run_turn(PROMPT, DecodeConfig(max_new_tokens=24)).tokens == base.tokens
    results = tmp_path / "results"
    result = CliRunner().invoke(main, ["run", "--method", "mtp", "--drafter", str(spec), "--target",
                                       str(tiny_target.path), "--task", str(tiny_task), "--device", "cpu",
                                       "--max-new-tokens", "12", "--option", "draft_dtype=float32", "--strict",
                                       "--results-dir", str(results)])
    assert result.exit_code == 0, result.output
    records = next(results.glob(f"*/{task_name(str(tiny_task))}/mtp.jsonl"))
    header = json.loads(records.read_text().splitlines()[0])
    assert '"layout": "speculators"' in json.dumps(header) and '"fuse_order": "embedding_first"' in json.dumps(header)


# ------------------------------------------------------------------ refusals
def spec_folder(tmp_path, target, name: str = "spec", **config_changes):
    source = save_ours(tmp_path / f"{name}-src", target, random_module(target))
    out = mtp.export(target, str(source), "speculators", tmp_path / name)
    if config_changes:
        config = json.loads((out / "config.json").read_text())
        for key, value in config_changes.items():
            if key in config["transformer_layer_config"]:
                config["transformer_layer_config"][key] = value
            else:
                config[key] = value
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_folders_for_another_target_are_refused(tiny_target, tmp_path):
    cases = [(spec_folder(tmp_path, tiny_target, "hidden", hidden_size=32), "hidden size 32"),
             (spec_folder(tmp_path, tiny_target, "vocab", vocab_size=1000), "vocabulary 1000"),
             (spec_folder(tmp_path, tiny_target, "layers", num_hidden_layers=3), "target layer count 3"),
             (spec_folder(tmp_path, tiny_target, "heads", num_attention_heads=8), "attention heads 8"),
             (spec_folder(tmp_path, tiny_target, "eagle", speculators_model_type="eagle3"),
              "speculators 'eagle3' drafter, not mtp"),
             (spec_folder(tmp_path, tiny_target, "two", num_nextn_predict_layers=2), "2 MTP modules"),
             (spec_folder(tmp_path, tiny_target, "next", model_type="qwen3_next"), "qwen3_next layers")]
    tokenizer = spec_folder(tmp_path, tiny_target, "tok")
    (tokenizer / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"not-a-smollm-token": 0}}}))
    cases.append((tokenizer, "ships a tokenizer that differs"))
    weights = load_file(str(tokenizer / "model.safetensors"))
    for name, change, message in [
            ("missing", lambda w: w.pop("mtp_layers.0.final_layernorm.weight"), "lacks weight 'mtp_layers.0.final"),
            ("bias", lambda w: w.update({"mtp_layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
             "has a weight the target's layer shape does not: 'mtp_layers.0.self_attn.q_proj.bias'"),
            ("embed", lambda w: w.update({"embed_tokens.weight": torch.zeros(tiny_target.config.vocab_size, 64)}),
             "embed_tokens.weight, which is not target"),
            ("shape", lambda w: w.update({"mtp_layers.0.input_proj.weight": torch.zeros(64, 64)}),
             "weight proj in .* has shape")]:
        folder = spec_folder(tmp_path, tiny_target, name)
        state = dict(weights)
        change(state)
        save_file(state, str(folder / "model.safetensors"))
        cases.append((folder, message))
    empty = write_native(tmp_path / "plain", tiny_target, random_module(tiny_target), DEEPSEEK)
    save_file({"model.norm.weight": torch.ones(64)}, str(empty / "model.safetensors"))
    cases.append((empty, "holds no MTP module"))
    for folder, message in cases:
        one_line(lambda folder=folder: build(tiny_target, {"drafter": str(folder)}), message)
    good = spec_folder(tmp_path, tiny_target, "good")
    one_line(lambda: build(tiny_target, {"drafter": str(good), "variant": "parallel"}),
             "mtp sequential drafter \\(speculators layout\\), not parallel")


def test_bad_exports(tiny_target, tmp_path):
    source = save_ours(tmp_path / "ours", tiny_target, random_module(tiny_target))
    one_line(lambda: mtp.export(tiny_target, str(source), "eagle", tmp_path / "x"), "not 'eagle'")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    one_line(lambda: mtp.export(tiny_target, str(source), "speculators", tmp_path / "full"), "not empty")
    torch.manual_seed(0)
    heads = init_model(tiny_target, MtpSettings(variant="parallel", heads=2))
    parallel = tmp_path / "par"
    parallel.mkdir()
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in heads.named_parameters()},
              str(parallel / WEIGHTS))
    manifest = json.loads((source / MANIFEST).read_text())
    manifest.update(variant="parallel", tap=0, architecture=dict(manifest["architecture"], kind="parallel", heads=2))
    (parallel / MANIFEST).write_text(json.dumps(manifest))
    one_line(lambda: mtp.export(tiny_target, str(parallel), "speculators", tmp_path / "y"),
             "holds one sequential module")
    result = CliRunner().invoke(main, ["export", "--method", "mtp", "--format", "speculators", "--out",
                                       str(tmp_path / "z"), "--drafter", str(parallel), "--target",
                                       str(tiny_target.path)])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "z").exists()


def test_layouts_name_their_keys():
    assert (SPECULATORS.proj, SPECULATORS.fuse_order) == ("input_proj.weight", "embedding_first")
    assert (DEEPSEEK.module.format(L=61), DEEPSEEK.proj) == ("model.layers.61.", "eh_proj.weight")
    assert (QWEN3_NEXT.layer, QWEN3_NEXT.proj) == ("mtp.layers.0.", "fc.weight")
    assert MIMO.fuse_order == "hidden_first"
