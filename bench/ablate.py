"""Recipe ablations: training arms on the same data, the same batches and the same steps.

`bench ablate --study dflash` trains every arm of a study as its own `bench train` run
(<out>/<arm>: resumable, one thread each, `--jobs` side by side, niced), then reads each
arm's exported manifest: held-out top-1 agreement by draft position, the τ it predicts, the
τ of decode rounds replayed on the held-out replies' first 128 tokens, the first-draft
context probe (real context; position a-1 withheld; the anchor replaced by the mask input),
the start of its loss curve. The table is kept as a record
(results/<target>/ablation/<study>.json) and drawn by `bench report`.

Every arm shares the study's data (the target's own greedy replies, the same feature pool,
the same held-out conversations), seed (the same batch order), batch size, learning-rate
schedule and step count, and differs by the options it names: a deviation from the
reference recipe each, as the drafter config records it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.core.errors import BenchError
from bench.core.files import write_json


@dataclass(frozen=True)
class Arm:
    method: str
    options: dict[str, str]
    what: str
    default: bool = True  # run when no --arm is named
    loop: dict[str, str] = field(default_factory=dict)  # the arm's own training-loop flags (e.g. its lr)


@dataclass(frozen=True)
class Study:
    shared: dict[str, str]  # every arm's data options
    method_options: dict[str, dict[str, str]]  # each method's reference recipe
    arms: dict[str, Arm]
    # One conversation a step: a 2-core CPU trains an arm of 1,000 steps in about half an hour
    # (four, the shipped runs' batch, take ~5x as long); every arm the same.
    loop: dict[str, str] = field(default_factory=lambda: {"--batch-size": "1", "--lr": "3e-4",
                                                          "--warmup-steps": "50"})

    def default_arms(self) -> list[str]:
        return [name for name, arm in self.arms.items() if arm.default]


BLOCK = {"block_size": "16", "num_layers": "3", "anchors": "64", "decay": "7"}

STUDIES: dict[str, Study] = {
    "dflash": Study(
        shared={"self_distill": "true", "feature_tokens": "1000000"},
        method_options={"dflash": BLOCK, "eagle": {}},
        # In the order they are trained (`--jobs` at a time): the longest, vocab-512, first.
        arms={
            "vocab-512": Arm("dflash", {"anchors": "512", "vocab_coverage": "0.99"},
                             "512 anchors (the references') over a draft vocabulary covering 99% of reply tokens"),
            "reference": Arm("dflash", {}, "the shipped recipe: z-lab's conventions, 64 anchors, hard labels, "
                                           "the target's mask-token row, final norm copied from the target"),
            "init": Arm("dflash", {"norm_init": "ones", "learned_mask": "true"},
                        "the final norm starts at ones and the mask input is learned (from the target's row)"),
            "tap-norm": Arm("dflash", {"tap_norm": "true"}, "an RMSNorm per tap before the fc"),
            "soft-labels": Arm("dflash", {"labels": "target"}, "KL to the target's distribution (speculators)"),
            "vocab-64": Arm("dflash", {"vocab_coverage": "0.99"}, "the coverage vocabulary alone (vocab-512's "
                                                                  "other change)"),
            "eagle": Arm("eagle", {}, "EAGLE-1 on the same data and steps: the first draft's yardstick"),
            "norm-ones": Arm("dflash", {"norm_init": "ones"}, "the final norm starts at ones", default=False),
            "learned-mask": Arm("dflash", {"learned_mask": "true"}, "the mask input learned", default=False),
            "anchors-512": Arm("dflash", {"anchors": "512"}, "512 anchors, the full vocabulary", default=False),
            "anchor-context": Arm("dflash", {"labels": "target", "anchor_context": "true"},
                                  "soft labels, and every block slot's input adds the context row of a-1 "
                                  "(EAGLE-1's input)", default=False),
            "anchor-both": Arm("dflash", {"labels": "target", "anchor_context": "true", "anchor_embedding": "true"},
                               "anchor-context, and every mask slot's input adds the anchor's embedding too "
                               "(EAGLE-1's whole input in every slot)", default=False),
            "soft-lr": Arm("dflash", {"labels": "target"}, "soft labels at lr 1e-3 (the loop's other arms: 3e-4)",
                           default=False, loop={"--lr": "1e-3"}),
            "embed-scale": Arm("dflash", {"labels": "target", "input_embedding_scale": "0.1", "norm_init": "ones"},
                               "soft labels, the block's embeddings scaled by 0.1 (z-lab's input_embedding_scale) and "
                               "the final norm at ones: SmolLM2 ties its lm_head to its embeddings, so a slot's own "
                               "input token otherwise dominates its first logits", default=False),
            "block-2": Arm("dflash", {"labels": "target", "block_size": "2"},
                           "soft labels, one draft per block: the first draft alone, without the far slots' share "
                           "of the loss (EAGLE-1's task in DFlash's architecture)", default=False),
            "decay-2": Arm("dflash", {"labels": "target", "decay": "2"},
                           "soft labels, the slots' loss weights exp(-k/2) instead of z-lab's exp(-k/7) for a block "
                           "of 16: the first drafts carry the loss, as block-2's single slot does", default=False),
            "decay-2-block-4": Arm("dflash", {"labels": "target", "decay": "2", "block_size": "4"},
                                   "decay-2 at a block of 4 (3 drafts): τ against the block, one recipe",
                                   default=False),
            "decay-2-block-8": Arm("dflash", {"labels": "target", "decay": "2", "block_size": "8"},
                                   "decay-2 at a block of 8 (7 drafts)", default=False),
            "all-fixes": Arm("dflash", {"tap_norm": "true", "norm_init": "ones", "learned_mask": "true",
                                        "labels": "target"}, "tap norm, init fixes and soft labels together",
                             default=False),
        }),
}


def arm_command(study: Study, name: str, steps: int, out: Path) -> list[str]:
    """The `bench train` arguments of one arm (after `bench`)."""
    arm = study.arms[name]
    options = {**study.shared, **study.method_options.get(arm.method, {}), **arm.options}
    args = ["train", "--method", arm.method, "--max-steps", str(steps), "--threads", "1", "--out", str(out / name),
            "--export-minutes", "60"]  # the held-out evaluation costs minutes: at the end, and hourly
    for flag, value in {**study.loop, **arm.loop}.items():
        args += [flag, value]
    for key, value in options.items():
        args += ["--option", f"{key}={value}"]
    return args


def _steps(folder: Path) -> int | None:
    try:
        return json.loads((folder / "drafter.json").read_text())["training"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def finished(folder: Path, steps: int) -> bool:
    manifest = folder / "drafter.json"
    try:
        return json.loads(manifest.read_text())["training"]["steps"] >= steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_arms(study_name: str, names: list[str], steps: int, out: Path, jobs: int) -> dict[str, int]:
    """Train the unfinished arms, `jobs` at a time (each resumes where it stopped); returns each
    launched arm's exit code. Progress goes to <out>/<arm>/ablate.log."""
    study = STUDIES[study_name]
    todo = [n for n in names if not finished(out / n, steps)]
    running: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            (out / name).mkdir(parents=True, exist_ok=True)
            log = open(out / name / "ablate.log", "a")
            command = [sys.executable, "-m", "bench.cli",
                       *arm_command(study, name, steps, out)]
            print(f"arm {name}: bench {' '.join(command[3:])}", flush=True)
            running[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             preexec_fn=lambda: os.nice(10))
        time.sleep(5)
        for name, process in list(running.items()):
            if process.poll() is not None:
                codes[name] = process.returncode
                del running[name]
                state = "done" if process.returncode == 0 else f"failed (exit {process.returncode}, see " \
                                                                 f"{out / name / 'ablate.log'})"
                print(f"arm {name}: {state}", flush=True)
    return codes


