"""Tiny random-weight Llama targets with the real SmolLM2 tokenizer, for SpS and training
tests: fast enough to decode and train a few steps in seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench.core.engine import Engine
from bench.core.target import Target, load_state_dict, resolve_target, weights_fingerprint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_config(vocab_size: int, layers: int = 2, tied: bool = False):
    return AutoConfig.for_model(
        "llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2)


def make_tiny_target_folder(folder: Path, seed: int = 0, layers: int = 2, tied: bool = False) -> Path:
    """Save a random tiny Llama plus the default target's tokenizer files into `folder`."""
    _, real = resolve_target(None)
    tokenizer = AutoTokenizer.from_pretrained(real)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tokenizer), layers, tied), dtype=torch.float32)
    with torch.no_grad():  # peaked logits: argmax margins far above float noise
        model.lm_head.weight.normal_(0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (real / name).exists():
            shutil.copy(real / name, folder / name)
    return folder


def load_tiny_target(folder: Path) -> Target:
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    state = load_state_dict(folder)
    engine = Engine(config, state)
    return Target(name="tiny", path=folder, fingerprint=weights_fingerprint(state), engine=engine,
                  tokenizer=tokenizer, config=config)


def noisy_draft(target: Target, scale: float, seed: int = 1) -> Engine:
    """The target's own weights plus noise on the layers: a draft that agrees often, not always."""
    state = load_state_dict(target.path)
    generator = torch.Generator().manual_seed(seed)
    for name, value in state.items():
        if name.startswith("model.layers."):
            state[name] = value + scale * value.std() * torch.randn(value.shape, generator=generator)
    return Engine(target.config, state)


def write_sharegpt(path: Path, conversations: int = 12, truncated: bool = True) -> Path:
    """A small ShareGPT-format file, cut off mid-entry like the real one."""
    rows = []
    for i in range(conversations):
        rows.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"The answer is {2 * i}. " + "Adding numbers is easy. " * (1 + i % 3)},
            {"from": "human", "value": "Thanks! And times two?"},
            {"from": "gpt", "value": f"That is {4 * i}."}]})
    rows.insert(3, {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "orphan reply"}]})
    text = json.dumps(rows, indent=2)
    if truncated:
        text = text[: len(text) - 40]  # the last entry is incomplete
    path.write_text(text)
    return path


def three_token_joint(engine, prompt: list[int], cfg) -> tuple[dict[tuple, int], list[float]]:
    """The target's p(a) p(b|a) p(c|ab) over its (warped) support: cell index and probability."""
    from bench.core.sampling import probabilities

    def p(context: list[int]) -> torch.Tensor:
        return probabilities(engine.prefill(torch.tensor(prompt + context)).logits[-1], cfg).double()

    index: dict[tuple, int] = {}
    joint: list[float] = []
    first = p([])
    for a in first.nonzero().squeeze(-1).tolist():
        second = p([a])
        for b in second.nonzero().squeeze(-1).tolist():
            third = p([a, b])
            for c in third.nonzero().squeeze(-1).tolist():
                index[(a, b, c)] = len(joint)
                joint.append(float(first[a] * second[b] * third[c]))
    return index, joint
