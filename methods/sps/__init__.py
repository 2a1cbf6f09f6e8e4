"""SpS: classic speculative sampling with an independent draft model (Leviathan et al.
2211.17192; Chen et al. 2302.01318).

A small LM sharing the target's tokenizer proposes a chain of gamma tokens, one at a
time: argmax at temperature 0, otherwise sampled from softmax(process_logits(logits))
with the target's own SamplingConfig, and each q row recorded so chain rejection
sampling is exact. The draft runs on its own Engine (the same forward code as the
target). Draft KV holds only committed tokens plus its own proposals; after each round
it is cropped to the committed prefix it has seen, and the tokens it never produced
(the correction/bonus token, a rejected tail) are re-fed at the next proposal.

The drafter comes from bench.core.drafters.find_drafter: a distilled draft LM
(`bench train --method sps`) or any HF causal-LM folder with the same tokenizer.

Options: see `Options` below.

Why gamma 3 and a bf16 draft are the defaults is measured in results/README.md. The
draft's lm_head (shared with the target's 49152-token vocabulary) is a large share of a
target step for a small target, so SpS needs far better acceptance than the shipped
drafter has to beat AR.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft
from bench.core.drafters import (
    MANIFEST,
    WEIGHTS,
    check_tokenizer,
    find_drafter,
    open_drafter,
    read_weights,
    weights_sha1,
)
from bench.core.engine import Engine, ForwardOutput
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, Dtype, option, parse_options
from bench.core.sampling import process_logits, sample_from
from bench.core.verify import Verdict

METHOD = "sps"
SCHEDULES = ("constant", "heuristic")


@dataclass(frozen=True)
class Options(DraftOptions):
    """gamma: drafts per round; schedule: constant, or heuristic (HF's rule: +2 when all
    drafts were accepted, else -1, floor 1) capped at max_gamma; drafter: folder (default:
    user-trained, then shipped); draft_dtype: bfloat16 by default (the draft only proposes,
    so its precision changes acceptance, never the output; on CPU it halves the draft's
    memory traffic).

    --budget K: gamma = K with the constant schedule."""

    gamma: int = option(3, min=1)
    schedule: Literal["constant", "heuristic"] = "constant"
    max_gamma: int = option(16, min=1)
    drafter: str | None = None
    draft_dtype: Dtype = "bfloat16"

    def __post_init__(self) -> None:
        if self.schedule == "heuristic" and self.gamma > self.max_gamma:
            raise BenchError(f"sps gamma {self.gamma} exceeds max_gamma {self.max_gamma}")

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"gamma": budget, "schedule": "constant"}

    def draft_budget(self) -> int | None:
        return self.gamma if self.schedule == "constant" else None


def load_draft_engine(target, folder: Path, dtype: torch.dtype | None = None) -> tuple[Engine, dict]:
    """The draft model as an Engine on the target's device, and a description of it.

    Our own drafters store only their layers; the target's embedding and lm_head are
    added back (shared tensors, no copy). An HF folder is loaded whole after checking
    its tokenizer and vocabulary size against the target's."""
    from transformers import AutoConfig, AutoTokenizer

    from bench.core.target import load_state_dict
    from bench.training.draft_lm import config_from_dict

    folder = Path(folder)
    engine = target.engine
    dtype = dtype or engine.dtype
    if (folder / MANIFEST).exists():
        manifest = open_drafter(target, folder, (METHOD,))
        config = config_from_dict(manifest["architecture"])
        state = read_weights(folder / manifest.get("weights", WEIGHTS))
        state["model.embed_tokens.weight"] = engine.embed
        if engine.lm_head is not engine.embed:
            state["lm_head.weight"] = engine.lm_head
        info = {"drafter": str(folder), "draft_layers": config.num_hidden_layers,
                "trained_steps": manifest.get("training", {}).get("steps"),
                "weights_sha1": weights_sha1(folder)}
    else:
        config = AutoConfig.from_pretrained(folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception:
            raise BenchError(f"drafter folder {folder} has no loadable tokenizer") from None
        check_tokenizer(target, tokenizer, f"drafter {folder}")
        if config.vocab_size != target.config.vocab_size:
            raise BenchError(f"drafter {folder} has vocab size {config.vocab_size}, "
                             f"target '{target.name}' has {target.config.vocab_size}")
        state = load_state_dict(folder)
        info = {"drafter": str(folder), "draft_layers": config.num_hidden_layers}
    missing = [k for k in ("model.norm.weight", "model.layers.0.input_layernorm.weight") if k not in state]
    if missing:
        raise BenchError(f"drafter {folder} lacks weights ({missing[0]})")
    return Engine(config, state, device=engine.device, dtype=dtype), info


class SpsDrafter(Drafter):
    name = METHOD

    def __init__(self, draft: Engine, gamma: int = 3, schedule: str = "constant", max_gamma: int = 16) -> None:
        if schedule not in SCHEDULES:
            raise BenchError(f"sps schedule '{schedule}' unknown (choose from {', '.join(SCHEDULES)})")
        if gamma < 1 or (schedule == "heuristic" and gamma > max_gamma):
            raise BenchError(f"sps gamma must be in 1..{max_gamma}, got {gamma}")
        self.draft = draft
        self.initial_gamma = gamma
        self.schedule = schedule
        self.max_gamma = max_gamma
        self.gamma = gamma
        self.seen = 0  # committed tokens whose KV the draft holds (a prefix of state.tokens)

    def fork(self) -> Drafter:
        twin = super().fork()
        twin.draft = self.draft.fork()  # the draft model's KV cache is per request
        return twin

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        # The prompt is prefilled here; the first target token is fed with the first proposal.
        self.gamma = self.initial_gamma
        self.draft.prefill(torch.tensor(state.tokens[: state.prompt_len]), logits_rows="none")
        self.seen = state.prompt_len

    def propose(self, state: DecodeState) -> Draft:
        remaining = state.config.max_new_tokens - len(state.generated)
        gamma = min(self.gamma, remaining - 1)  # the verify pass adds one token itself
        if gamma < 1:
            return Draft.empty()
        cfg = state.config.sampling
        feed = torch.tensor(state.tokens[self.seen:])  # tokens the draft has not seen, root last
        tokens, q_rows = [], []
        for i in range(gamma):
            logits = self.draft.forward(feed, logits_rows="last").logits[-1]
            if cfg.greedy:
                token = int(logits.argmax())
            else:
                q = process_logits(logits, cfg).softmax(-1)
                token = sample_from(q, state.generator)
                q_rows.append(q)
            tokens.append(token)
            if i + 1 < gamma:  # the last draft token is never fed: its logits are not needed
                feed = torch.tensor([token])
        return Draft.chain(tokens, q=torch.stack(q_rows) if q_rows else None)

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        # Draft KV = committed tokens before the round + d1..d(gamma-1). Keep the committed
        # part: everything up to the root, plus the accepted drafts it has already fed.
        before_round = len(state.tokens) - len(verdict.accepted) - 1  # committed length at propose time
        fed_drafts = max(0, len(draft) - 1)
        self.seen = before_round + min(len(verdict.accepted), fed_drafts)
        self.draft.crop(self.seen)
        if self.schedule == "heuristic" and len(draft):
            if len(verdict.accepted) == len(draft):
                self.gamma = min(self.max_gamma, self.gamma + 2)
            else:
                self.gamma = max(1, self.gamma - 1)


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    from bench.core.target import parse_dtype

    opts = parse_options(Options, options, METHOD)
    folder = find_drafter(target.name, METHOD, opts.drafter)
    dtype = parse_dtype(opts.draft_dtype)
    draft, info = load_draft_engine(target, folder, dtype)
    drafter = SpsDrafter(draft, gamma=opts.gamma, schedule=opts.schedule, max_gamma=opts.max_gamma)
    return LoopDecoder(target, drafter, dict(info, gamma=opts.gamma, schedule=opts.schedule,
                                             draft_dtype=str(dtype).removeprefix("torch.")))


def train(target, settings) -> dict:
    """`bench train --method sps`: distil a small draft LM from the target."""
    from bench.training.draft_lm import train_draft_lm

    return train_draft_lm(target, settings)
