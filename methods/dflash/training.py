"""Training block drafters (DFlash, DSpark) on cached target features.

Each step takes whole conversations from the feature cache and draws `anchors` random
anchor positions per conversation among reply positions (as SpecForge's and speculators'
`max_anchors`). The block anchored at a holds [x_a, MASK x (B-1)] at positions a..a+B-1;
it sees the fused target features strictly before a (the target has not run x_a yet at
decode time) and its own slots in both directions, never another block.

Which slot predicts what is the drafter's convention (methods/dflash/model.py):
- z-lab's (DFlash default): slot i >= 1 predicts x_{a+i}, the token at its own position;
  slot 0 (the anchor) is not scored;
- `sample_from_anchor` (DSpark default, as its paper): slot i predicts x_{a+i+1}.
Either way the k-th draft of a block (k = 0, 1, ..) is labelled with the data's token
there (`labels=data`, SpecForge's and DeepSpec's cross-entropy; on self-distilled data the
target's own greedy token) or with the target's distribution at the position before it,
softmax(lm_head(h_L)) (`labels=target`, soft distillation), restricted to the draft
vocabulary; only reply tokens are scored.

Losses, each weighted by exp(-k/decay) for the k-th draft (SpecForge's and speculators'
decay: exp(-(i-1)/gamma) for slot i under z-lab's convention; later drafts matter less,
being verified only if every earlier one survives):
- DFlash: cross-entropy.
- DSpark (its paper's eq. 9-12): 0.1 CE + 0.9 ||p_d - p_t||_1 on the Markov-corrected draft
  distribution p_d (teacher forcing: x_{i-1} is the data's token), plus
  BCE(c_i, 1 - TV(p_d, p_t)) for the confidence head, whose inputs are detached so it
  reads the backbone without steering it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from bench.core.drafters import WEIGHTS, write_drafter
from bench.core.errors import BenchError
from bench.training.features import FeatureData, ensure_features, training_manifest
from bench.training.vocab_rows import agrees
from methods.dflash.model import BlockConfig, BlockDraftModel, default_mask_token_id, zlab_taps
from methods.dflash.rounds import ARGMAX_CHUNK_ROWS, draft_argmax
from methods.eagle.training import FeatureBatches, _coerce, draft_vocabulary, vocabulary_for_coverage

FORMAT = "spec-bench-block-drafter/2"  # /1: legacy names and convention


@dataclass
class BlockTrainSettings:
    num_layers: int = 3  # DFlash uses 5 for 4-8B targets; 3 keeps a CPU run short and the shipped size small
    block_size: int = 16  # input slots per block, the anchor's included (z-lab's block_size)
    taps: int = 0  # target layers fused into the context; 0 = one per draft layer (z-lab's build_target_layer_ids)
    anchors: int = 24  # blocks per conversation per step (SpecForge / speculators: max_anchors 512)
    decay: float = 0.0  # gamma: the k-th draft weighs exp(-k/decay); 0 = by block size (7 for 16, 4 up to 10)
    draft_vocab: int = 0  # rows of the target's lm_head scored (0 = all, as z-lab; speculators' draft_vocab_size)
    sample_from_anchor: bool = False  # the anchor slot drafts too (B drafts per block; DSpark's default)
    mask_token_id: int = -1  # the mask slots' token (-1: the tokenizer's mask token, else see default_mask_token_id)
    markov_rank: int = 0  # DSpark: rank of the bigram correction (0 = DFlash)
    enable_confidence_head: bool = False  # DSpark: train the confidence head
    confidence_head_with_markov: bool = True  # DSpark: the confidence head also reads W1[x_{i-1}]
    # What the CE term pulls toward: "data" = the training data's next token (SpecForge's and
    # DeepSpec's convention; on self-distilled data that is the target's own greedy token);
    # "target" = the target's whole distribution at that position (soft distillation).
    labels: str = "data"
    ce_weight: float = 1.0
    l1_weight: float = 0.0  # DSpark: 0.9
    bce_weight: float = 0.0  # DSpark: 1.0 (speculators' confidence_head_alpha)
    # DSpark's confidence label: "sampled" = 1 - TV(draft, target), the chance a sampled draft
    # survives (the paper's); "greedy" = whether the draft's argmax is the target's, what a
    # T=0 verification accepts; "both" = their mean, one head for either temperature.
    confidence_label: str = "sampled"
    feature_tokens: int = FeatureData.max_tokens
    max_len: int = FeatureData.max_len
    self_distill: bool = False
    # The loss over at most this many scored slots at a time, each chunk's logits recomputed in
    # the backward pass (0: all at once): the logits are [slots, vocab] in fp32 several times over,
    # too much at the references' 512 anchors (a retired script measured both: results/ARCHIVE.md).
    loss_chunk_rows: int = 0
    # Keep only each draft layer's input for the backward pass (the rest recomputed there): the
    # attention scores of hundreds of blocks over the context are the bulk of the rest.
    checkpoint_layers: bool = False

    # Named deviations from the references' recipe (bench ablate measures each):
    tap_norm: bool = False  # an RMSNorm per tap before the fc (BlockConfig.tap_norm)
    learned_mask: bool = False  # the mask slots' input learned, from the target's mask-token row
    anchor_context: bool = False  # every block slot's input adds the context row of a-1 (BlockConfig)
    anchor_embedding: bool = False  # every mask slot's input adds the anchor's embedding (BlockConfig)
    # z-lab's scale of the block's input embeddings (1: off). Below 1 it shrinks what a slot's raw
    # embedding carries straight down the residual stream: with SmolLM2's lm_head tied to its
    # embeddings, that path alone makes every slot predict its own input token.
    input_embedding_scale: float = 1.0
    # The final norm's start: "target" copies the target's final norm (the shared lm_head's
    # scale); "ones", as the references (their drafter's norm starts at ones).
    norm_init: str = "target"
    vocab_coverage: float = 0.0  # > 0: draft_vocab is the fewest tokens covering this share of replies

    def slot_decay(self) -> float:
        return self.decay or max(4.0, (self.block_size - 2) / 2)


DSPARK_DEFAULTS = {"markov_rank": 64, "enable_confidence_head": True, "sample_from_anchor": True, "ce_weight": 0.1,
                   "l1_weight": 0.9, "bce_weight": 1.0}


class BlockObjective:
    def __init__(self, model: BlockDraftModel, embed: Tensor, lm_head: Tensor, final_tap: int,
                 settings: BlockTrainSettings, autocast: bool = False, compile: bool = False) -> None:
        self.autocast = autocast  # bf16 matmuls; fp32 master weights and softmaxes
        # The scored slots' terms through torch.compile (inductor, shapes dynamic): on a CPU their
        # unfused passes over [slots, vocabulary] (softmaxes, casts, L1, argmax) cost more than
        # the lm_head matmuls. The same function either way.
        self.terms = torch.compile(self.row_terms, dynamic=True) if compile else self.row_terms
        self.model = model
        self.embed = embed
        self.lm_head = lm_head  # the target's rows of the draft vocabulary [Vd, d]
        self.final_tap = final_tap
        self.settings = settings
        vocab = model.draft_to_target
        self.in_draft_vocab = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=embed.device)
        self.in_draft_vocab[vocab.to(embed.device)] = True
        self.draft_index = torch.zeros(model.config.vocab_size, dtype=torch.long, device=embed.device)
        self.draft_index[vocab.to(embed.device)] = torch.arange(len(vocab), device=embed.device)
        # exp(-k/decay) for the k-th draft of a block (slot k+1 under z-lab's convention, whose
        # anchor slot drafts nothing: SpecForge's exp(-(i-1)/gamma); slot k with sample_from_anchor)
        drafts = torch.arange(model.config.drafts_per_block, dtype=torch.float32, device=embed.device)
        self.slot_weights = torch.exp(-drafts / settings.slot_decay())

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def blocks(self, batch: dict[str, Tensor], hide: int = 0) -> dict[str, Tensor]:
        """Random anchors and everything indexed by them: slot positions [B, A, b], the row
        whose target distribution labels each slot (the position before its token), which
        slots are scored, and which context positions each slot sees [B, A*b, T] (before its
        anchor; and its own block: BlockDraftModel.forward_block's training layout).
        hide: the context's last `hide` positions before each anchor hidden too (a probe of
        what the drafter reads there; training hides none)."""
        tokens, mask, lengths = batch["tokens"], batch["mask"], batch["lengths"]
        size, width = tokens.shape
        b, count = self.model.config.block_size, self.settings.anchors
        first = self.model.config.first_draft_slot
        device = tokens.device
        positions = torch.arange(width, device=device)
        candidates = mask & (positions[None] >= 1)  # the first draft, x_{a+1}, is a reply token
        # Random scores, best `count` candidates per row: sampling without replacement. No more
        # blocks than the row with the most candidates has (512 anchors take every reply position:
        # blocks past that would be computed and never scored).
        scores = torch.rand(size, width, device=device).masked_fill(~candidates, -1.0)
        count = min(count, width, max(1, int(candidates.sum(1).max())))
        top, anchors = scores.topk(count, dim=1)
        anchor_ok = top >= 0
        slots = torch.arange(b, device=device)
        slot_positions = anchors[:, :, None] + slots
        # Slot i's token is x_{a+i} (z-lab) or x_{a+i+1} (anchor drafts): labelled by row a+i-1 / a+i.
        label_rows = slot_positions - first
        label_clamped = label_rows.clamp(min=0, max=width - 1)
        scored = (anchor_ok[:, :, None] & (slots >= first) & (label_rows + 1 < lengths[:, None, None])
                  & torch.gather(mask, 1, label_clamped.flatten(1)).view_as(label_clamped))
        drafted = (label_clamped + 1).clamp(max=width - 1)
        next_tokens = torch.gather(tokens, 1, drafted.flatten(1)).view_as(label_clamped)
        scored &= self.in_draft_vocab[next_tokens]  # a token outside the draft vocabulary cannot be drafted
        blocks = anchors.shape[1]
        sees_context = positions[None, None, :] < anchors[:, :, None] - hide  # [B, A, T]
        sees_context = sees_context[:, :, None, :].expand(size, blocks, b, width).reshape(size, blocks * b, width)
        # RoPE positions run past the sequence's end where a block does (a decode-time block would too)
        return {"anchors": anchors, "slot_positions": slot_positions, "label_rows": label_clamped, "scored": scored,
                "context_visible": sees_context}

    def forward(self, batch: dict[str, Tensor], hide: int = 0, mask_anchor: bool = False) -> dict[str, Tensor]:
        """The scored slots' hidden states and what labels them. Probes (held-out only): `hide`
        (blocks), `mask_anchor`: the anchor slot holds the mask input instead of the anchor token."""
        model, c = self.model, self.model.config
        blocks = self.blocks(batch, hide)
        size, width = batch["tokens"].shape
        context = model.context([batch[f"h{t}"] for t in c.taps])
        context_kv = model.context_kv(context, torch.arange(width, device=context.device)[None].expand(size, -1))
        anchor_tokens = torch.gather(batch["tokens"], 1, blocks["anchors"])
        previous = None
        if c.anchor_context:  # row a-1 of the fused context; zeros where the probe withholds it
            rows = (blocks["anchors"] - 1).clamp(min=0)
            previous = torch.gather(context, 1, rows[..., None].expand(-1, -1, context.shape[-1]))
            previous = torch.zeros_like(previous) if hide else previous
        if mask_anchor and c.anchor_embedding:  # the anchor token gone from every slot, not only slot 0
            anchor_tokens = torch.full_like(anchor_tokens, c.mask_token_id)
        x = model.block_inputs(anchor_tokens, self.embed, c.block_size, previous)
        if mask_anchor:
            x = torch.cat([x[..., 1:2, :], x[..., 1:, :]], dim=-2)
        x = x.flatten(1, 2)
        positions = blocks["slot_positions"].flatten(1)
        hidden = model.forward_block(x, positions, context_kv, context_visible=blocks["context_visible"],
                                     checkpoint_layers=self.settings.checkpoint_layers)
        scored = blocks["scored"].flatten(1)
        rows = blocks["label_rows"].flatten(1)[scored]
        batch_rows = torch.arange(size, device=x.device)[:, None].expand_as(positions)[scored]
        slots = torch.arange(c.block_size, device=x.device).repeat(blocks["anchors"].shape[1])[None].expand(size, -1)
        final = batch[f"h{self.final_tap}"][batch_rows, rows]
        # the token before each drafted one (the Markov head's x_{i-1}): the data's, at the label row
        return {"hidden": hidden[scored], "teacher": final, "previous": batch["tokens"][batch_rows, rows],
                "label": self.draft_index[batch["tokens"][batch_rows, rows + 1]],  # in the draft vocabulary (scored)
                "slots": slots[scored] - c.first_draft_slot}

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
        s, model = self.settings, self.model
        batch = {k: v.to(self.embed.device) for k, v in batch.items()}
        with torch.autocast(self.embed.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.forward(batch)
            if out["hidden"].shape[0] == 0:
                raise BenchError("no scored positions in a batch: the feature cache holds no replies")
            weights = self.slot_weights[out["slots"]]
            norm = weights.sum()
            rows = out["hidden"].shape[0]
            chunk = s.loss_chunk_rows if 0 < s.loss_chunk_rows < rows else rows
            parts = []
            for a in range(0, rows, chunk):
                inputs = (out["hidden"][a:a + chunk], out["teacher"][a:a + chunk], out["previous"][a:a + chunk],
                          out["label"][a:a + chunk], weights[a:a + chunk])
                if chunk < rows and torch.is_grad_enabled():  # this chunk's logits are freed until the backward
                    parts.append(checkpoint(self.terms, *inputs, use_reentrant=False))
                else:
                    parts.append(self.terms(*inputs))
            ce_sum, l1_sum, tv_sum, bce_sum, hits, conf_sum = (torch.cat(t) if i == 4 else sum(t[1:], t[0])
                                                                for i, t in enumerate(zip(*parts)))
            loss = s.ce_weight * ce_sum / norm
            metrics = {"ce": float(ce_sum.detach() / norm)}
            if self.distribution_terms():
                loss = loss + s.l1_weight * l1_sum / norm
                metrics["tv"] = float(0.5 * tv_sum / rows)
                if model.config.enable_confidence_head:
                    loss = loss + s.bce_weight * bce_sum / norm
                    metrics["bce"] = float(bce_sum.detach() / norm)
                    metrics["conf"] = float(conf_sum / rows)
        # tokens: reply positions of the batch's sequences (the data consumed; the scaling figure's x)
        metrics.update(loss=float(loss.detach()), acc=float(hits.mean()), tokens=float(batch["mask"].sum()))
        for slot in (0, 1, 3, 7):
            chosen = out["slots"] == slot
            if chosen.any():
                metrics[f"acc{slot}"] = float(hits[chosen].mean())
        return loss, metrics

    def distribution_terms(self) -> bool:
        """Whether the loss reads the teacher's whole distribution (DSpark's L1 and confidence terms)."""
        s = self.settings
        return bool(s.l1_weight or (self.model.config.enable_confidence_head and s.bce_weight))

    def row_terms(self, hidden: Tensor, teacher: Tensor, previous: Tensor, label: Tensor,
                  weights: Tensor) -> tuple[Tensor, ...]:
        """Scored slots' loss sums, weighted (CE, L1 to the teacher), the L1 unweighted, the
        confidence head's BCE weighted, whether each slot's argmax is the target's greedy token,
        and the sum of the confidence."""
        s, model = self.settings, self.model
        logits = model.logits(hidden, self.lm_head)
        p_teacher = None
        teacher_top = label  # the target's greedy token (the data's where the teacher's distribution is not read)
        if s.labels == "target" or self.distribution_terms():  # a third of the step's lm_head work: only when read
            with torch.no_grad():
                p_teacher = F.linear(teacher, self.lm_head).float().softmax(-1)
                teacher_top = p_teacher.argmax(-1)
        markov = model.markov_state(previous) if model.config.markov_rank else None
        if markov is not None:
            logits = logits + model.markov_bias(markov).float()
        hits = agrees(logits.detach(), teacher_top).float()  # the drafted token is the target's greedy one
        log_p = logits.log_softmax(-1)
        ce = -(p_teacher * log_p).sum(-1) if s.labels == "target" else F.nll_loss(log_p, label, reduction="none")
        zero = logits.new_zeros(())
        l1_sum = l1_plain = bce_sum = conf_sum = zero
        if self.distribution_terms():
            l1 = (log_p.exp() - p_teacher).abs().sum(-1)
            l1_sum, l1_plain = (weights * l1).sum(), l1.detach().sum()
            if model.config.enable_confidence_head:
                sampled = (1 - 0.5 * l1).detach().clamp(0, 1)
                target = {"sampled": sampled, "greedy": hits, "both": 0.5 * (sampled + hits)}[s.confidence_label]
                confidence = model.confidence_logit(hidden.detach(),
                                                    markov.detach() if markov is not None else None).float()
                bce = F.binary_cross_entropy_with_logits(confidence, target, reduction="none")
                bce_sum = (weights * bce).sum()
                conf_sum = torch.sigmoid(confidence.detach()).sum()
        return (weights * ce).sum(), l1_sum, l1_plain, bce_sum, hits, conf_sum


# The target's greedy token at each held-out position, kept in the training folder across exports
# and resumes: the same positions every export, and their lm_head pass is near half an export's work.
# A dot file, so neither `bench ship` nor the kept copies take it.
HELDOUT_TEACHER = ".heldout_teacher.pt"


def _fingerprint(features: Tensor) -> tuple[tuple[int, ...], float, float]:
    """What identifies a batch's teacher rows cheaply: their shape, sum and row-weighted sum."""
    rows = features.sum(-1, dtype=torch.float64)  # no float64 copy of an lm_head
    weights = torch.arange(len(rows), dtype=rows.dtype, device=rows.device)  # on CUDA too
    return tuple(features.shape), float(rows.sum()), float((rows * weights).sum())


