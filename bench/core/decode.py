"""The one decode loop every method runs through.

prefill -> rounds of [propose -> verify -> commit -> the drafter learns from the round] until
max_new_tokens, an EOS token or a stop string. A method is a Drafter plugged into this
loop; the AR baseline is the Drafter that proposes nothing, so each of its rounds is a
one-token target step through exactly the same code, and timings are comparable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from bench.core.draft import Draft
from bench.core.engine import Engine, ForwardOutput
from bench.core.sampling import SamplingConfig, sample
from bench.core.verify import Verdict, verify

PASS_HEADROOM = 256  # cache slots past the reply for one verify pass (the largest drafts: trees of ~100 nodes)


@dataclass
class DecodeConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass
class DecodeState:
    """What a drafter may read: the committed tokens (prompt + generated; the last one,
    the root, is not yet in the target's KV cache) and the engine."""

    tokens: list[int]
    prompt_len: int
    engine: Engine
    config: DecodeConfig
    generator: torch.Generator | None

    @property
    def root(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class Drafter:
    """Base drafter: proposes nothing. Subclasses override propose and learn (and begin)."""

    name = "ar"
    lossless = True  # False only for methods whose acceptance rule changes the output
    taps: tuple[int, ...] = ()  # target hidden-state layers the drafter reads

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        """Called after the target's prefill with its hidden states at the prompt."""

    def propose(self, state: DecodeState) -> Draft:
        return Draft.empty()

    def verify(self, draft: Draft, logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        """The round's acceptance rule: the shared lossless verifier, unless a method
        overrides it (a lossy rule, such as Medusa's typical acceptance, must also set
        `lossless = False` so its records are kept out of lossless tables)."""
        return verify(draft, logits, sampling, generator)

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        """Learn from the verified round. `rows` are the verify-pass rows now committed
        ([root] + accepted nodes); out.hidden[l][rows] are their tapped features."""


@dataclass
class TurnResult:
    tokens: list[int]  # generated ids, EOS included when it ended the turn
    stop_reason: str  # "eos" | "length" | "stop_string"
    ttft: float  # request start -> first token (prefill + first sample)
    decode_time: float  # first token -> last token
    draft_time: float  # propose + drafter updates (+ drafter prefill)
    verify_time: float  # target verification passes, acceptance and KV commit
    proposed_lengths: list[int]  # per round: longest draft path offered (tree depth)
    accept_lengths: list[int]  # per round: accepted draft tokens (0..proposed)
    tree_sizes: list[int]  # per round: draft nodes verified


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StopRule:
    def __init__(self, config: DecodeConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos = set(config.eos_token_ids)

    def cut(self, generated: list[int], new_from: int) -> tuple[int, str | None]:
        """Length to keep and why the turn ends (None: it goes on)."""
        for i in range(new_from, len(generated)):
            if generated[i] in self.eos:
                return i + 1, "eos"
        if self.config.stop_strings and self.tokenizer is not None:
            for i in range(new_from, len(generated)):  # earliest token completing a stop string
                tail = self.tokenizer.decode(generated[max(0, i - 16): i + 1])
                if any(s in tail for s in self.config.stop_strings):
                    return i + 1, "stop_string"
        if len(generated) >= self.config.max_new_tokens:
            return self.config.max_new_tokens, "length"
        return len(generated), None


def decode(engine: Engine, drafter: Drafter, prompt: list[int], config: DecodeConfig,
           generator: torch.Generator | None = None, tokenizer=None) -> TurnResult:
    """Generate one reply to `prompt` with `drafter` proposing and the target verifying."""
    device = engine.device
    stop = _StopRule(config, tokenizer)
    _sync(device)
    started = time.perf_counter()
    prefill = engine.prefill(torch.tensor(prompt), taps=drafter.taps,
                             capacity=len(prompt) + config.max_new_tokens + PASS_HEADROOM)
    first = sample(prefill.logits[-1], config.sampling, generator)
    _sync(device)
    first_at = time.perf_counter()
    state = DecodeState(tokens=list(prompt) + [first], prompt_len=len(prompt), engine=engine,
                        config=config, generator=generator)
    proposed, accepted_counts, sizes = [], [], []
    draft_time = verify_time = 0.0
    keep, reason = stop.cut(state.generated, 0)
    if reason is None:
        drafter.begin(state, prefill)
        _sync(device)
        draft_time += time.perf_counter() - first_at
    while reason is None:
        t0 = time.perf_counter()
        draft = drafter.propose(state)
        _sync(device)
        t1 = time.perf_counter()
        start = engine.length
        tokens, positions, mask = draft.verify_inputs(state.root, start)
        out = engine.forward(tokens, positions, mask, taps=drafter.taps)
        verdict = drafter.verify(draft, out.logits[: len(draft) + 1], config.sampling, generator)
        rows = [0] + [node + 1 for node in verdict.accepted]
        engine.keep(start, rows)
        _sync(device)
        t2 = time.perf_counter()
        before = len(state.generated)
        state.tokens += [draft.tokens[node] for node in verdict.accepted] + [verdict.next_token]
        proposed.append(max(draft.depths(), default=0))
        accepted_counts.append(len(verdict.accepted))
        sizes.append(len(draft))
        keep, reason = stop.cut(state.generated, before)
        t3 = time.perf_counter()
        if reason is None:
            drafter.learn(state, draft, verdict, out, rows)
        _sync(device)
        verify_time += t2 - t1
        draft_time += (t1 - t0) + (time.perf_counter() - t3)
    finished = time.perf_counter()
    return TurnResult(
        tokens=state.generated[:keep], stop_reason=reason, ttft=first_at - started,
        decode_time=finished - first_at, draft_time=draft_time, verify_time=verify_time,
        proposed_lengths=proposed, accept_lengths=accepted_counts, tree_sizes=sizes)


class LoopDecoder:
    """A Drafter bound to a target: the Decoder interface of every loop method."""

    def __init__(self, target, drafter: Drafter, info: dict | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.name = drafter.name
        self.lossless = drafter.lossless
        self.info = info  # which trained drafter (recorded with the run's settings)

    def run_turn(self, prompt: list[int], config: DecodeConfig,
                 generator: torch.Generator | None = None) -> TurnResult:
        return decode(self.target.engine, self.drafter, prompt, config, generator, self.target.tokenizer)