def _first_steps(folder: Path, count: int = 10) -> dict:
    from bench.training.loop import read_log

    rows = read_log(folder)[:count]
    keys = [k for k in ("loss", "grad_norm") if rows and k in rows[0]]
    return {f"first_{k}": round(rows[0][k], 3) for k in keys} | \
        {f"mean_{k}_first_{count}": round(sum(r[k] for r in rows) / len(rows), 3) for k in keys}


def arm_result(folder: Path, study: Study, name: str) -> dict | None:
    """What one arm's manifest says (None: not exported yet)."""
    try:
        manifest = json.loads((folder / "drafter.json").read_text())
    except (OSError, ValueError):
        return None
    heldout, training = manifest.get("heldout", {}), manifest.get("training", {})
    agreement = heldout.get("slot_accuracy") or heldout.get("top1_by_position") or []
    first = heldout.get("first_128", {})
    arm = study.arms[name]
    return {"method": arm.method, "options": arm.options, **({"loop": arm.loop} if arm.loop else {}),
            "what": arm.what, "steps": training.get("steps"),
            "tokens_seen": training.get("tokens_seen"), "elapsed_s": training.get("elapsed_s"),
            "agreement_by_position": agreement, "first_draft": agreement[0] if agreement else None,
            "predicted_tau": heldout.get("predicted_tau"), "rounds_tau": heldout.get("rounds_tau"),
            "rounds_tau_first_128": first.get("rounds_tau"), "context_probe": heldout.get("context_probe"),
            "last_20_steps": training.get("last_20_steps"), "git_sha": training.get("git_sha"),
            **_first_steps(folder)}