def read_teacher_cache(path: Path) -> dict:
    try:
        cache = torch.load(path, weights_only=True)
    except Exception:  # absent or damaged: computed again
        return {}
    if not isinstance(cache, dict):
        return {}
    return {k: v for k, v in cache.items()
            if k == "lm_head" or (isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], Tensor))}


@torch.no_grad()
def heldout_slot_accuracy(objective: BlockObjective, batches: FeatureBatches,
                          teacher_cache: dict | None = None) -> dict:
    """Per-draft top-1 agreement with the target on held-out conversations (teacher-forced
    blocks, so draft k is scored as if drafts < k were right). `teacher_cache` (updated in
    place) holds the target's greedy tokens by batch, used where a batch's teacher rows and the
    lm_head are the ones they came from."""
    model = objective.model
    b = model.config.drafts_per_block
    hits, counts = torch.zeros(b), torch.zeros(b)
    cache = teacher_cache if teacher_cache is not None else {}
    head_key = _fingerprint(objective.lm_head)
    if cache.get("lm_head") != head_key:
        cache.clear()
        cache["lm_head"] = head_key
    state = torch.get_rng_state()
    torch.manual_seed(1234)  # the same held-out anchors at every export
    spans = batches.heldout_spans
    for i in range(0, len(spans), 4):
        batch = {k: v.to(objective.embed.device) for k, v in batches.batch(spans[i: i + 4]).items()}
        out = objective.forward(batch)
        drafted = draft_argmax(model, out["hidden"], out["previous"], objective.lm_head)
        key, cached = _fingerprint(out["teacher"]), cache.get(i)
        if cached is not None and cached[0] == key:
            teacher_top = cached[1].to(drafted.device)
        else:
            teacher_top = torch.cat([F.linear(rows, objective.lm_head).float().argmax(-1)
                                     for rows in out["teacher"].split(ARGMAX_CHUNK_ROWS)])
            cache[i] = (key, teacher_top.cpu())
        hit = (drafted == teacher_top).float().cpu()
        slots = out["slots"].cpu()
        hits.index_add_(0, slots, hit)
        counts.index_add_(0, slots, torch.ones_like(hit))
    torch.set_rng_state(state)
    return {"slot_accuracy": [round(float(h / max(1.0, n)), 4) for h, n in zip(hits, counts)],
            "positions": int(counts.sum())}


