"""Block drafting at decode time: DFlash chains, DDTree trees, DSpark scheduled chains.

Context. The drafter keeps, per draft layer, the keys/values of the fused target
features of every committed token whose features the target has computed: after the
prefill the prompt, after each verify pass the root and the accepted drafts. The root
(the last committed token) has no features yet; it is the block's anchor, at position
= the context length. The block itself is never cached: it is recomputed each round
(z-lab's dflash_generate crops its draft cache back to the context the same way).

Block. [root, MASK x n]: under z-lab's convention (the default) the n mask slots give n
drafts, the token at each slot's own position; a drafter with `sample_from_anchor` drafts
from the root's slot too (n+1 drafts from n+1 slots). A round drafts at most the trained
block's drafts, `block` (dflash, dspark) and the tokens still to generate; the pass runs
only the slots it needs, as z-lab's `verify_size = min(block_size, max_length - start)`.

One backbone pass gives every slot's logits U_i (over the draft vocabulary). Then:
- dflash: the argmax of each slot, a chain of `block` drafts. Deterministic drafts, so
  the shared verifier is lossless at any temperature (q is one-hot).
- ddtree (Ringel and Romano 2604.12989): a best-first tree on summed log-probs of the
  slots' top-k tokens under a node budget (a depth-d node takes slot d-1's k-th token,
  whatever its parent), verified in one pass with tree attention.
- dspark: tokens drawn left to right from U_i + W2 W1[x_{i-1}] (argmax when greedy); with
  sampling, q_i is exactly the warped softmax each token was drawn from. The confidence
  head's survival a_j = prod_{i<=j} c_i then sets how many drafts to verify.

Losslessness of the DSpark cut: whether slot j is verified depends on c_1..c_j, and c_i
depends on x_{i-1}, never on x_j itself nor on the target. Given the accepted prefix,
position j is then either drafted from q_j and rejection-sampled, or sampled from the
target directly: both give the target's distribution. With sampling, admission
stops at the first position that does not raise the expected throughput (DSpark paper,
App. A: searching further would let the decision about j depend on x_j); greedy decoding is
lossless whatever is drafted, so there the best cut over the whole block is taken.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.core.decode import DecodeState, Drafter
from bench.core.draft import Draft
from bench.core.engine import ForwardOutput, KVCache
from bench.core.sampling import process_logits, sample_from
from bench.core.verify import Verdict
from methods.dflash.model import BlockDraftModel


@dataclass
class BlockSettings:
    mode: str = "chain"  # "chain" (dflash) | "tree" (ddtree) | "scheduled" (dspark)
    block: int = 16  # drafts per round (<= the drafter's drafts per block)
    budget: int = 16  # tree: draft nodes
    schedule: str = "throughput"  # scheduled: "throughput" | "threshold" | "none"
    threshold: float = 0.5  # scheduled/threshold: cut at the first c_i below this


def ddtree(log_probs: Tensor, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Best-first tree from per-slot log-probs [slots, V]: (draft ids, parents, depths).

    A node at depth d (1-based) holds slot d-1's rank-r token; its score is the sum of its
    path's log-probs. Popping a node pushes its next sibling (rank r+1, same parent) and its
    first child (rank 0, depth d+1), so the heap holds the best unexpanded candidate of
    every frontier and nodes come out in order of score, parents before children."""
    slots = log_probs.shape[0]
    width = min(budget, log_probs.shape[1])
    values, ids = log_probs.topk(width, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap = [(-values[0][0], 0, 1, 0, -1)]  # (-score, tiebreak, depth, rank, parent)
    counter = 1
    while heap and len(tokens) < budget:
        negative, _, depth, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-negative)
        base = scores[parent] if parent >= 0 else 0.0
        if rank + 1 < width:
            heapq.heappush(heap, (-(base + values[depth - 1][rank + 1]), counter, depth, rank + 1, parent))
            counter += 1
        if depth < slots:
            heapq.heappush(heap, (-(scores[node] + values[depth][0]), counter, depth + 1, 0, node))
            counter += 1
    return tokens, parents, depths


def admit_by_throughput(survival: list[float], verify_seconds: list[float], draft_seconds: float,
                        look_ahead: bool = False) -> int:
    """Drafts to verify: admit slot j while the expected tokens per second
    (1 + sum_{i<=j} a_i) / (t_draft + t_v(j+1)) keeps rising; stop at the first drop.
    verify_seconds[k] = t_v(k) for k = 1..len(survival)+1 (index 0 unused).

    look_ahead: take the best j over the whole block instead. Only for greedy decoding,
    where the output is the target's argmax whatever is drafted: there the decision about
    slot j may depend on later slots (hence on x_j), and it pays where t_v(k) is not
    monotone (as on the development CPU: see the hardware profile in results/README.md)."""
    best = 1.0 / (draft_seconds + verify_seconds[1])
    expected = 1.0
    admitted = 0
    for j, a in enumerate(survival, start=1):
        expected += a
        value = expected / (draft_seconds + verify_seconds[j + 1])
        if value > best:
            best, admitted = value, j
        elif not look_ahead:
            break
    return admitted


