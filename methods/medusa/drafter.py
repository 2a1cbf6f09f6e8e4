"""Medusa at decode time: the heads read the target's last hidden state, fill the static
tree, and the round is verified exactly (shared verifier) or by typical acceptance (lossy)."""

from __future__ import annotations

import torch
from torch import Tensor

from bench.core.decode import DecodeState, Drafter
from bench.core.draft import Draft
from bench.core.engine import ForwardOutput
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig, process_logits
from bench.core.verify import Verdict, verify, verify_greedy
from methods.medusa.model import METHOD, MedusaHeads
from methods.medusa.tree import Tree

ACCEPTANCE = ("exact", "typical")


def typical_acceptance(draft: Draft, logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
                       posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> Verdict:
    """Medusa's typical acceptance on a tree (LOSSY when sampling). logits: [n+1, V], row 0
    the root's. Node c passes if p_parent(token_c) > min(threshold, alpha * exp(-H(p_parent)));
    the deepest node whose whole path passes wins (ties: the larger sum of log p, then node
    order); the next token is drawn from p at that node, restricted to p >= the same cutoff
    (the likeliest token always kept). Greedy: the exact greedy walk, as in Medusa."""
    if cfg.greedy:
        return verify_greedy(draft, logits)
    probs = process_logits(logits, cfg).softmax(-1)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    cutoff = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    best, best_key = -1, (0, 0.0)
    score: list[tuple[int, float] | None] = []  # per node: (depth, log-likelihood) if its path passes
    if len(draft):
        rows = torch.tensor(draft.parents, device=probs.device) + 1
        p_token = probs[rows, torch.tensor(draft.tokens, device=probs.device)]
        passes = (p_token > cutoff[rows]).tolist()
        log_p = p_token.clamp(min=1e-30).log().tolist()
    for node, parent in enumerate(draft.parents):
        above = (0, 0.0) if parent < 0 else score[parent]
        ok = above is not None and passes[node]
        score.append((above[0] + 1, above[1] + log_p[node]) if ok else None)
        if ok and score[node] > best_key:
            best, best_key = node, score[node]
    accepted = []
    node = best
    while node >= 0:
        accepted.insert(0, node)
        node = draft.parents[node]
    row = best + 1
    floor = torch.minimum(cutoff[row], probs[row].max())  # the likeliest token always stays
    kept = torch.where(probs[row] >= floor, probs[row], torch.zeros_like(probs[row]))
    source = generator.device if generator is not None else kept.device
    next_token = int(torch.multinomial(kept.to(source), 1, generator=generator))
    return Verdict(accepted, next_token)


class MedusaDrafter(Drafter):
    name = METHOD

    def __init__(self, heads: MedusaHeads, lm_head: Tensor, tap: int, tree: Tree, acceptance: str = "exact",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        if acceptance not in ACCEPTANCE:
            raise BenchError(f"medusa acceptance '{acceptance}' unknown (choose from {', '.join(ACCEPTANCE)})")
        if tree.depth > heads.num_heads:
            raise BenchError(f"medusa tree depth {tree.depth} exceeds the drafter's {heads.num_heads} heads")
        self.heads, self.lm_head, self.tree = heads, lm_head, tree
        self.taps = (tap,)
        self.tap = tap
        self.acceptance = acceptance
        self.lossless = acceptance == "exact"  # typical acceptance changes the output distribution
        self.posterior_threshold, self.posterior_alpha = posterior_threshold, posterior_alpha
        self.ranks_needed = int(tree.ranks.max()) + 1 if len(tree.paths) else 1
        self.hidden: Tensor | None = None  # target state at the last committed row: its logits gave the root

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.hidden = prefill.hidden[self.tap][-1]

    @torch.inference_mode()
    def head_logits(self, hidden: Tensor, heads: int) -> Tensor:
        """[heads, V]: head i's logits for the token i+1 places after the root."""
        return self.heads.logits(hidden[None], self.lm_head, heads)[:, 0]

    def propose(self, state: DecodeState) -> Draft:
        room = state.config.max_new_tokens - len(state.generated) - 1  # the verify pass adds one itself
        depth = min(self.tree.depth, room)
        if depth < 1 or self.hidden is None:
            return Draft.empty()
        logits = self.head_logits(self.hidden, depth)
        return self.tree.draft(logits.topk(self.ranks_needed, dim=-1).indices.cpu(), depth)

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        self.hidden = out.hidden[self.tap][rows[-1]]

    def verify(self, draft: Draft, logits: Tensor, cfg: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        """Acceptance rule for the round (a runner hook: Drafter.verify)."""
        if self.acceptance == "typical":
            return typical_acceptance(draft, logits, cfg, generator, self.posterior_threshold, self.posterior_alpha)
        return verify(draft, logits, cfg, generator)


