"""The one decode loop every method runs through.

prefill -> rounds of [propose -> verify -> commit -> the drafter learns from the round] until
max_new_tokens, an EOS token or a stop string. A method is a Drafter plugged into this
loop; the AR baseline is the Drafter that proposes nothing, so each of its rounds is a
one-token target step through exactly the same code, and timings are comparable.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

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

    def fork(self) -> Drafter:
        """A drafter for another request decoding at the same time (batched decoding): the
        same weights; per-request state is set by `begin`. A drafter whose `begin` reuses a
        buffer in place (a KV cache) gives the fork its own."""
        import copy

        return copy.copy(self)

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
    queued: float = 0.0  # batched decoding: run start -> the request's admission to a slot
    load: float = 1.0  # batched decoding: mean requests sharing its target passes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mark(device: torch.device):
    """A point in time: perf_counter on the CPU; on CUDA an event recorded on the stream,
    read only when the reply ends (timing adds no host sync to a round)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _Clock:
    """A reply's draft and verify time: spans between marks, summed at the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: dict[str, list] = {"draft": [], "verify": []}

    def add(self, phase: str, start) -> None:
        self.spans[phase].append((start, _mark(self.device)))

    def seconds(self, phase: str) -> float:
        if self.device.type != "cuda":
            return sum(end - start for start, end in self.spans[phase])
        _sync(self.device)
        return sum(start.elapsed_time(end) for start, end in self.spans[phase]) / 1e3


class _StopRule:
    def __init__(self, config: DecodeConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos = set(config.eos_token_ids)

    def cut(self, generated: list[int], new_from: int) -> tuple[int, str | None]:
        """Length to keep and why the turn ends (None: it goes on). Tokens a round accepted
        past max_new_tokens are never looked at: AR would not have produced them."""
        limit = min(len(generated), self.config.max_new_tokens)
        for i in range(new_from, limit):
            if generated[i] in self.eos:
                return i + 1, "eos"
        if self.config.stop_strings and self.tokenizer is not None:
            for i in range(new_from, limit):  # earliest token completing a stop string
                tail = self.tokenizer.decode(generated[max(0, i - 16): i + 1])
                if any(s in tail for s in self.config.stop_strings):
                    return i + 1, "stop_string"
        if len(generated) >= self.config.max_new_tokens:
            return self.config.max_new_tokens, "length"
        return len(generated), None


class _Request:
    """One reply in progress: its state, drafter, stop rule and counters. The batch-1 loop
    and the batched loop drive the same rounds: propose, (the target pass), settle."""

    def __init__(self, drafter: Drafter, prompt: list[int], prefill: ForwardOutput, config: DecodeConfig,
                 engine: Engine, generator: torch.Generator | None, tokenizer, started: float) -> None:
        self.drafter, self.config, self.generator = drafter, config, generator
        self.stop = _StopRule(config, tokenizer)
        first = sample(prefill.logits[-1], config.sampling, generator)
        _sync(engine.device)
        self.started, self.first_at = started, time.perf_counter()
        self.state = DecodeState(tokens=list(prompt) + [first], prompt_len=len(prompt), engine=engine,
                                 config=config, generator=generator)
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.sizes: list[int] = []
        self.clock = _Clock(engine.device)
        self.keep, self.reason = self.stop.cut(self.state.generated, 0)
        if self.reason is None:
            began = _mark(engine.device)
            drafter.begin(self.state, prefill)
            self.clock.add("draft", began)

    @property
    def done(self) -> bool:
        return self.reason is not None

    def propose(self) -> tuple[Draft, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """The round's draft and its verification block (tokens, positions, mask)."""
        started = _mark(self.state.engine.device)
        draft = self.drafter.propose(self.state)
        self.clock.add("draft", started)
        return draft, draft.verify_inputs(self.state.root, 0)

    def settle(self, draft: Draft, out: ForwardOutput, keep, pass_started) -> None:
        """Accept from the pass's logits, keep the accepted K/V rows (`keep(rows)`), learn.
        Verification time: from `pass_started` (a _mark before the target pass) to the kept cache."""
        verdict = self.drafter.verify(draft, out.logits[: len(draft) + 1], self.config.sampling, self.generator)
        rows = [0] + [node + 1 for node in verdict.accepted]
        keep(rows)
        self.clock.add("verify", pass_started)
        before = len(self.state.generated)
        self.state.tokens += [draft.tokens[node] for node in verdict.accepted] + [verdict.next_token]
        self.proposed.append(max(draft.depths(), default=0))
        self.accepted.append(len(verdict.accepted))
        self.sizes.append(len(draft))
        self.keep, self.reason = self.stop.cut(self.state.generated, before)
        learned = _mark(self.state.engine.device)
        if self.reason is None:
            self.drafter.learn(self.state, draft, verdict, out, rows)
        self.clock.add("draft", learned)

    def result(self) -> TurnResult:
        _sync(self.state.engine.device)
        return TurnResult(
            tokens=self.state.generated[:self.keep], stop_reason=self.reason, ttft=self.first_at - self.started,
            decode_time=time.perf_counter() - self.first_at, draft_time=self.clock.seconds("draft"),
            verify_time=self.clock.seconds("verify"), proposed_lengths=self.proposed, accept_lengths=self.accepted,
            tree_sizes=self.sizes)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a turn decodes (it runs again after): its
    collections landed inside timed rounds, a few % of a one-token CPU step, on whichever
    round happened to trigger one (as inference servers do, e.g. vLLM's gc.freeze)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def decode(engine: Engine, drafter: Drafter, prompt: list[int], config: DecodeConfig,
           generator: torch.Generator | None = None, tokenizer=None) -> TurnResult:
    """Generate one reply to `prompt` with `drafter` proposing and the target verifying."""
    with _gc_paused():
        return _decode(engine, drafter, prompt, config, generator, tokenizer)