class BlockDrafter(Drafter):
    def __init__(self, target, model: BlockDraftModel, settings: BlockSettings, name: str,
                 verify_seconds: list[float] | None = None) -> None:
        self.name = name
        self.model = model.eval().requires_grad_(False)
        self.settings = settings
        self.taps = tuple(model.config.taps)
        self.dtype = model.fc.weight.dtype
        self.embed = target.engine.embed
        self.vocab = model.draft_to_target.to(self.embed.device)
        # The target's lm_head rows of the draft vocabulary, in the drafter's dtype: a
        # round scores every slot, so this projection is most of a round's cost.
        self.lm_head = target.engine.lm_head[self.vocab].to(self.dtype)
        self.full_vocab = target.config.vocab_size
        self.verify_seconds = verify_seconds or []
        self.draft_seconds = 0.0  # running mean of the backbone pass (the scheduler's t_draft)
        self.last_confidences: list[float] = []
        self.cache = self._new_cache()
        self.pending: list[Tensor] = []
        self.last_context: Tensor | None = None  # the fused context row of the last committed position

    def _new_cache(self) -> KVCache:
        """K/V of the committed context in every drafter layer (the block's own rows are never kept)."""
        c = self.model.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 256, self.dtype, self.embed.device)

    # ------------------------------------------------------------ context
    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.cache = self._new_cache()
        self.pending = [prefill.hidden[t] for t in self.taps]

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        index = torch.tensor(rows, device=out.logits.device)
        self.pending = [out.hidden[t][index] for t in self.taps]

    def _extend_context(self) -> None:
        start = self.cache.length
        n = self.pending[0].shape[0]
        positions = torch.arange(start, start + n, device=self.embed.device)[None]
        context = self.model.context([f.to(self.dtype)[None] for f in self.pending])
        self.cache.append(self.model.context_kv(context, positions))
        if n:
            self.last_context = context[:, -1]
        self.pending = []

    def _backbone(self, root: int, drafts: int) -> Tensor:
        """Final hidden states [drafts, d] of the slots that draft, from one pass over the
        block anchored at the root: [root, MASK x drafts] (z-lab) or [root, MASK x
        (drafts-1)] (anchor drafts); a shorter block than trained near max_new_tokens or
        with a smaller `block`, as z-lab's dflash_generate."""
        first = self.model.config.first_draft_slot
        slots = drafts + first
        start = self.cache.length  # the root's position
        x = self.model.block_inputs(torch.tensor([root], device=self.embed.device), self.embed, slots,
                                    self.last_context)
        positions = torch.arange(start, start + slots, device=self.embed.device)[None]
        views = [self.cache.view(layer) for layer in range(self.model.config.num_layers)]
        return self.model.forward_block(x, positions, views)[0, first:]

    def drafts_for(self, state: DecodeState, wanted: int) -> int:
        """Drafts this round: `wanted`, at most a block's and the tokens still to generate."""
        left = state.config.max_new_tokens - len(state.generated)
        return max(1, min(wanted, self.model.config.drafts_per_block, left))

    # -------------------------------------------------------------- draft
    def propose(self, state: DecodeState) -> Draft:
        with torch.inference_mode():
            started = time.perf_counter()
            self._extend_context()
            tree = self.settings.mode == "tree"
            drafts = self.drafts_for(state, self.model.config.drafts_per_block if tree else self.settings.block)
            hidden = self._backbone(state.root, drafts)
            logits = self.model.logits(hidden, self.lm_head)  # U_i over the draft vocabulary
            if self.settings.mode == "scheduled":
                return self._scheduled(state, hidden, logits, started)
            if tree:
                tokens, parents, _ = ddtree(logits.log_softmax(-1), self.settings.budget)
                return Draft([int(self.vocab[t]) for t in tokens], parents)
            return Draft.chain(self.vocab[logits.argmax(-1)].tolist())

    def _scheduled(self, state: DecodeState, hidden: Tensor, logits: Tensor, started: float) -> Draft:
        model, sampling = self.model, state.config.sampling
        block = logits.shape[0]
        previous = state.root
        tokens: list[int] = []
        q_rows: list[Tensor] = []
        confidences: list[float] = []
        for i in range(block):
            markov = model.markov_state(torch.tensor(previous, device=logits.device)) if model.config.markov_rank \
                else None
            row = logits[i] + model.markov_bias(markov).float() if markov is not None else logits[i]
            if model.config.enable_confidence_head:
                confidences.append(float(torch.sigmoid(model.confidence_logit(hidden[i], markov).float())))
            if sampling.greedy:
                draft_id = int(row.argmax())
            else:
                q = process_logits(row, sampling).softmax(-1)
                draft_id = sample_from(q, state.generator)
                q_full = q.new_zeros(self.full_vocab)
                q_full[self.vocab] = q  # exactly the distribution the token was drawn from
                q_rows.append(q_full)
            previous = int(self.vocab[draft_id])
            tokens.append(previous)
        self.draft_seconds = 0.8 * self.draft_seconds + 0.2 * (time.perf_counter() - started) if self.draft_seconds \
            else time.perf_counter() - started
        self.last_confidences = confidences
        keep = self._cut(confidences, block, look_ahead=sampling.greedy)
        return Draft.chain(tokens[:keep], q=torch.stack(q_rows[:keep]) if q_rows and keep else None)

    def _cut(self, confidences: list[float], block: int, look_ahead: bool = False) -> int:
        settings = self.settings
        if not confidences or settings.schedule == "none":
            return block
        if settings.schedule == "threshold":
            below = [i for i, c in enumerate(confidences) if c < settings.threshold]
            return below[0] if below else block
        survival, running = [], 1.0
        for c in confidences:
            running *= c
            survival.append(running)
        return admit_by_throughput(survival, self.verify_seconds, self.draft_seconds, look_ahead)