def collect(study_name: str, names: list[str], steps: int, out: Path, target_name: str) -> dict:
    """The study's record: every finished arm's result (the named ones and any other arm that
    has finished under `out`, so running one more arm keeps the others), the named arms that
    have not finished listed as missing."""
    from bench.core.provenance import provenance, timestamp

    study = STUDIES[study_name]
    names = [n for n in study.arms if n in names or _steps(out / n) == steps]
    arms, missing = {}, []
    for name in names:
        result = arm_result(out / name, study, name) if finished(out / name, steps) else None
        if result is None:
            missing.append(name)
        else:
            arms[name] = result
    return {"study": study_name, "target": target_name, "steps": steps, "shared": study.shared,
            "method_options": study.method_options, "loop": study.loop, "arms": arms, "missing": missing,
            "written_at": timestamp(), **provenance("cpu")}


def record_path(results_dir: Path, target_name: str, study_name: str) -> Path:
    return Path(results_dir) / target_name / "ablation" / f"{study_name}.json"


def write_record(record: dict, path: Path) -> None:
    if not record["arms"]:
        raise BenchError("no arm has finished: nothing to record")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)


def table(record: dict) -> str:
    """The record as a Markdown table, the reference arm first."""
    lines = ["| arm | method | what | steps | first draft | a-1 withheld | anchor masked | predicted τ | "
             "replayed τ (first 128) | first loss |", "|" + "---|" * 10]
    probe_of = lambda r, k: f"{r['context_probe'][k]:.3f}" if r.get("context_probe") and k in r["context_probe"] \
        else "-"  # noqa: E731
    for name, r in record["arms"].items():
        tau = r.get("rounds_tau_first_128")
        lines.append(f"| {name} | {r['method']} | {r['what']} | {r['steps']} | "
                     f"{r['first_draft']:.3f} | {probe_of(r, 'drop_previous')} | {probe_of(r, 'anchor_masked')} | "
                     f"{r['predicted_tau']:.2f} | {'-' if tau is None else f'{tau:.2f}'} | "
                     f"{r.get('first_loss', '-')} |")
    if record.get("missing"):
        lines.append(f"\nNot finished: {', '.join(record['missing'])}.")
    return "\n".join(lines)


def records_in(results_dir: Path) -> list[dict]:
    """Every kept study record under results_dir (results/<target>/ablation/*.json that holds
    a study's arms; the folder also keeps other ablations' records)."""
    out = []
    for path in sorted(Path(results_dir).glob("*/ablation/*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"unreadable ablation record {path}: {exc}") from None
        if isinstance(record, dict) and {"study", "arms", "steps"} <= set(record):
            out.append(dict(record, path=str(path)))
    return out


def figure(record: dict, out: Path):
    """Held-out agreement by draft position, one line per arm; the first draft's context probe
    as bars beside it."""
    import matplotlib.pyplot as plt

    from bench.report.plots import _save

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    arms = record["arms"]
    for name, r in arms.items():
        curve = r["agreement_by_position"][:15]
        left.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=name,
                  ls="--" if r["method"] != record["study"] else "-")
    left.set(xlabel="draft position", ylabel="held-out top-1 agreement", ylim=(0, 1))
    left.legend(fontsize=7, ncol=2)
    probes = [("real", "real context"), ("drop_previous", "a-1 withheld"), ("anchor_masked", "anchor masked")]
    width = 0.8 / len(probes)
    names = list(arms)
    for i, (key, label) in enumerate(probes):
        values = [(arms[n].get("context_probe") or {}).get(key, float("nan")) for n in names]
        right.bar([j + i * width for j in range(len(names))], values, width, label=label)
    right.set_xticks([j + width for j in range(len(names))], names, rotation=45, ha="right", fontsize=7)
    right.set(ylabel="first draft agreement", ylim=(0, 1))
    right.legend(fontsize=7)
    name = f"ablation-{record['study']}"
    caption = (f"{record['study']} recipe arms, {record['steps']} steps each on the same data and batches "
               f"({record['target']}); left: agreement with the target's greedy token by draft position "
               "(teacher-forced, held-out conversations); right: the first draft with its real context, with "
               "position a-1 withheld, and with the anchor token replaced by the mask input.")
    saved = _save(fig, out, name, f"Recipe ablation: {record['study']}", caption)
    plt.close(fig)
    return saved