def _decode(engine: Engine, drafter: Drafter, prompt: list[int], config: DecodeConfig,
            generator: torch.Generator | None, tokenizer) -> TurnResult:
    _sync(engine.device)
    started = time.perf_counter()
    prefill = engine.prefill(torch.tensor(prompt), taps=drafter.taps,
                             capacity=len(prompt) + config.max_new_tokens + PASS_HEADROOM)
    request = _Request(drafter, prompt, prefill, config, engine, generator, tokenizer, started)
    while not request.done:
        draft, (tokens, positions, mask) = request.propose()
        t1 = _mark(engine.device)
        start = engine.length
        out = engine.forward(tokens, positions + start, mask, taps=drafter.taps)
        request.settle(draft, out, partial(engine.keep, start), t1)
    return request.result()


def decode_batch(engine: Engine, drafters: list[Drafter], prompts: list[list[int]], config: DecodeConfig,
                 generators: list[torch.Generator | None] | None = None, tokenizer=None) -> list[TurnResult]:
    """Replies to every prompt, len(drafters) at a time: one target pass per round verifies
    every live request's draft (bench.core.batch), and a finished request's slot takes the
    next prompt at once (continuous batching). Drafters are per slot, reused request after
    request as the batch-1 loop reuses its one."""
    with _gc_paused():
        return _decode_batch(engine, drafters, prompts, config, generators, tokenizer)


def _decode_batch(engine: Engine, drafters: list[Drafter], prompts: list[list[int]], config: DecodeConfig,
                  generators: list[torch.Generator | None] | None, tokenizer) -> list[TurnResult]:
    from bench.core.batch import TargetBatch

    generators = generators or [None] * len(prompts)
    taps = drafters[0].taps
    batch = TargetBatch(engine, len(drafters), max(map(len, prompts)) + config.max_new_tokens + PASS_HEADROOM)
    queue = list(range(len(prompts)))
    live: dict[int, tuple[int, _Request]] = {}  # slot -> (prompt index, request)
    loads: dict[int, list[int]] = {}
    results: list[TurnResult | None] = [None] * len(prompts)
    _sync(engine.device)
    run_started = time.perf_counter()

    def finish(index: int, request: _Request, admitted: float) -> None:
        result = request.result()
        result.queued = admitted - run_started
        result.load = sum(loads.get(index, [1])) / len(loads.get(index, [1]))
        results[index] = result

    admitted: dict[int, float] = {}
    while queue or live:
        for slot in range(len(drafters)):
            while slot not in live and queue:
                index = queue.pop(0)
                admitted[index] = started = time.perf_counter()
                prefill = batch.start(slot, prompts[index], taps)
                request = _Request(drafters[slot], prompts[index], prefill, config, engine, generators[index],
                                   tokenizer, started)
                if request.done:
                    finish(index, request, started)
                else:
                    live[slot] = (index, request)
        if not live:
            break
        slots = sorted(live)
        proposals = [live[slot][1].propose() for slot in slots]
        starts = [batch.lengths[slot] for slot in slots]
        pass_started = _mark(engine.device)
        outputs = batch.forward(slots, [block for _, block in proposals], taps)
        for slot, start, (draft, _), out in zip(slots, starts, proposals, outputs):
            index, request = live[slot]
            loads.setdefault(index, []).append(len(slots))
            request.settle(draft, out, partial(batch.keep, slot, start), pass_started)
            if request.done:
                finish(index, request, admitted[index])
                del live[slot]
    return results


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

    def run_batch(self, prompts: list[list[int]], config: DecodeConfig, batch_size: int,
                  generators: list[torch.Generator | None] | None = None) -> list[TurnResult]:
        """Replies to `prompts`, `batch_size` requests decoding at once (decode_batch); each
        slot has its own drafter (Drafter.fork)."""
        drafters = [self.drafter] + [self.drafter.fork() for _ in range(min(batch_size, len(prompts)) - 1)]
        return decode_batch(self.target.engine, drafters, prompts, config, generators, self.target.tokenizer)
