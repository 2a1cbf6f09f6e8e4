"""Published EAGLE layouts: folders built by hand from each layout's documented key names and
config fields load and give the logits of a reference built from transformers' own Llama /
Qwen3 layers (as speculators builds its EAGLE-3 model); export then load is bit-identical;
exported folders decode losslessly through `bench run`'s path; a folder for another target
is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sps_helpers import load_tiny_target, make_tiny_target_folder
from torch import nn

import bench.registry as registry
from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from methods.eagle.model import EagleConfig, EagleHead
from methods.eagle.published import export_published, load_published
from methods.eagle.training import export_head

LAYERS = 8  # tiny target: EAGLE-3's taps 2, L/2, L-3 need a few layers
D, HEADS, KV_HEADS, HD, FFN = 64, 4, 2, 16, 128
PROMPT = [1, 504, 3213, 28, 1790, 30, 2, 77, 9]


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny8"), layers=LAYERS))


# ------------------------------------------------------- folders by hand
def _layer_weights(prefix: str, attn_in: int, gen: torch.Generator, bias: bool, qk_norm: bool) -> dict:
    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=gen) * scale

    def norm():
        return 1 + rand(D, scale=0.2)

    w = {f"{prefix}self_attn.q_proj.weight": rand(HEADS * HD, attn_in),
         f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HD, attn_in),
         f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HD, attn_in),
         f"{prefix}self_attn.o_proj.weight": rand(D, HEADS * HD),
         f"{prefix}mlp.gate_proj.weight": rand(FFN, D), f"{prefix}mlp.up_proj.weight": rand(FFN, D),
         f"{prefix}mlp.down_proj.weight": rand(D, FFN), f"{prefix}post_attention_layernorm.weight": norm()}
    if bias:
        w.update({f"{prefix}self_attn.{p}_proj.bias": rand(w[f"{prefix}self_attn.{p}_proj.weight"].shape[0])
                  for p in "qkvo"})
    if qk_norm:
        w.update({f"{prefix}self_attn.{p}_norm.weight": 1 + rand(HD, scale=0.2) for p in "qk"})
    return w


def _llama_fields(target, layers: int, **extra) -> dict:
    return {"hidden_size": D, "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HD, "num_hidden_layers": layers, "vocab_size": target.config.vocab_size, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu", "max_position_embeddings": 2048, **extra}


def published_folder(folder: Path, target, layout: str, kind: str, *, layers: int = 1, bias: bool = False,
                     fc_norm: bool = False, norm_before_residual: bool = False, norm_output: bool = False,
                     norm_before_fc: bool = False, qwen3: bool = False, draft_vocab: int | None = 512,
                     taps: list[int] | None = None, seed: int = 0) -> Path:
    """A folder in `layout` ("eagle": SafeAILab/SpecForge, "speculators"), written from the
    documented key names and config fields only."""
    gen = torch.Generator().manual_seed(seed)
    eagle3 = kind == "eagle3"
    first = "midlayer." if layout == "eagle" and eagle3 else "layers.0."
    w = _layer_weights(first, 2 * D if eagle3 else D, gen, bias, qwen3)
    for i in range(1, layers):
        w.update(_layer_weights(f"layers.{i}.", D, gen, bias, qwen3))
        w[f"layers.{i}.input_layernorm.weight"] = 1 + torch.randn(D, generator=gen) * 0.2
    vocab = target.config.vocab_size
    n_taps = len(taps or [0, 0, 0])
    if eagle3:
        rows = draft_vocab or vocab
        w.update({"fc.weight": torch.randn(D, n_taps * D, generator=gen) * 0.1,
                  f"{first}input_layernorm.weight": 1 + torch.randn(D, generator=gen) * 0.2,
                  f"{first}hidden_norm.weight": 1 + torch.randn(D, generator=gen) * 0.2,
                  "norm.weight": 1 + torch.randn(D, generator=gen) * 0.2,
                  "lm_head.weight": torch.randn(rows, D, generator=gen) * 0.3})
        if draft_vocab:
            ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
            w["d2t"] = ids - torch.arange(draft_vocab)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[ids] = True
            w["t2d"] = t2d
        if fc_norm:
            w.update({f"fc_norm.{i}.weight": 1 + torch.randn(D, generator=gen) * 0.2 for i in range(n_taps)})
        if norm_before_fc:
            w["input_norm.weight"] = 1 + torch.randn(n_taps * D, generator=gen) * 0.2
        w["embed_tokens.weight"] = target.engine.embed.clone()  # carried by some checkpoints; the target's is used
    else:
        w.update({"fc.weight": torch.randn(D, 2 * D, generator=gen) * 0.1,
                  "fc.bias": torch.randn(D, generator=gen) * 0.1})
    if layout == "eagle":
        config = {"architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], "model_type": "llama",
                  **_llama_fields(target, layers)}
        if bias:
            config["attention_bias"] = True
        if eagle3:
            config.update(draft_vocab_size=draft_vocab or vocab, fc_norm=fc_norm,
                          norm_before_residual=norm_before_residual, norm_output=True)  # SpecForge: true = usual norm
    else:
        layer = {"model_type": "qwen3" if qwen3 else "llama", **_llama_fields(target, layers, attention_bias=bias)}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_config": {"algorithm": "eagle3"}, "transformer_layer_config": layer,
                  "draft_vocab_size": draft_vocab or vocab, "norm_before_residual": norm_before_residual,
                  "fc_norm": fc_norm, "norm_before_fc": norm_before_fc, "norm_output": norm_output,
                  "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": taps}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ------------------------------------------------ reference from transformers
def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Reference:
    """The published semantics, from the folder's own names, on transformers' decoder layers:
    EAGLE-3 as speculators' Eagle3DraftModel (first layer reads [norm(Emb); norm(g)]),
    EAGLE-1 as SafeAILab's cnets1 (fc over [Emb; f], no input norm on layer 0)."""

    def __init__(self, folder: Path, target) -> None:
        from transformers import AutoConfig
        from transformers.cache_utils import DynamicCache
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        raw = json.loads((folder / "config.json").read_text())
        weights = load_file(str(folder / "model.safetensors"))
        self.raw, self.target = raw, target
        self.w = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
        fields = dict(raw.get("transformer_layer_config") or raw)
        self.eagle3 = "fc.weight" in self.w and self.w["fc.weight"].shape[1] != 2 * D
        model_type = fields.get("model_type", "llama")
        keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "attention_bias")
        config = AutoConfig.for_model(model_type, **{k: fields[k] for k in keep if k in fields})
        config._attn_implementation = "sdpa"
        self.config = config
        first = "midlayer." if any(k.startswith("midlayer.") for k in self.w) else "layers.0."
        self.layers = []
        for i in range(fields.get("num_hidden_layers", 1)):
            layer = self._decoder_class(model_type)(config, i)
            prefix = first if i == 0 else f"layers.{i}."
            if i == 0 and self.eagle3:  # q/k/v read [Emb; g], 2d wide
                for p in "qkv":
                    old = getattr(layer.self_attn, f"{p}_proj")
                    setattr(layer.self_attn, f"{p}_proj", nn.Linear(2 * D, old.out_features, bias=old.bias is not None))
            if i == 0 and not self.eagle3 and f"{prefix}input_layernorm.weight" not in self.w:
                layer.input_layernorm = nn.Identity()  # SafeAILab's first EAGLE-1 layer
            state = {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}
            self.hidden_norm = state.pop("hidden_norm.weight", None) if i == 0 else self.hidden_norm
            layer.load_state_dict(state, strict=True)
            self.layers.append(layer.eval())
        self.rotary = LlamaRotaryEmbedding(config)
        self.cache = DynamicCache()

    @staticmethod
    def _decoder_class(model_type):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        return Qwen3DecoderLayer if model_type == "qwen3" else LlamaDecoderLayer

    def fuse(self, taps: list[torch.Tensor]) -> torch.Tensor:
        x = taps
        if "fc_norm.0.weight" in self.w:
            x = [_rms(t, self.w[f"fc_norm.{i}.weight"]) for i, t in enumerate(x)]
        x = torch.cat(x, -1)
        if "input_norm.weight" in self.w:
            x = _rms(x, self.w["input_norm.weight"])
        return F.linear(x, self.w["fc.weight"])

    @torch.no_grad()
    def step(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Rows [1, n, d] at `positions` after every earlier row (causal); returns (fed back, logits)."""
        embeds = F.embedding(ids, self.target.engine.embed)[None]
        cos_sin = self.rotary(hidden, positions[None])
        kwargs = {"position_embeddings": cos_sin, "attention_mask": None, "past_key_values": self.cache,
                  "use_cache": True}
        h = hidden if self.eagle3 else F.linear(torch.cat([embeds, hidden], -1), self.w["fc.weight"],
                                                self.w["fc.bias"])
        if self.eagle3:
            first = self.layers[0]
            normed = _rms(h, self.hidden_norm)
            residual = normed if self.raw.get("norm_before_residual") else h
            x = torch.cat([first.input_layernorm(embeds), normed], -1)
            attn, _ = first.self_attn(x, **kwargs)
            h = residual + attn
            h = h + first.mlp(first.post_attention_layernorm(h))
            rest = self.layers[1:]
        else:
            rest = self.layers
        for layer in rest:
            h = layer(h, **kwargs)
        if not self.eagle3:
            return h, F.linear(h, self.target.engine.lm_head)
        normed = _rms(h, self.w["norm.weight"])
        fed = normed if self.raw.get("speculators_model_type") and self.raw.get("norm_output") else h
        logits = F.linear(normed, self.w["lm_head.weight"])
        return fed, logits


def _draft_ids(folder: Path, rows: int) -> torch.Tensor:
    w = load_file(str(folder / "model.safetensors"))
    return torch.arange(rows) + w["d2t"] if "d2t" in w else torch.arange(rows)


def compare_with_reference(folder: Path, target, kind: str, taps: list[int] | None = None, atol: float = 2e-5) -> None:
    """Two draft steps (the context pass, then one node fed the last output): the loaded head's
    logits equal the reference's, in target-vocabulary ids."""
    head, manifest = load_published(target, folder, kind)
    ref = Reference(folder, target)
    gen = torch.Generator().manual_seed(7)
    T = 6
    ids = torch.randint(0, target.config.vocab_size, (T + 1,), generator=gen)
    features = [torch.randn(T, D, generator=gen) for _ in (head.config.taps if kind == "eagle3" else [0])]
    if taps is not None:
        assert head.config.taps == taps
    embeds = F.embedding(ids, target.engine.embed)
    with torch.no_grad():
        cache = head.new_cache()
        hidden = head.fuse(features, embeds[:T])
        out0 = head.step(hidden, embeds[:T], torch.arange(T), cache)
        fed = out0[-1:] if kind == "eagle3" else head.fuse([out0[-1:]], embeds[T:])
        out1 = head.step(fed, embeds[T:], torch.tensor([T]), cache)
        ours = [head.logits(o, target.engine.lm_head) for o in (out0, out1)]
        ref_fed, ref0 = ref.step(ref.fuse([f[None] for f in features]) if kind == "eagle3" else features[0][None],
                                 ids[:T], torch.arange(T))
        _, ref1 = ref.step(ref_fed[:, -1:], ids[T:], torch.tensor([T]))
    for got, want in zip(ours, (ref0[0], ref1[0])):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    if kind == "eagle3":
        rows = head.lm_head.weight.shape[0]
        assert torch.equal(head.draft_to_target, _draft_ids(folder, rows))
    return manifest


CASES = {
    "safeailab-eagle1": ("eagle", "eagle1", {}),
    "safeailab-eagle1-2layers-bias": ("eagle", "eagle1", {"layers": 2, "bias": True}),
    "safeailab-eagle3": ("eagle", "eagle3", {}),
    "safeailab-eagle3-full-vocab": ("eagle", "eagle3", {"draft_vocab": None}),
    "specforge-eagle3-variants": ("eagle", "eagle3", {"fc_norm": True, "norm_before_residual": True, "layers": 2,
                                                      "bias": True}),
    "speculators-eagle3": ("speculators", "eagle3", {}),
    "speculators-eagle3-variants": ("speculators", "eagle3", {"norm_before_residual": True, "norm_output": True,
                                                              "layers": 3, "bias": True, "fc_norm": True,
                                                              "taps": [1, 3, 6]}),
    "speculators-eagle3-qwen3-norm-before-fc": ("speculators", "eagle3", {"qwen3": True, "norm_before_fc": True,
                                                                          "draft_vocab": None, "taps": [2, 4, 5, 7]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_published_layouts_load_and_match_the_reference(tiny8, tmp_path, case):
    layout, kind, flags = CASES[case]
    folder = published_folder(tmp_path / case, tiny8, layout, kind, **flags)
    manifest = compare_with_reference(folder, tiny8, kind, flags.get("taps"))
    assert manifest["layout"] == layout and manifest["published"] == str(folder)
    arch = manifest["architecture"]
    assert arch["num_layers"] == flags.get("layers", 1)
    assert arch["qk_norm"] == flags.get("qwen3", False) and arch["o_bias"] == flags.get("bias", False)
    if kind == "eagle3":
        assert arch["norm_output"] == flags.get("norm_output", False)
        assert arch["fc_norm"] == flags.get("fc_norm", False)


def test_a_published_folder_decodes_losslessly(tiny8, tmp_path, one_thread):
    """`bench run --method eagle3 --drafter <speculators folder>` (and eagle on SafeAILab's)."""
    config = DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(0.0))
    reference = decode(tiny8.engine, Drafter(), PROMPT, config).tokens
    cases = {"eagle3": published_folder(tmp_path / "spec", tiny8, "speculators", "eagle3", layers=2, norm_output=True,
                                        norm_before_residual=True),
             "eagle": published_folder(tmp_path / "ea", tiny8, "eagle", "eagle1", layers=2)}
    for method, folder in cases.items():
        decoder = registry.build_decoder(method, tiny8, {"drafter": str(folder), "dtype": "float32"})
        result = decoder.run_turn(PROMPT, config)
        assert result.tokens == reference
        assert max(result.tree_sizes) > 1


# --------------------------------------------------------------- export
def _trained_like(target, kind: str, folder: Path, seed: int = 0) -> Path:
    """A drafter folder in our format (as `bench train` writes it) with non-trivial norms."""
    torch.manual_seed(seed)
    taps = [2, LAYERS // 2, LAYERS - 3] if kind == "eagle3" else [LAYERS]
    head = EagleHead(EagleConfig.for_target(target.config, kind, taps, 512 if kind == "eagle3" else None))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)
        if kind == "eagle3":
            head.draft_to_target.copy_(torch.randperm(target.config.vocab_size)[:512].sort().values)
    method = "eagle3" if kind == "eagle3" else "eagle"
    export_head(head, folder, {"method": method, "target": {"name": target.name, "fingerprint": target.fingerprint,
                                                             "vocab_size": target.config.vocab_size},
                               "training": {"settings": {"ttt_steps": 4}}})
    return folder


EXPORTS = [("eagle", "eagle1", "eagle"), ("eagle2", "eagle1", "eagle"), ("eagle3", "eagle3", "eagle"),
           ("eagle3", "eagle3", "speculators")]


@pytest.mark.parametrize("method,kind,fmt", EXPORTS)
def test_export_then_load_gives_bit_identical_draft_logits(tiny8, tmp_path, one_thread, method, kind, fmt):
    import importlib

    from methods.eagle import Options, load_head

    module = importlib.import_module(registry.get_method(method).module)
    assert fmt in module.EXPORT_FORMATS and module.CONVENTION
    ours = _trained_like(tiny8, kind, tmp_path / "ours")
    out = module.export(tiny8, str(ours), fmt, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 512
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert config["transformer_layer_config"]["model_type"] == "llama"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"]
    weights = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and all(w.dtype in (torch.bfloat16, torch.int64, torch.bool)
                                                        for w in weights.values())
    original, _ = load_head(tiny8, method, Options(drafter=str(ours), dtype="float32"), kind)
    loaded, manifest = load_published(tiny8, out, kind)
    assert manifest["layout"] == fmt
    gen = torch.Generator().manual_seed(1)
    features = [torch.randn(1, 7, D, generator=gen) for _ in original.config.taps]
    embeds = torch.randn(1, 7, D, generator=gen)
    with torch.no_grad():
        logits = [h.logits(h.forward_train(h.fuse(features, embeds), embeds, torch.arange(7)[None]),
                           tiny8.engine.lm_head) for h in (original, loaded)]
    assert torch.equal(logits[0], logits[1])
    if kind == "eagle3":
        assert torch.equal(original.draft_to_target, loaded.draft_to_target)
        compare_with_reference(out, tiny8, kind)  # the exported names are the documented ones
    # and `bench run` on the exported folder stays lossless
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(0.0))
    decoder = registry.build_decoder("eagle" if kind == "eagle1" else "eagle3", tiny8, {"drafter": str(out)})
    assert decoder.run_turn(PROMPT, config).tokens == decode(tiny8.engine, Drafter(), PROMPT, config).tokens


def test_variant_heads_round_trip_through_speculators(tiny8, tmp_path):
    """Every flag the loader reads survives export -> load bit for bit."""
    torch.manual_seed(3)
    config = EagleConfig.for_target(tiny8.config, "eagle3", [1, 3, 6], 256)
    for name, value in {"num_layers": 2, "qkv_bias": True, "o_bias": True, "qk_norm": True, "fc_norm": True,
                        "norm_before_residual": True, "norm_output": True}.items():
        setattr(config, name, value)
    head = EagleHead(config)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = export_published(head, tiny8, "speculators", tmp_path / "out")
    loaded, _ = load_published(tiny8, out, "eagle3")
    assert loaded.config.to_dict() == config.to_dict()
    assert list(head.state_dict()) == list(loaded.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    compare_with_reference(out, tiny8, "eagle3", [1, 3, 6])
    with pytest.raises(BenchError, match="cannot express"):
        export_published(head, tiny8, "eagle", tmp_path / "ea")


def test_export_refuses_what_a_layout_cannot_hold(tiny8, tmp_path):
    from methods.eagle import export

    ours = _trained_like(tiny8, "eagle1", tmp_path / "ours")
    with pytest.raises(BenchError, match="speculators defines no EAGLE-1"):
        export(tiny8, str(ours), "speculators", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(BenchError, match="not empty"):
        export(tiny8, str(ours), "eagle", tmp_path / "full")


def test_bench_export_command(tiny8, tmp_path):
    from click.testing import CliRunner

    from bench.cli import main

    ours = _trained_like(tiny8, "eagle3", tmp_path / "ours")
    out = tmp_path / "spec"
    args = ["export", "--method", "eagle3", "--format", "speculators", "--out", str(out), "--drafter", str(ours),
            "--target", str(tiny8.path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists() and "speculators" in result.output
    bad = CliRunner().invoke(main, ["export", "--method", "eagle", "--format", "speculators", "--out",
                                    str(tmp_path / "x"), "--target", str(tiny8.path)])
    assert bad.exit_code == 2 and len(bad.stderr.splitlines()) == 1
    assert "eagle exports to eagle, not 'speculators'" in bad.stderr


# ------------------------------------------------------------- refusals
def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key == "layer":
            config.setdefault("transformer_layer_config", config).update(value)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


REFUSALS = {
    "hidden size": (dict(target_hidden_size=96), "hidden size 96"),
    "vocabulary": (dict(layer={"vocab_size": 1000}), "vocabulary 1000"),
    "tap out of range": (dict(eagle_aux_hidden_state_layer_ids=[2, 4, 12]), "taps target layer 12"),
    "rope scaling": (dict(layer={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "RoPE scaling 'llama3'"),
    "another algorithm": (dict(speculators_model_type="dflash"), "speculators 'dflash' drafter"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_folder_for_another_target_is_refused_in_one_line(tiny8, tmp_path, case):
    changes, message = REFUSALS[case]
    folder = published_folder(tmp_path / "f", tiny8, "speculators", "eagle3")
    _edit_config(folder, **changes)
    with pytest.raises(BenchError, match=message) as error:
        registry.build_decoder("eagle3", tiny8, {"drafter": str(folder)})
    assert "\n" not in str(error.value)


def test_other_refusals(tiny8, tmp_path):
    folder = published_folder(tmp_path / "tok", tiny8, "eagle", "eagle3")
    vocab = dict(list(tiny8.tokenizer.get_vocab().items())[:100])
    vocab[next(iter(vocab))] = 99999
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(BenchError, match="ships a tokenizer that differs"):
        registry.build_decoder("eagle3", tiny8, {"drafter": str(folder)})
    folder = published_folder(tmp_path / "extra", tiny8, "eagle", "eagle3")
    weights = load_file(str(folder / "model.safetensors"))
    weights["midlayer.self_attn.sinks"] = torch.zeros(4)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(BenchError, match="'midlayer.self_attn.sinks', which no supported variant has"):
        registry.build_decoder("eagle3", tiny8, {"drafter": str(folder)})
    folder = published_folder(tmp_path / "e1", tiny8, "eagle", "eagle1")
    with pytest.raises(BenchError, match="holds an eagle1 head; use --method eagle"):
        registry.build_decoder("eagle3", tiny8, {"drafter": str(folder)})
    folder = published_folder(tmp_path / "d2t", tiny8, "speculators", "eagle3")
    weights = load_file(str(folder / "model.safetensors"))
    weights["d2t"] = weights["d2t"] + 1
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(BenchError, match="t2d does not mark|outside the target vocabulary"):
        registry.build_decoder("eagle3", tiny8, {"drafter": str(folder)})