# The context probes: what the first draft's agreement becomes with position a-1 hidden from
# the context, and with the anchor token replaced by the mask input (EAGLE-1 has the same probe
# of its own, methods/eagle/training.py: first_draft_probe).
PROBES = {"real": {}, "drop_previous": {"hide": 1}, "anchor_masked": {"mask_anchor": True}}


@torch.no_grad()
def first_draft_probe(objective: BlockObjective, batches: FeatureBatches) -> dict:
    """Held-out top-1 agreement of each block's first draft under each of PROBES (the same
    seeded anchors for all), and the positions scored."""
    model = objective.model
    out: dict[str, float | int] = {}
    for name, probe in PROBES.items():
        hits = total = 0
        state = torch.get_rng_state()
        torch.manual_seed(4321)
        spans = batches.heldout_spans
        for i in range(0, len(spans), 4):
            batch = {k: v.to(objective.embed.device) for k, v in batches.batch(spans[i: i + 4]).items()}
            rows = objective.forward(batch, **probe)
            first = rows["slots"] == 0
            drafted = draft_argmax(model, rows["hidden"][first], rows["previous"][first], objective.lm_head)
            teacher = F.linear(rows["teacher"][first], objective.lm_head).float().argmax(-1)
            hits, total = hits + int((drafted == teacher).sum()), total + int(first.sum())
        torch.set_rng_state(state)
        out[name] = round(hits / max(1, total), 4)
        out["positions"] = total
    return out


