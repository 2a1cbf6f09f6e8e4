"""Training EAGLE heads on cached target features (bench.training.features).

EAGLE-1: input (f_t + noise, x_{t+1}) -> predicted f_{t+1}. Loss = SmoothL1(f̂, f) +
0.1 * soft-CE(target probs of x_{t+2}, lm_head(f̂)), the paper's v_w=1 / p_w=0.1, with
uniform input noise U(-0.1, 0.1) scaled by the feature RMS (our features are the target's
normed states, whose scale is set by its final norm weights, not ~1 as for Llama).

EAGLE-3, training-time test of `ttt_steps` steps: step 0 runs on fused target layers;
step i feeds back step i-1's outputs with the true tokens shifted by i, and its queries
see step-0 keys causally plus the same position's keys of steps 1..i (what a depth-i
tree node sees at decode time), at RoPE position t+i. Loss = sum_i 0.8^i soft-CE over the
draft vocabulary vs the target's probabilities restricted to it; positions whose target
argmax lies outside the draft vocabulary are masked out. No feature loss.

Labels are always the target's own next-token distribution, softmax(lm_head(h_L)),
computed from the cached final states: the drafter learns what the target would say.
Only positions whose predicted token belongs to an assistant reply are scored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.drafters import WEIGHTS, write_drafter
from bench.core.errors import BenchError
from bench.training import without_later_defaults
from bench.training.features import FeatureData, ensure_features, training_manifest
from bench.training.vocab_rows import agrees, soft_cross_entropy
from methods.eagle.model import EagleConfig, EagleHead

FORMAT = "spec-bench-eagle/1"
HELDOUT_FRACTION = 0.02
GROUP_BATCHES = 50  # group_by_length: batches per length-sorted chunk (HF's megabatch of 50)
# Held-out positions whose full-vocabulary teacher logits are formed at a time (a batch of four
# 1024-token conversations at once is [4, 1024, 49,152] fp32, 0.8 GB, beside a trainer).
TEACHER_CHUNK_POSITIONS = 256
RANKS = 10


def eagle3_taps(num_layers: int) -> list[int]:
    """Hidden states entering layers 2, L/2 and L-3 (EAGLE-3's low/mid/high), in tap numbering."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class EagleTrainSettings:
    ttt_steps: int = 3  # eagle3: unrolled draft steps (paper: 7; fewer to fit a CPU hour)
    step_decay: float = 0.8  # eagle3: weight of step i is decay^i
    draft_vocab: int = 16384  # eagle3: draft vocabulary size (0 = the full target vocabulary)
    draft_vocab_coverage: float = 0.0  # eagle3, > 0: the fewest tokens covering this share of reply tokens
    #                                    (at most draft_vocab), as EAGLE-3 sizes it by token frequency
    feature_weight: float = 1.0  # eagle1: SmoothL1 weight (v_w)
    token_weight: float = 0.1  # eagle1: soft-CE weight (p_w)
    noise: float = 0.1  # eagle1: uniform noise half-width, relative to the feature RMS
    ce_fraction: float = 0.25  # eagle1: share of scored positions that also get the soft-CE term (its
    #                            lm_head forward and backward are most of a CPU step; the subsample is unbiased)
    feature_tokens: int = FeatureData.max_tokens  # size of the feature cache (tokens)
    max_len: int = FeatureData.max_len
    self_distill: bool = False  # train on the target's own greedy replies to ShareGPT prompts
    shared_lm_head: bool = False  # eagle3: the target's lm_head rows, frozen, not stored (a named deviation)
    fc_norm: bool = False  # eagle3: an RMSNorm per tap before fc (SpecForge's EAGLE-3.1, a named option:
    #                        the paper's taps of this target differ ~9x in scale, results/README)
    taps: str = ""  # eagle3: the target layers fused, e.g. "2,15,30" (HF hidden_states numbering; a named
    #                 deviation); "" = the paper's low/mid/high, eagle3_taps
    group_by_length: bool = False  # batches of like lengths (HF Trainer's group_by_length): at max_len 1024
    #                                random batches of 4 are ~28% padding, and their attention ~42%



def parse_taps(text: str, num_layers: int) -> list[int]:
    """`--option taps=2,15,30`: distinct layers in 1..num_layers, in the order given."""
    try:
        taps = [int(t) for t in text.split(",")]
    except ValueError:
        raise BenchError(f"taps must be layer numbers separated by commas, got '{text}'") from None
    if len(set(taps)) != len(taps) or not all(1 <= t <= num_layers for t in taps):
        raise BenchError(f"taps must be distinct layers between 1 and {num_layers}, got '{text}'")
    return taps


class FeatureBatches:
    """Whole conversations from the feature cache, padded on the right, in a seeded
    order: batch at cursor c is the same in a resumed run."""

    def __init__(self, tensors: dict[str, Tensor], taps: list[int], final_tap: int, batch_size: int,
                 seed: int, group_by_length: bool = False) -> None:
        self.tensors = tensors
        self.group_by_length = group_by_length
        self._orders: dict[int, list[int]] = {}
        self.taps = taps
        self.final_tap = final_tap
        self.batch_size = batch_size
        offsets = tensors["offsets"].tolist()
        spans = [(a, b) for a, b in zip(offsets[:-1], offsets[1:]) if b - a >= 4]
        held = max(1, int(len(spans) * HELDOUT_FRACTION))
        self.train_spans, self.heldout_spans = spans[:-held], spans[-held:]
        self.seed = seed

    def order(self, epoch: int) -> list[int]:
        """The epoch's conversations, batch by batch. Grouped by length: the shuffled order cut
        into chunks of GROUP_BATCHES batches, each chunk sorted by length and cut into batches,
        and the batches shuffled, so a batch holds conversations of about one length."""
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            order = torch.randperm(len(self.train_spans), generator=generator).tolist()
            if self.group_by_length:
                size, chunk = self.batch_size, self.batch_size * GROUP_BATCHES
                length = [b - a for a, b in self.train_spans]
                batches = []
                for start in range(0, len(order), chunk):
                    ranked = sorted(order[start: start + chunk], key=lambda j: -length[j])
                    batches += [ranked[i: i + size] for i in range(0, len(ranked), size)]
                full = [b for b in batches if len(b) == size]  # a short batch would shift the ones after it
                shuffled = torch.randperm(len(full), generator=generator).tolist()
                order = [j for k in shuffled for j in full[k]] + [j for b in batches if len(b) < size for j in b]
            self._orders = {epoch: order}  # one epoch at a time
        return self._orders[epoch]

    def batch(self, spans: list[tuple[int, int]]) -> dict[str, Tensor]:
        width = max(b - a for a, b in spans)
        out = {"tokens": torch.zeros(len(spans), width, dtype=torch.long),
               "mask": torch.zeros(len(spans), width, dtype=torch.bool),
               "lengths": torch.tensor([b - a for a, b in spans])}
        for tap in sorted(set(self.taps) | {self.final_tap}):
            out[f"h{tap}"] = torch.zeros(len(spans), width, self.tensors[f"h{tap}"].shape[1])
        for row, (a, b) in enumerate(spans):
            out["tokens"][row, : b - a] = self.tensors["tokens"][a:b]
            out["mask"][row, : b - a] = self.tensors["loss_mask"][a:b]
            for tap in sorted(set(self.taps) | {self.final_tap}):
                out[f"h{tap}"][row, : b - a] = self.tensors[f"h{tap}"][a:b].float()
        return out

    def next_batch(self, cursor: int) -> tuple[dict[str, Tensor], int]:
        per_epoch = len(self.train_spans) // self.batch_size
        if per_epoch == 0:
            raise BenchError("feature cache has fewer conversations than one batch")
        epoch, index = divmod(cursor, per_epoch)
        order = self.order(epoch)[index * self.batch_size: (index + 1) * self.batch_size]
        return self.batch([self.train_spans[i] for i in order]), cursor + 1


def shifted(x: Tensor, by: int, fill: float | int | bool = 0) -> Tensor:
    """x[:, t + by] at position t (dim 1), `fill` past the end."""
    if by == 0:
        return x
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat([x[:, by:], pad], dim=1)


class EagleObjective:
    """Loss of one batch for either kind; `named_parameters` are the head's trainable ones."""

    def __init__(self, head: EagleHead, embed: Tensor, lm_head: Tensor, final_tap: int,
                 settings: EagleTrainSettings, autocast: bool = False, compile: bool = False) -> None:
        self.autocast = autocast  # bf16 matmuls; fp32 master weights and softmaxes
        # EAGLE-3's layer step, scoring and teacher through torch.compile (inductor): on a CPU the
        # unfused attention's masks, casts and softmax over [B, H, T, T] and the vocabulary-wide
        # passes cost more than the matmuls. Shapes dynamic (one layer graph per step count); the
        # same functions either way.
        compiled = (lambda f: torch.compile(f, dynamic=True)) if compile else (lambda f: f)
        self.layer, self.score, self.teacher = (compiled(f) for f in (self._ttt_layer, self._score, self._teacher))
        self.head = head
        self.embed = embed
        self.lm_head = lm_head
        self.final_tap = final_tap
        self.settings = settings
        self.generator = torch.Generator().manual_seed(1234)

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return [(n, p) for n, p in self.head.named_parameters() if p.requires_grad]

    def labels(self, batch: dict[str, Tensor], by: int) -> tuple[Tensor, Tensor]:
        """Valid mask [B, T] and target log-probs source rows for predicting token t+1+by+1:
        the target's distribution at row t+1+by."""
        final = batch[f"h{self.final_tap}"]
        lengths = batch["lengths"][:, None]
        positions = torch.arange(final.shape[1], device=final.device)[None]
        valid = (positions + 1 + by < lengths) & shifted(batch["mask"], 1 + by, False)
        return valid, shifted(final, 1 + by)

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        batch = {k: v.to(self.embed.device) for k, v in batch.items()}
        with torch.autocast(self.embed.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.head.config.kind == "eagle3":
                return self._loss_eagle3(batch)
            return self._loss_eagle1(batch)

    def _loss_eagle1(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        s = self.settings
        features = batch[f"h{self.final_tap}"]
        tokens = batch["tokens"]
        rms = features.pow(2).mean().sqrt()
        noise = (torch.rand(features.shape, generator=self.generator).to(features.device) * 2 - 1) * s.noise * rms
        next_embeds = F.embedding(shifted(tokens, 1), self.embed)
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        hidden = self.head.fuse([features + noise], next_embeds)
        predicted = self.head.forward_train(hidden, next_embeds, positions)
        valid, target_features = self.labels(batch, 0)
        if not valid.any():
            return predicted.sum() * 0.0, {"tokens": 0}
        f_hat, f = predicted[valid], target_features[valid]
        feature_loss = F.smooth_l1_loss(f_hat.float(), f)
        scored = (torch.rand(f.shape[0], generator=self.generator) < s.ce_fraction).to(f.device)
        scored[0] = True  # never an empty CE batch
        with torch.no_grad():
            target_probs = F.linear(f[scored], self.lm_head).float().softmax(-1)
        log_q = F.linear(f_hat[scored], self.lm_head).float().log_softmax(-1)
        token_loss = -(target_probs * log_q).sum(-1).mean()
        loss = s.feature_weight * feature_loss + s.token_weight * token_loss
        acc = float((log_q.argmax(-1) == target_probs.argmax(-1)).float().mean())
        return loss, {"feature": float(feature_loss.detach()), "ce": float(token_loss.detach()), "acc": acc,
                      "tokens": int(valid.sum())}

    def _ttt_layer(self, hidden: Tensor, embeds: Tensor, positions: Tensor, k0: Tensor | None, v0: Tensor | None,
                   diagonal: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """One training-time-test step of the layer: (its output, its k, its v). Step 0 (k0 None)
        attends causally to its own keys; step i also to the same position's keys of steps 1..i."""
        q, k, v = self.head.qkv(hidden, embeds, positions)
        if k0 is None:
            k0, v0 = k, v
        else:
            diagonal = [*diagonal, (k, v)]
        return self.head.finish(hidden, self._ttt_attention(q, k0, v0, diagonal)), k, v

    def _teacher(self, final: Tensor, draft_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The target's greedy token at each of these final states, its distribution restricted
        to the draft vocabulary, and whether that token lies in it."""
        full = F.linear(final, self.lm_head).float()
        argmax = full.argmax(-1)
        return argmax, full[:, draft_ids].softmax(-1), torch.isin(argmax, draft_ids)

    def _score(self, out: Tensor, probs: Tensor, in_vocab: Tensor, greedy: Tensor) -> tuple[Tensor, Tensor]:
        """One step's soft cross-entropy against the target's probabilities over the draft
        vocabulary, averaged where the target's argmax lies in it, and where the head's argmax
        is the target's greedy token (never where that lies outside the draft vocabulary)."""
        logits = self.head.logits(out, self.lm_head).float()
        ce = (soft_cross_entropy(logits, probs) * in_vocab).sum() / in_vocab.sum()
        return ce, in_vocab & agrees(logits.detach(), greedy)

    def _ttt_attention(self, q: Tensor, k0: Tensor, v0: Tensor, diagonal: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Queries [B,H,T,hd] over step-0 keys (causal) and the same position's keys of
        later steps (diagonal). Keys/values [B,Hkv,T,hd] are expanded for GQA."""
        groups = q.shape[1] // k0.shape[1]
        expand = (lambda x: x.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda x: x)
        scale = q.shape[-1] ** -0.5
        scores = torch.matmul(q, expand(k0).transpose(-1, -2)) * scale
        width = q.shape[2]
        causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        extra = [(q * expand(k)).sum(-1, keepdim=True) * scale for k, _ in diagonal]
        weights = torch.cat([scores] + extra, dim=-1).float().softmax(-1)
        out = torch.matmul(weights[..., :width], expand(v0))
        for j, (_, v) in enumerate(diagonal):
            out = out + weights[..., width + j: width + j + 1] * expand(v)
        return out

    def _loss_eagle3(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        s = self.settings
        head = self.head
        tokens = batch["tokens"]
        draft_ids = head.draft_to_target
        hidden = head.fuse([batch[f"h{t}"] for t in head.config.taps], None)
        base_positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        diagonal: list[tuple[Tensor, Tensor]] = []
        k0 = v0 = None
        total = torch.zeros((), device=tokens.device)
        weight_sum = 0.0
        metrics: dict[str, float] = {}
        # The target's distribution over the draft vocabulary at every label row, once (row t+1
        # holds position t's label; step i reads it i rows further on), and whether its argmax
        # lies in the draft vocabulary.
        final = batch[f"h{self.final_tap}"]
        any_valid = self.labels(batch, 0)[0]
        with torch.no_grad():
            rows = torch.zeros_like(any_valid)
            rows[:, 1:] = any_valid[:, :-1]
            argmax_rows, probs_rows, in_vocab_rows = self.teacher(final[rows], draft_ids)
            row_index = torch.full(rows.shape, -1, dtype=torch.long, device=rows.device)
            row_index[rows] = torch.arange(int(rows.sum()), device=rows.device)
        for step in range(s.ttt_steps):
            embeds = F.embedding(shifted(tokens, 1 + step), self.embed)
            out, k, v = self.layer(hidden, embeds, base_positions + step, k0, v0, diagonal)
            if step == 0:
                k0, v0 = k, v
            else:
                diagonal.append((k, v))
            valid, _ = self.labels(batch, step)
            valid = valid & shifted(rows, 1 + step, False)
            with torch.no_grad():
                at_batch, at_row = valid.nonzero(as_tuple=True)  # labels at row t+1+step (< length)
                label = row_index[at_batch, at_row + 1 + step]
                in_vocab = in_vocab_rows[label]
            if in_vocab.any():
                greedy = torch.searchsorted(draft_ids, argmax_rows[label]).clamp(max=draft_ids.numel() - 1)
                ce, agree = self.score(out[valid], probs_rows[label], in_vocab, greedy)
                total = total + s.step_decay ** step * ce
                weight_sum += s.step_decay ** step
                metrics[f"acc{step}"] = float(agree.float().mean())
                metrics[f"ce{step}"] = float(ce.detach())
            hidden = out
        metrics["acc"] = metrics.get("acc0", 0.0)
        metrics["tokens"] = int(self.labels(batch, 0)[0].sum())
        return total / max(weight_sum, 1e-9), metrics


@torch.no_grad()
def rank_accuracy(objective: EagleObjective, batches: FeatureBatches, limit: int = 64,
                  keep: int | None = None) -> tuple[dict, dict]:
    """Held-out, teacher-forced: share of positions where the target's argmax is the
    head's rank-r draft token (r < RANKS), per unrolled step (ttt_steps of them; EAGLE-1
    feeds each step its own predicted feature, as it drafts). Step 0 drives EAGLE-1's static
    tree; all are reported in the manifest.

    Also the greedy rounds of a chain of the head's top-1 drafts, as deep as the steps
    unrolled, replayed on the same replies (whole, and with `keep` cut to each reply's first
    `keep` tokens): step s at row t is the chain rooted at t drafting token t+2+s from its own
    earlier states and, while it has been right, the data's tokens, which is what the unrolled
    pass computes, so the replay is exact (tests/test_eagle.py checks both kinds)."""
    from bench.training import (
        by_cut,
        first_reply_tokens,
        replay_cuts,
        round_starts,
        rounds_prediction,
        simulated_rounds,
    )

    head = objective.head
    counts: dict[int, Tensor] = {}
    totals: dict[int, int] = {}
    cuts = replay_cuts(keep)
    rounds = {cut: [0, 0, 0] for cut in cuts}
    spans = batches.heldout_spans[:limit]
    for i in range(0, len(spans), 4):
        batch = {k: v.to(objective.embed.device) for k, v in batches.batch(spans[i: i + 4]).items()}
        tokens = batch["tokens"]
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        steps = objective.settings.ttt_steps
        eagle3 = head.config.kind == "eagle3"
        if eagle3:
            hidden = head.fuse([batch[f"h{t}"] for t in head.config.taps], None)
        else:
            embeds = F.embedding(shifted(tokens, 1), objective.embed)
            hidden = head.fuse([batch[f"h{objective.final_tap}"]], embeds)
        k0 = v0 = None
        diagonal: list[tuple[Tensor, Tensor]] = []
        # The target's next token at every row, once: step s scores against it shifted by 1+s.
        teacher = torch.cat([F.linear(h.float(), objective.lm_head).argmax(-1)
                             for h in batch[f"h{objective.final_tap}"].split(TEACHER_CHUNK_POSITIONS, dim=1)], dim=1)
        right = torch.zeros(steps, *tokens.shape, dtype=torch.bool)  # step s's top-1 right at row t
        for step in range(steps):
            embeds = F.embedding(shifted(tokens, 1 + step), objective.embed)
            if step and not eagle3:  # EAGLE-1 drafts on from fc([Emb(token); its predicted feature])
                hidden = head.fuse([hidden], embeds)
            out, k, v = objective._ttt_layer(hidden, embeds, positions + step, k0, v0, diagonal)
            if step == 0:
                k0, v0 = k, v
            else:
                diagonal.append((k, v))
            valid, _ = objective.labels(batch, step)
            target = shifted(teacher, 1 + step)[valid]
            logits = head.logits(out[valid], objective.lm_head).float()
            ranked = logits.topk(RANKS, dim=-1).indices
            if eagle3:
                ranked = head.draft_to_target[ranked]
            hits = (ranked == target[:, None])
            right[step][valid.cpu()] = hits[:, 0].cpu()
            counts[step] = counts.get(step, torch.zeros(RANKS, dtype=torch.long)) + hits.sum(0).cpu()
            totals[step] = totals.get(step, 0) + int(valid.sum())
            hidden = out
        for row, length in enumerate(batch["lengths"].tolist()):
            mask = batch["mask"][row, :length].cpu().bool()  # row t: token t+1 is a reply token
            for cut in cuts:
                reply = mask if cut is None else first_reply_tokens(mask, 0, cut)
                ahead = torch.cat([reply, torch.zeros(steps + 1, dtype=torch.bool)])
                chain = [(right[s, row, :length] & ahead[1 + s: 1 + s + length]).tolist() for s in range(steps)]
                found = simulated_rounds(chain, round_starts(reply).tolist())
                rounds[cut] = [a + b for a, b in zip(rounds[cut], found)]
    accuracy = {f"step{s}": [round(float(c) / max(1, totals[s]), 4) for c in counts[s]] for s in counts}
    replay = by_cut({cut: rounds_prediction(*found) for cut, found in rounds.items()})
    return accuracy, dict(replay, rounds_chain=f"top-1 chain, {len(counts)} deep")


@torch.no_grad()
def first_draft_probe(objective: EagleObjective, batches: FeatureBatches) -> dict:
    """EAGLE-1's first-draft top-1 agreement on the held-out conversations with its real
    context, and with the feature of the position before the anchor withheld (zero in that
    row's own input, every earlier row intact): the probe methods/dflash/training.py runs on
    the block drafters, at the same positions (every one here, a seeded sample there)."""
    head = objective.head
    if head.config.kind == "eagle3" or head.config.num_layers != 1:
        raise BenchError("first_draft_probe: EAGLE-1 heads of one layer only")
    hits = {"real": 0, "drop_previous": 0}
    total = 0
    for i in range(0, len(batches.heldout_spans), 4):
        batch = {k: v.to(objective.embed.device) for k, v in batches.batch(batches.heldout_spans[i: i + 4]).items()}
        tokens, features = batch["tokens"], batch[f"h{objective.final_tap}"]
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        embeds = F.embedding(shifted(tokens, 1), objective.embed)
        valid, _ = objective.labels(batch, 0)
        teacher = shifted(F.linear(features.float(), objective.lm_head).argmax(-1), 1)[valid]
        hidden = head.fuse([features], embeds)
        real = head.forward_train(hidden, embeds, positions)
        blind = head.fuse([torch.zeros_like(features)], embeds)  # the row's own feature withheld
        q, k, v = head.qkv(hidden, embeds, positions)
        q0, k0, v0 = head.qkv(blind, embeds, positions)
        attn = _earlier_keys_attention(q0, k, v, k0, v0)
        dropped = head.finish(blind, attn)
        for name, out in (("real", real), ("drop_previous", dropped)):
            drafted = head.logits(out[valid], objective.lm_head).argmax(-1)
            hits[name] += int((drafted == teacher).sum())
        total += int(valid.sum())
    return {**{k: round(h / max(1, total), 4) for k, h in hits.items()}, "positions": total}


def _earlier_keys_attention(q: Tensor, k: Tensor, v: Tensor, own_k: Tensor, own_v: Tensor) -> Tensor:
    """Row t's query over the keys of rows < t and its own key `own_k` (not k's row t)."""
    groups = q.shape[1] // k.shape[1]
    expand = (lambda x: x.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda x: x)
    k, v, own_k, own_v = expand(k), expand(v), expand(own_k), expand(own_v)
    scale = q.shape[-1] ** -0.5
    width = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    earlier = torch.ones(width, width, dtype=torch.bool, device=q.device).tril(-1)
    scores = scores.masked_fill(~earlier, float("-inf"))
    own = (q * own_k).sum(-1, keepdim=True) * scale
    weights = torch.cat([scores, own], dim=-1).float().softmax(-1).to(v.dtype)
    return weights[..., :width] @ v + weights[..., width:] * own_v


def _coerce(value, kind: type):
    """An --option value as the setting's type ('true'/'1' -> True for booleans)."""
    if kind is bool and isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise BenchError(f"expected true or false, got '{value}'")
        return value.lower() in ("true", "1")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise BenchError(f"expected a {kind.__name__}, got '{value}'") from None


def vocabulary_for_coverage(tokens: Tensor, mask: Tensor, vocab_size: int, coverage: float) -> int:
    """The fewest most-frequent tokens that make up `coverage` of the reply tokens."""
    if not 0.0 < coverage <= 1.0:
        raise BenchError(f"draft_vocab_coverage must be in (0, 1], got {coverage}")
    counts = torch.bincount(tokens[1:][mask[:-1]], minlength=vocab_size).float().sort(descending=True).values
    share = counts.cumsum(0) / counts.sum().clamp(min=1)
    return int((share < coverage).sum()) + 1


def draft_vocabulary(tokens: Tensor, mask: Tensor, size: int, vocab_size: int, always: list[int]) -> Tensor:
    """The `size` most frequent reply tokens of the training data (plus `always`), sorted."""
    labels = tokens[1:][mask[:-1]]
    counts = torch.bincount(labels, minlength=vocab_size).float()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return counts.topk(min(size, vocab_size)).indices.sort().values


def export_head(head: EagleHead, folder: Path, manifest: dict) -> None:
    """drafter.json + model.safetensors (bf16 weights; the draft vocabulary map as int64)."""
    tensors = {n: p.to(torch.bfloat16) for n, p in head.named_parameters()
               if not (head.config.shared_lm_head and n == "lm_head.weight")}  # rebuilt from the target on load
    if head.config.kind == "eagle3":
        tensors["draft_to_target"] = head.draft_to_target
    write_drafter(folder, tensors, dict(manifest, format=FORMAT, architecture=head.config.to_dict()))


def train_eagle(target, settings, kind: str, method: str) -> dict:
    """Train an EAGLE-1 or EAGLE-3 head for `target` into settings.out_dir (resumable)."""
    from bench.training import GRID_REPLY_TOKENS, heldout_prediction, loop

    known = set(EagleTrainSettings.__dataclass_fields__)
    unknown = sorted(set(settings.options) - known)
    if unknown:
        raise BenchError(f"unknown {method} training option '{unknown[0]}' (known: {', '.join(sorted(known))})")
    options = {k: _coerce(v, type(getattr(EagleTrainSettings, k))) for k, v in settings.options.items()}
    train_settings = EagleTrainSettings(**options)
    num_layers = target.config.num_hidden_layers
    if settings.compile and kind != "eagle3":
        raise BenchError("--compile is for EAGLE-3's training-time test (EAGLE-1 trains one step per position)")
    if train_settings.taps and kind != "eagle3":
        raise BenchError("taps is an EAGLE-3 option (EAGLE-1 reads the target's last layer)")
    taps = [num_layers] if kind != "eagle3" else (parse_taps(train_settings.taps, num_layers) if train_settings.taps
                                                  else eagle3_taps(num_layers))
    data = FeatureData(max_tokens=train_settings.feature_tokens, max_len=train_settings.max_len, seed=settings.seed,
                       self_distill=train_settings.self_distill,
                       data_path=str(settings.data_path) if settings.data_path else None)
    store = ensure_features(target, tuple(sorted(set(taps) | {num_layers})), data, progress=settings.progress,
                            run_dir=Path(settings.out_dir))
    tensors = store.load(tuple(sorted(set(taps) | {num_layers})))
    vocab = target.config.vocab_size
    draft_vocab = train_settings.draft_vocab if kind == "eagle3" and train_settings.draft_vocab else None
    if draft_vocab and train_settings.draft_vocab_coverage > 0:
        draft_vocab = min(draft_vocab, vocabulary_for_coverage(tensors["tokens"], tensors["loss_mask"], vocab,
                                                               train_settings.draft_vocab_coverage))
    config = EagleConfig.for_target(target.config, kind, taps, draft_vocab if draft_vocab and draft_vocab < vocab
                                    else None)
    if train_settings.shared_lm_head:
        if kind != "eagle3":
            raise BenchError("shared_lm_head is an EAGLE-3 option (EAGLE-1 always projects with the target's lm_head)")
        config.shared_lm_head = True
    if train_settings.fc_norm:
        if kind != "eagle3":
            raise BenchError("fc_norm is an EAGLE-3 option (EAGLE-1's fc reads one feature and a token)")
        config.fc_norm = True
    torch.manual_seed(settings.seed)
    head = EagleHead(config)
    if config.draft_vocab_size:
        head.draft_to_target.copy_(draft_vocabulary(tensors["tokens"], tensors["loss_mask"], config.draft_vocab_size,
                                                    vocab, target.eos_token_ids))
    engine = target.engine
    head.to(settings.device)
    embed, lm_head = (w.float().to(settings.device) for w in (engine.embed, engine.lm_head))
    objective = EagleObjective(head, embed, lm_head, num_layers, train_settings, settings.bf16_autocast(),
                               compile=settings.compile)
    batches = FeatureBatches(tensors, taps, num_layers, settings.batch_size, settings.seed,
                             group_by_length=train_settings.group_by_length)
    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": vocab}
    identity = {"method": method, "kind": kind, "target": target_info, "batch_size": settings.batch_size,
                "features": store.folder.name,
                "train": without_later_defaults(asdict(train_settings)),
                "bf16_autocast": settings.bf16_autocast()}
    cfg = settings.loop_config(len(batches.train_spans), grad_clip=0.5)
    out_dir = Path(settings.out_dir)
    if config.draft_vocab_size:
        vocab_file = out_dir / "draft_vocab.json"  # the map is data, not a parameter: keep it across resumes
        out_dir.mkdir(parents=True, exist_ok=True)
        if vocab_file.exists():
            head.draft_to_target.copy_(torch.tensor(json.loads(vocab_file.read_text())))
        else:
            vocab_file.write_text(json.dumps(head.draft_to_target.tolist()))

    if kind == "eagle3":
        # Start the head's own norm and lm_head as the target's (restricted to the draft
        # vocabulary): the layer then only has to land in the target's feature space.
        # A resumed run overwrites these with its checkpoint.
        with torch.no_grad():
            head.lm_head.weight.copy_(engine.lm_head[head.draft_to_target.to(engine.lm_head.device)])
            head.final_norm.copy_(engine.final_norm)
        head.lm_head.weight.requires_grad_(not config.shared_lm_head)

    def export(step: int) -> None:
        rows = loop.read_log(out_dir)
        head.eval()
        accuracy, replay = rank_accuracy(objective, batches, keep=GRID_REPLY_TOKENS)
        if kind != "eagle3" and config.num_layers == 1:
            replay["context_probe"] = first_draft_probe(objective, batches)
        head.train()
        manifest = {"method": method, "target": target_info, "weights": WEIGHTS, "heldout_rank_accuracy": accuracy,
                    "heldout": dict(heldout_prediction([accuracy[f"step{i}"][0] for i in range(len(accuracy))]),
                                    **replay),
                    "training": training_manifest(step, settings, train_settings, store, len(batches.train_spans),
                                                  rows, ("loss", "acc", "acc1", "acc2", "acc3"))}
        export_head(head, out_dir, manifest)

    head.train()
    return settings.run_loop(objective, batches.next_batch, cfg, identity, export, out_dir)
