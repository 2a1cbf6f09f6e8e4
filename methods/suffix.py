"""SuffixDecoding (Oliaro et al. 2411.04975), as Arctic Inference and vLLM run it: no model,
drafts from suffix trees over the request's own tokens and the replies that came before.

Two trees, both truncated at `max_tree_depth` tokens per suffix, each node counting the
suffixes that pass through it:
- the request's tree: its prompt and its reply so far, one sequence;
- the global tree: every reply this decoder has produced (each its own sequence), the one in
  progress included (Arctic's `SuffixDecodingCache`; vLLM keeps up to 10,000 of them).
A round matches each suffix of the last `max_tree_depth` tokens (1, 2, ... tokens long, as
long as it occurs) in each tree, and from the matched node follows the most frequent child
(ties broken as Arctic's sibling lists order them), each draft's
probability estimate the product of count ratios along the way, until it falls below
`min_token_prob` or the draft reaches min(max_spec_tokens, max_spec_factor x match length +
max_spec_offset) tokens (the adaptive draft size). The draft's score is the sum of its
probabilities; the best score over match lengths and trees wins (ties: the longer match, the
request's tree). `tree=true` grows a tree instead of a path, best-first by probability
(Arctic's `use_tree_spec`). Drafts are deterministic: verification is the shared lossless one.

Defaults are vLLM's (`suffix_decoding_*` settings): depth 24, factor 1.0, offset 0, minimum
probability 0.1, drafts of up to 24 tokens. The global tree makes a reply depend on the order
of the replies before it in the run (never its tokens: those are the target's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft
from bench.core.options import DraftOptions, option, parse_options

METHOD = "suffix"
CONVENTION = "Arctic Inference suffix_decoding (SuffixDecodingCache.speculate), vLLM's defaults"


@dataclass(frozen=True)
class Options(DraftOptions):
    """max_tree_depth: longest suffix kept (and context matched); max_spec_tokens: most draft
    tokens a round; max_spec_factor / max_spec_offset: a match of m tokens drafts at most
    factor x m + offset; min_token_prob: stop a path where its estimate falls below this;
    tree: best-first token trees instead of one path; global_tree: also draft from the
    earlier replies of the run. --budget K: max_spec_tokens = K."""

    max_tree_depth: int = option(24, min=2)
    max_spec_tokens: int = option(24, min=1)
    max_spec_factor: float = option(1.0, min=0.0)
    max_spec_offset: float = option(0.0)
    min_token_prob: float = option(0.1, min=0.0, max=1.0)
    tree: bool = False
    global_tree: bool = True

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"max_spec_tokens": budget}

    def draft_budget(self) -> int | None:
        return self.max_spec_tokens


class Node:
    """A suffix-trie node: its children by token, and in `order` as Arctic's sibling list keeps
    them (count descending; among equal counts, by how they got there: see `_counted`)."""

    __slots__ = ("children", "order", "count", "depth", "token")

    def __init__(self, depth: int, token: int = -1) -> None:
        self.children: dict[int, Node] = {}
        self.order: list[Node] = []
        self.count = 0
        self.depth = depth
        self.token = token


def _counted(parent: Node, child: Node) -> None:
    """child.count += 1, moved as Arctic's `_increment_count` moves it: where the sibling
    before it has at most one more, it goes in front of that sibling's run of equal counts
    (the head of a run one higher, or of a run of its own in front of its old one)."""
    order = parent.order
    at = order.index(child)
    if at == 0 or order[at - 1].count > child.count + 1:
        child.count += 1
        return
    head, run = at - 1, order[at - 1].count
    while head > 0 and order[head - 1].count == run:
        head -= 1
    order.pop(at)
    child.count += 1
    order.insert(head, child)


class SuffixTree:
    """Every suffix of every sequence, each cut at max_depth tokens, in one trie; sequences
    grow at their end (extend), the suffixes still shorter than max_depth kept open."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node(0)
        self.open: dict[int, list[Node]] = {}  # per sequence: nodes where its open suffixes end

    def extend(self, sequence: int, tokens: list[int]) -> None:
        ends = self.open.setdefault(sequence, [])
        for token in tokens:
            grown = []
            for node in [*ends, self.root]:  # every open suffix, and the one starting here
                child = node.children.get(token)
                if child is None:  # a new child joins the end of the list, count 1
                    child = node.children[token] = Node(node.depth + 1, token)
                    child.count = 1
                    node.order.append(child)
                else:
                    _counted(node, child)
                if child.depth < self.max_depth:
                    grown.append(child)
            self.root.count += 1
            ends[:] = grown

    def match(self, context: list[int]) -> Node | None:
        node = self.root
        for token in context:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def speculate(self, context: list[int], options: Options) -> tuple[float, int, Draft]:
        """(score, match length, draft) of the best match of a suffix of `context`."""
        best = (0.0, 0, Draft.empty())
        for length in range(1, len(context)):
            node = self.match(context[len(context) - length:])
            if node is None:
                break
            most = max(0, min(options.max_spec_tokens,
                              int(length * options.max_spec_factor + options.max_spec_offset + 1e-6)))
            grow = self._tree if options.tree else self._path
            score, draft = grow(node, most, options.min_token_prob)
            if score >= best[0]:
                best = (score, length, draft)
        return best

    @staticmethod
    def _path(node: Node, most: int, min_prob: float) -> tuple[float, Draft]:
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < most:
            if not node.order:
                break
            child = node.order[0]
            prob *= child.count / node.count
            if prob < min_prob:
                break
            tokens.append(child.token)
            score += prob
            node = child
        return score, Draft.chain(tokens)

    @staticmethod
    def _tree(node: Node, most: int, min_prob: float) -> tuple[float, Draft]:
        """Best-first by probability, as Arctic's `_speculate_tree` walks its compressed tree:
        an item is a position after a node (its next token emitted at once where the node
        runs on in one edge, else its children queued, most likely first, while likely
        enough) or a child to emit; its queue is a binary heap ordered as std::priority_queue
        orders it, so ties fall the same way."""
        tokens, parents, score = [], [], 0.0
        heap = _Heap()
        heap.push((1.0, node, False, -1))  # (probability, node, emit it?, parent index)
        while heap.items and len(tokens) < most:
            prob, at, emit, parent = heap.pop()
            if not emit and _runs_on(at):  # still inside the edge: the next token, same probability
                at, emit = at.order[0], True
            if emit:
                tokens.append(at.token)
                parents.append(parent)
                score += prob
                heap.push((prob, at, False, len(tokens) - 1))
                continue
            for child in at.order:
                p = prob * child.count / at.count
                if p < min_prob:
                    break
                heap.push((p, child, True, parent))
        return score, Draft(tokens=tokens, parents=parents)