def export_model(model: BlockDraftModel, folder: Path, manifest: dict) -> None:
    tensors = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    tensors["draft_to_target"] = model.draft_to_target
    write_drafter(folder, tensors, dict(manifest, format=FORMAT, architecture=model.config.to_dict()))


def mask_token_for(target, chosen: int, method: str) -> int:
    """The mask token of a new drafter: `chosen`, else the target's default (model.default_mask_token_id)."""
    vocab = target.config.vocab_size
    if chosen >= 0:
        if chosen >= vocab:
            raise BenchError(f"{method}: mask_token_id {chosen} is outside the target's vocabulary ({vocab})")
        return chosen
    found = default_mask_token_id(target.tokenizer, vocab)
    if found is None:
        raise BenchError(f"{method}: target '{target.name}' has no mask token and no spare embedding row: "
                         "choose a rarely used token with --option mask_token_id=N")
    return found


def train_block(target, settings, method: str, defaults: dict | None = None) -> dict:
    """Train a DFlash (or, with DSpark's defaults, a DSpark) drafter for `target`."""
    from bench.training import (
        GRID_REPLY_TOKENS,
        HELDOUT_ROUNDS_CONVERSATIONS,
        heldout_prediction,
        loop,
        without_later_defaults,
    )
    from methods.dflash.rounds import heldout_rounds

    known = set(BlockTrainSettings.__dataclass_fields__)
    unknown = sorted(set(settings.options) - known)
    if unknown:
        raise BenchError(f"unknown {method} training option '{unknown[0]}' (known: {', '.join(sorted(known))})")
    options = dict(defaults or {})
    options.update({k: _coerce(v, type(getattr(BlockTrainSettings, k))) for k, v in settings.options.items()})
    train_settings = BlockTrainSettings(**options)
    if train_settings.block_size < 2 or train_settings.anchors < 1 or train_settings.num_layers < 1:
        raise BenchError(f"{method}: block_size must be >= 2, anchors and num_layers >= 1")
    if train_settings.labels not in ("data", "target"):
        raise BenchError(f"{method}: labels must be data or target, got '{train_settings.labels}'")
    if train_settings.norm_init not in ("target", "ones"):
        raise BenchError(f"{method}: norm_init must be target or ones, got '{train_settings.norm_init}'")
    if not 0.0 <= train_settings.vocab_coverage <= 1.0:
        raise BenchError(f"{method}: vocab_coverage must be in [0, 1], got {train_settings.vocab_coverage}")
    if train_settings.confidence_label not in ("sampled", "greedy", "both"):
        raise BenchError(f"{method}: confidence_label must be sampled, greedy or both, "
                         f"got '{train_settings.confidence_label}'")
    num_layers = target.config.num_hidden_layers
    if not 0 <= train_settings.taps <= num_layers - 2:
        raise BenchError(f"{method}: taps must be in 0..{num_layers - 2} (0: one per draft layer)")
    taps = zlab_taps(num_layers, train_settings.taps or train_settings.num_layers)
    mask_token = mask_token_for(target, train_settings.mask_token_id, method)
    data = FeatureData(max_tokens=train_settings.feature_tokens, max_len=train_settings.max_len, seed=settings.seed,
                       self_distill=train_settings.self_distill,
                       data_path=str(settings.data_path) if settings.data_path else None)
    needed = tuple(sorted(set(taps) | {num_layers}))
    store = ensure_features(target, needed, data, progress=settings.progress, run_dir=Path(settings.out_dir))
    tensors = store.load(needed)
    vocab = target.config.vocab_size
    draft_vocab = train_settings.draft_vocab if 0 < train_settings.draft_vocab < vocab else None
    if train_settings.vocab_coverage > 0:
        covering = vocabulary_for_coverage(tensors["tokens"], tensors["loss_mask"], vocab,
                                           train_settings.vocab_coverage)
        draft_vocab = min(draft_vocab or vocab, covering) if covering < vocab else draft_vocab
    config = BlockConfig.for_target(target.config, taps, num_layers=train_settings.num_layers,
                                    block_size=train_settings.block_size, draft_vocab_size=draft_vocab,
                                    sample_from_anchor=train_settings.sample_from_anchor, mask_token_id=mask_token,
                                    markov_rank=train_settings.markov_rank,
                                    enable_confidence_head=train_settings.enable_confidence_head,
                                    confidence_head_with_markov=train_settings.confidence_head_with_markov,
                                    tap_norm=train_settings.tap_norm, learned_mask=train_settings.learned_mask,
                                    anchor_context=train_settings.anchor_context,
                                    anchor_embedding=train_settings.anchor_embedding,
                                    input_embedding_scale=train_settings.input_embedding_scale)
    torch.manual_seed(settings.seed)
    model = BlockDraftModel(config)
    if draft_vocab:
        model.draft_to_target.copy_(draft_vocabulary(tensors["tokens"], tensors["loss_mask"], draft_vocab, vocab,
                                                     target.eos_token_ids))
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_file = out_dir / "draft_vocab.safetensors"  # data, not a parameter: keep it across resumes
    if vocab_file.exists():
        model.draft_to_target.copy_(load_file(str(vocab_file))["draft_to_target"])
    else:
        save_file({"draft_to_target": model.draft_to_target.clone()}, str(vocab_file))
    engine = target.engine
    with torch.no_grad():
        if train_settings.norm_init == "target":  # the shared lm_head expects the target's output scale
            model.norm.weight.copy_(engine.final_norm)
        if train_settings.learned_mask:
            model.mask_embed.copy_(engine.embed[mask_token].float())
    model.to(settings.device)
    embed = engine.embed.float().to(settings.device)
    lm_head = engine.lm_head.float().to(settings.device)[model.draft_to_target.to(settings.device)]
    objective = BlockObjective(model, embed, lm_head, num_layers, train_settings, settings.bf16_autocast(),
                               compile=settings.compile)
    batches = FeatureBatches(tensors, taps, num_layers, settings.batch_size, settings.seed)
    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": vocab}
    identity = {"method": method, "target": target_info, "batch_size": settings.batch_size,
                "features": store.folder.name, "train": without_later_defaults(asdict(train_settings)),
                "bf16_autocast": settings.bf16_autocast()}
    cfg = settings.loop_config(len(batches.train_spans), grad_clip=1.0)

    def export(step: int) -> None:
        rows = loop.read_log(out_dir)
        model.eval()
        cache = read_teacher_cache(out_dir / HELDOUT_TEACHER)
        accuracy = heldout_slot_accuracy(objective, batches, cache)
        rounds = heldout_rounds(model, objective.embed, objective.lm_head, batches.tensors,
                                batches.heldout_spans[-HELDOUT_ROUNDS_CONVERSATIONS:], keep=GRID_REPLY_TOKENS)
        probe = first_draft_probe(objective, batches)
        tmp = out_dir / (HELDOUT_TEACHER + ".tmp")  # ~1 MB, every export: simpler than tracking changes
        torch.save(cache, tmp)
        tmp.replace(out_dir / HELDOUT_TEACHER)
        model.train()
        keys = ("loss", "ce", "tv", "bce", "conf", "acc", "acc0", "acc1", "acc3", "acc7")
        manifest = {
            "method": method, "target": target_info, "weights": WEIGHTS,
            "heldout": dict(accuracy, **heldout_prediction(accuracy["slot_accuracy"]), **rounds,
                            context_probe=probe),
            "block": {"input_slots": config.block_size, "drafts_per_block": config.drafts_per_block,
                      "anchor_predicts_next": config.sample_from_anchor, "convention": config.convention},
            "training": training_manifest(step, settings, train_settings, store, len(batches.train_spans), rows, keys),
        }
        export_model(model, out_dir, manifest)

    model.train()
    return settings.run_loop(objective, batches.next_batch, cfg, identity, export, out_dir)

