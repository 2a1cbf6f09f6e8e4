"""How large the target states an EAGLE head reads are, tap by tap, on the feature cache's reply rows.

EAGLE-3's fc reads the states entering layers 2, L/2 and L-3 concatenated, un-normed; EAGLE-1
reads the final normed state. Where the taps differ in scale, or a few dimensions dwarf the
rest (massive activations), one linear layer sees mostly those, which is what SpecForge's
EAGLE-3.1 per-tap RMSNorm (`--option fc_norm=true`) undoes. This measures it on the
conversations the heads train on.

    python -m scripts.tap_scales --rows 20000
"""

from __future__ import annotations

import click

from bench.rounds import write_record


@click.command()
@click.option("--taps", default="2,15,27,30", show_default=True, help="states measured (HF hidden_states numbering)")
@click.option("--rows", default=20000, show_default=True, help="reply rows read, from the cache's first conversations")
@click.option("--top", default=5, show_default=True, help="largest dimensions listed per tap")
@click.option("--tokens", default=5_000_000, show_default=True,
              help="the feature cache's size (make train-at-scale's SCALE_TOKENS); extracted first if missing")
@click.option("--out", default="results/smollm2-135m/ablation", show_default=True)
def main(taps: str, rows: int, top: int, tokens: int, out: str) -> None:
    import methods  # noqa: F401  (the shipped distilled data the cache was extracted from)
    from bench.core.target import load_target, resolve_dtype
    from bench.training.features import FeatureData, ensure_features

    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))
    wanted = tuple(int(t) for t in taps.split(","))
    data = FeatureData(max_tokens=tokens, max_len=512, seed=0, self_distill=True)
    store = ensure_features(target, wanted, data)  # a progress bar where it must extract
    tensors = store.load(wanted)
    reply = tensors["loss_mask"].bool().nonzero().flatten()[:rows]
    found = {}
    for tap in wanted:
        x = tensors[f"h{tap}"][reply].float()
        per_dim = x.abs().mean(0)
        largest = per_dim.topk(top)
        found[f"h{tap}"] = {"row_rms_median": round(float(x.pow(2).mean(-1).sqrt().median()), 3),
                            "dim_mean_abs_median": round(float(per_dim.median()), 3),
                            "largest_dims": largest.indices.tolist(),
                            "largest_dim_mean_abs": [round(v, 2) for v in largest.values.tolist()]}
        dims = ", ".join(f"{v:.1f} (dim {i})" for i, v in zip(largest.indices.tolist(), largest.values.tolist()))
        click.echo(f"h{tap}: row RMS median {found[f'h{tap}']['row_rms_median']:.2f}; mean |x| per dimension: "
                   f"median {found[f'h{tap}']['dim_mean_abs_median']:.2f}, largest {dims}")
    result = {"what": "scale of the target states the EAGLE heads read, on reply rows of the training feature cache",
              "features": str(store.folder), "reply_rows": int(reply.numel()), "taps": found}
    click.echo(f"-> {write_record(out, 'eagle3-tap-scales', result)}")


if __name__ == "__main__":
    main()