def _runs_on(node: Node) -> bool:
    """Whether a compressed tree holds node and its next token in one edge: one child, and
    every suffix through the node goes on into it (none ends here). The root never does."""
    return node.depth > 0 and len(node.order) == 1 and node.order[0].count == node.count


class _Heap:
    """std::priority_queue with `a.prob < b.prob` (libstdc++'s push_heap / pop_heap), so that
    equal probabilities come out in the order the reference's queue gives them."""

    def __init__(self) -> None:
        self.items: list[tuple] = []

    def push(self, item: tuple) -> None:
        self.items.append(item)
        self._up(len(self.items) - 1, 0, item)

    def _up(self, hole: int, top: int, item: tuple) -> None:
        heap = self.items
        parent = (hole - 1) // 2
        while hole > top and heap[parent][0] < item[0]:
            heap[hole] = heap[parent]
            hole = parent
            parent = (hole - 1) // 2
        heap[hole] = item

    def pop(self) -> tuple:
        heap = self.items
        first = heap[0]
        if len(heap) > 1:
            value = heap[-1]
            length = len(heap) - 1
            hole = second = 0
            while second < (length - 1) // 2:
                second = 2 * (second + 1)
                if heap[second][0] < heap[second - 1][0]:
                    second -= 1
                heap[hole] = heap[second]
                hole = second
            if length % 2 == 0 and second == (length - 2) // 2:
                second = 2 * (second + 1)
                heap[hole] = heap[second - 1]
                hole = second - 1
            self._up(hole, 0, value)
        heap.pop()
        return first


class SuffixDrafter(Drafter):
    name = METHOD

    def __init__(self, options: Options) -> None:
        self.options = options
        self.global_tree = SuffixTree(options.max_tree_depth)  # shared by the forks of batched decoding
        self.replies = itertools.count()

    def begin(self, state: DecodeState, prefill) -> None:
        self._close_reply()
        self.state = state
        self.local = SuffixTree(self.options.max_tree_depth)
        self.local.extend(0, state.tokens[: state.prompt_len])
        self.reply = next(self.replies)
        self.seen = state.prompt_len  # tokens of state.tokens in the trees so far

    def _close_reply(self) -> None:
        """The last reply's tokens committed after its last round, into the global tree."""
        state = getattr(self, "state", None)
        if state is not None and self.options.global_tree:
            end = state.prompt_len + min(len(state.generated), state.config.max_new_tokens)
            if end > self.seen:
                self.global_tree.extend(self.reply, state.tokens[self.seen: end])
                self.seen = end

    def propose(self, state: DecodeState) -> Draft:
        new = state.tokens[self.seen:]
        if new:
            self.local.extend(0, new)
            if self.options.global_tree:
                self.global_tree.extend(self.reply, new)
            self.seen = len(state.tokens)
        context = state.tokens[-self.options.max_tree_depth:]
        score, _, draft = self.local.speculate(context, self.options)
        if self.options.global_tree:
            other, _, global_draft = self.global_tree.speculate(context, self.options)
            if other > score:
                draft = global_draft
        return draft

    def fork(self) -> Drafter:
        forked = SuffixDrafter.__new__(SuffixDrafter)
        forked.options, forked.global_tree, forked.replies = self.options, self.global_tree, self.replies
        return forked


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    return LoopDecoder(target, SuffixDrafter(parse_options(Options, options, METHOD)))
