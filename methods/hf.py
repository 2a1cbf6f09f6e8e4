"""`transformers.generate` on the same weights: the outside reference for tokens and speed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.core.decode import DecodeConfig, TurnResult
from bench.core.options import parse_options
from bench.core.target import load_hf_model


@dataclass(frozen=True)
class Options:
    """None: any key is an error, and so is --budget (plain generate drafts nothing).
    scripts/peers.py passes generate's own kwargs to HFDecoder directly."""


class _FirstTokenClock:
    """A streamer that notes when generate emits its first new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFDecoder:
    name = "hf"
    lossless = True

    def __init__(self, target, generate_kwargs: dict | None = None) -> None:
        self.target = target
        self.generate_kwargs = generate_kwargs or {}  # e.g. prompt_lookup_num_tokens, assistant_model
        self.model = load_hf_model(target.path, str(target.engine.device),
                                   str(target.engine.dtype).removeprefix("torch."))

    @torch.inference_mode()
    def run_turn(self, prompt: list[int], config: DecodeConfig, generator=None) -> TurnResult:
        device = self.target.engine.device
        ids = torch.tensor([prompt], device=device)
        sampling = config.sampling
        kwargs = dict(max_new_tokens=config.max_new_tokens, eos_token_id=list(config.eos_token_ids),
                      pad_token_id=config.eos_token_ids[0] if config.eos_token_ids else None)
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                          top_p=sampling.top_p)
            if generator is not None:
                torch.manual_seed(int(generator.initial_seed()))
        if config.stop_strings:
            kwargs.update(stop_strings=list(config.stop_strings), tokenizer=self.target.tokenizer)
        kwargs.update(self.generate_kwargs)
        clock = _FirstTokenClock()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        finished = time.perf_counter()
        tokens = out[0, len(prompt):].tolist()
        first_at = clock.first_at or finished
        reason = "eos" if tokens and tokens[-1] in config.eos_token_ids else "length"
        if config.stop_strings and reason != "eos" and len(tokens) < config.max_new_tokens:
            reason = "stop_string"
        rounds = len(tokens) - 1  # one target step per token after the prefill
        return TurnResult(tokens=tokens, stop_reason=reason, ttft=first_at - started,
                          decode_time=finished - first_at, draft_time=0.0,
                          verify_time=finished - first_at, proposed_lengths=[0] * rounds,
                          accept_lengths=[0] * rounds, tree_sizes=[0] * rounds)


def build(target, options: dict | Options | None = None) -> HFDecoder:
    parse_options(Options, options, "hf")
    return HFDecoder(target)
