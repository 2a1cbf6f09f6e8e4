"""One command for a CUDA machine: the Triton verification kernels against the torch
reference, then their timings (Triton vs torch, median of triton.testing.do_bench).

    python -m scripts.gpu_check           # one GPU, a few minutes; JSON to $OUT/gpu_check.json if OUT is set
    python -m scripts.gpu_check --smoke   # the same code at toy sizes on the CPU (Triton interpreter)
    python -m scripts.gpu_check --compile-only   # compile every kernel for sm_90, no GPU needed

Exit status: 0 when every comparison matches (or when there is no CUDA device, with a
message), 1 when a kernel disagrees with the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from bench.core.draft import Draft
from bench.core.sampling import SamplingConfig


@dataclass(frozen=True)
class Sizes:
    vocabs: tuple[int, ...]
    chain_lengths: tuple[int, ...]
    tree_sizes: tuple[int, ...]
    seeds: int  # random cases per comparison


FULL = Sizes(vocabs=(32_000, 128_256, 151_936), chain_lengths=(1, 4, 8, 16), tree_sizes=(8, 32, 64), seeds=6)
SMOKE = Sizes(vocabs=(1500,), chain_lengths=(1, 3), tree_sizes=(6,), seeds=1)


def chain_case(vocab: int, n: int, generator: torch.Generator, device: torch.device):
    """Target probs [n+1, V], a draft q near p, tokens drawn from q, uniforms [n+1]."""
    logits = torch.randn(n + 1, vocab, generator=generator, device=device) * 3
    probs = logits.softmax(-1)
    q = (logits[:n] + torch.randn(n, vocab, generator=generator, device=device)).softmax(-1)
    tokens = torch.multinomial(q, 1, generator=generator).squeeze(1) if n else torch.zeros(0, dtype=torch.long,
                                                                                           device=device)
    return probs, q, tokens, torch.rand(n + 1, generator=generator, device=device)


def greedy_case(vocab: int, n: int, chain: bool, dtype: torch.dtype, seed: int, device: torch.device):
    """Logits [n+1, V] and a draft tree whose nodes carry their parent's argmax 80% of the time."""
    rng = random.Random(seed)
    generator = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(n + 1, vocab, generator=generator, device=device).to(dtype)
    targets = logits.argmax(-1).tolist()
    parents = list(range(-1, n - 1)) if chain else [-1 if i < 4 else rng.randrange(max(-1, i - 8), i)
                                                    for i in range(n)]
    tokens = [targets[p + 1] if rng.random() < 0.8 else rng.randrange(vocab) for p in parents]
    return Draft(tokens, parents), logits


# The kernel sums the CDF block by block, torch.cumsum in another order: a uniform that
# lands within float32 rounding of a CDF boundary may pick the neighbouring token. Both
# draws are exact samplers; such a case is reported apart from a real mismatch.
CDF_TOLERANCE = 1e-5


def cdf_boundary(weights: torch.Tensor, u: float, token_a: int, token_b: int) -> bool:
    """Whether both tokens are inverse-CDF draws for some u' within CDF_TOLERANCE of u."""
    cdf = weights.double().cumsum(0)
    total = float(cdf[-1])
    bounds = torch.tensor([(u - CDF_TOLERANCE) * total, (u + CDF_TOLERANCE) * total], dtype=torch.float64,
                          device=cdf.device)
    low, high = torch.searchsorted(cdf, bounds, right=True).tolist()
    return low <= min(token_a, token_b) and max(token_a, token_b) <= high


def run_checks(sizes: Sizes, device: torch.device) -> list[dict]:
    from bench.core import verify as verify_module
    from bench.core import verify_triton as vt

    results = []
    for vocab in sizes.vocabs:
        mismatches = cases = 0
        boundary, details = 0, []
        for n in sizes.chain_lengths + (0,):
            for seed in range(sizes.seeds):
                generator = torch.Generator(device).manual_seed(seed * 1000 + n)
                probs, q, tokens, uniforms = chain_case(vocab, n, generator, device)
                for variant, q_used in (("q", q), ("bf16 q", q.to(torch.bfloat16)), ("one-hot", None)):
                    drafted = tokens if q_used is not None else probs[:n].argmax(-1)  # one-hot: argmax drafts
                    n_ref, token_ref = verify_module.chain_reference(probs, q_used, drafted, uniforms)
                    residual = torch.empty(vocab, device=device)
                    out = vt.chain_accept(probs, q_used, drafted, uniforms, residual_out=residual)
                    got, expected = vt.chain_result(out, vocab), (int(n_ref), int(token_ref))
                    weights = verify_module.chain_weights(probs, q_used, drafted, n_ref)
                    same_weights = bool(torch.equal(residual, weights)) or float(residual.sum()) == 0.0
                    cases += 1
                    if got == expected and same_weights:
                        continue
                    on_boundary = (same_weights and got[0] == expected[0]
                                   and cdf_boundary(weights, float(uniforms[n]), got[1], expected[1]))
                    boundary += on_boundary
                    mismatches += not on_boundary
                    details.append({"n": n, "seed": seed, "q": variant, "kernel": got, "reference": expected,
                                    "same_weights": same_weights, "cdf_boundary": on_boundary})
        results.append({"check": "chain kernel vs chain_reference", "vocab": vocab, "cases": cases,
                        "mismatches": mismatches, "cdf_boundary": boundary, "details": details})
        mismatches = cases = 0
        shapes = [(n, False) for n in sizes.tree_sizes] + [(n, True) for n in sizes.chain_lengths]
        for n, chain in shapes:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for seed in range(sizes.seeds):
                    draft, logits = greedy_case(vocab, n, chain, dtype, seed, device)
                    expected = verify_module.verify_greedy(draft, logits)
                    same = verify_module._verify_greedy_triton(draft, logits) == expected
                    mismatches += not same
                    cases += 1
        results.append({"check": "greedy kernels vs verify_greedy", "vocab": vocab, "cases": cases,
                        "mismatches": mismatches})
        results.append(check_dispatch(vocab, sizes, device))
        print(f"checked vocab {vocab}", file=sys.stderr, flush=True)
    return results


def check_dispatch(vocab: int, sizes: Sizes, device: torch.device) -> dict:
    """verify() with the Triton flag on and off, same seeded generator: same verdicts."""
    from bench.core import verify as verify_module

    generator = torch.Generator(device).manual_seed(vocab)
    cases = []
    for n in sizes.chain_lengths:
        probs, q, tokens, _ = chain_case(vocab, n, generator, device)
        logits = probs.log()
        cases += [(Draft.chain(tokens.tolist(), q), logits), (Draft.chain(tokens.tolist()), logits)]
    configs = (SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.7, top_k=50, top_p=0.9))
    verdicts = {}
    for flag in (False, True):
        verify_module.use_triton = verify_module.triton_greedy = flag
        seeded = torch.Generator(device).manual_seed(1)
        verdicts[flag] = [verify_module.verify(d, x, cfg, seeded) for cfg in configs for d, x in cases]
    verify_module.use_triton, verify_module.triton_greedy = True, False
    mismatches = sum(a != b for a, b in zip(verdicts[False], verdicts[True], strict=True))
    return {"check": "verify() triton vs torch, same seed", "vocab": vocab, "cases": len(verdicts[True]),
            "mismatches": mismatches}


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call: CUDA events via do_bench on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    start = time.perf_counter()  # the CPU smoke run: one interpreted call, only to exercise the code
    fn()
    return (time.perf_counter() - start) * 1e3


def run_timings(sizes: Sizes, device: torch.device) -> list[dict]:
    from bench.core import verify as verify_module
    from bench.core import verify_triton as vt

    rows = []

    def record(case: str, vocab: int, nodes: int, torch_fn: Callable, triton_fn: Callable) -> None:
        torch_ms, triton_ms = time_ms(torch_fn, device), time_ms(triton_fn, device)
        rows.append({"case": case, "vocab": vocab, "nodes": nodes, "torch_ms": torch_ms,
                     "triton_ms": triton_ms, "speedup": torch_ms / triton_ms})

    def through_verify(draft: Draft, logits: torch.Tensor, cfg: SamplingConfig, flag: bool) -> Callable:
        def run():
            verify_module.use_triton = verify_module.triton_greedy = flag
            try:
                return verify_module.verify(draft, logits, cfg, generator)
            finally:
                verify_module.use_triton, verify_module.triton_greedy = True, False
        return run

    generator = torch.Generator(device).manual_seed(0)
    for vocab in sizes.vocabs:
        for n in sizes.chain_lengths:
            probs, q, tokens, uniforms = chain_case(vocab, n, generator, device)
            for name, q_used in (("q", q), ("one-hot", None)):
                inputs = (probs, q_used, tokens, uniforms)
                record(f"chain accept+draw, {name} (device only)", vocab, n,
                       partial(verify_module.chain_reference, *inputs), partial(vt.chain_accept, *inputs))
            draft, logits = Draft.chain(tokens.tolist(), q), probs.log()
            cfg = SamplingConfig(1.0)
            record("verify() sampling chain T=1", vocab, n, through_verify(draft, logits, cfg, False),
                   through_verify(draft, logits, cfg, True))
        for n, chain in [(n, False) for n in sizes.tree_sizes] + [(sizes.chain_lengths[-1], True)]:
            draft, logits = greedy_case(vocab, n, chain, torch.float32, n, device)
            record("verify() greedy " + ("chain" if chain else "tree"), vocab, n,
                   through_verify(draft, logits, SamplingConfig(0.0), False),
                   through_verify(draft, logits, SamplingConfig(0.0), True))
        print(f"timed vocab {vocab}", file=sys.stderr, flush=True)
    return rows


def compile_kernels(arch: int = 90) -> int:
    """Compile every kernel variant the checks use for CUDA sm_<arch>, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.core import verify_triton as vt

    def build(kernel, pointers: dict[str, str], constexprs: dict, num_warps: int) -> None:
        signature = {name: "constexpr" if param.is_constexpr else pointers.get(name, "i32")
                     for name, param in zip(kernel.arg_names, kernel.params, strict=True)}
        triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": num_warps, "enable_fp_fusion": False})

    int_ptrs = {name: "*i32" for name in ("tok_ptr", "out_ptr", "last_ptr", "index_ptr", "parent_ptr", "targets_ptr")}
    count = 0
    for q_type, has_q in (("*fp32", True), ("*bf16", True), ("*fp32", False)):
        pointers = {"p_ptr": "*fp32", "q_ptr": q_type, "u_ptr": "*fp32", "sums_ptr": "*fp32",
                    "residual_ptr": "*fp32", **int_ptrs}
        for block_n, block_c in ((1, 1), (16, 64)):
            build(vt._chain_partials, pointers, {"HAS_Q": has_q, "WRITE_RESIDUAL": block_n > 1, "BLOCK_N": block_n,
                                                 "BLOCK_V": vt.CHAIN_BLOCK_V}, 8)
            build(vt._chain_draw, pointers, {"HAS_Q": has_q, "BLOCK_C": block_c, "BLOCK_V": vt.CHAIN_BLOCK_V}, 8)
            count += 2
    for logits_type in ("*fp32", "*bf16", "*fp16"):
        build(vt._argmax_partials, {"x_ptr": logits_type, "best_ptr": "*fp32", **int_ptrs},
              {"BLOCK_V": vt.ARGMAX_BLOCK_V}, 8)
        count += 1
    for block_r, block_n in ((1, 1), (128, 64)):
        build(vt._greedy_walk, {"best_ptr": "*fp32", **int_ptrs}, {"BLOCK_R": block_r, "BLOCK_N": block_n}, 4)
        count += 1
    return count


def print_report(checks: list[dict], timings: list[dict]) -> None:
    print(f"{'check':<40} {'vocab':>8} {'cases':>6} {'mismatches':>10} {'CDF-boundary':>12}")
    for row in checks:
        print(f"{row['check']:<40} {row['vocab']:>8} {row['cases']:>6} {row['mismatches']:>10} "
              f"{row.get('cdf_boundary', '-'):>12}")
        for detail in row.get("details", []):
            print(f"    {detail}")
    print()
    print(f"{'case':<42} {'vocab':>8} {'nodes':>5} {'torch ms':>9} {'triton ms':>9} {'speedup':>8}")
    for row in timings:
        print(f"{row['case']:<42} {row['vocab']:>8} {row['nodes']:>5} {row['torch_ms']:>9.4f} "
              f"{row['triton_ms']:>9.4f} {row['speedup']:>7.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU in Triton's interpreter")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the kernels for sm_90 (no GPU needed) and stop")
    args = parser.parse_args(argv)
    if args.compile_only:
        print(f"compiled {compile_kernels()} kernel variants for sm_90")
        return 0
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before bench.core.verify_triton defines its kernels
        device, sizes = torch.device("cpu"), SMOKE
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (the CPU tests run the kernels in "
              "Triton's interpreter; `--smoke` runs this script that way)")
        return 0
    else:
        device, sizes = torch.device("cuda"), FULL
    try:
        import triton
    except ImportError:
        print("gpu_check: triton is not installed")
        return 1
    from bench.core import verify as verify_module

    saved_devices = verify_module.TRITON_DEVICES
    verify_module.TRITON_DEVICES = (device.type,)
    try:
        started = time.perf_counter()
        checks = run_checks(sizes, device)
        timings = run_timings(sizes, device)
    finally:
        verify_module.TRITON_DEVICES = saved_devices
        verify_module.use_triton = True
    ok = all(row["mismatches"] == 0 for row in checks)
    print_report(checks, timings)
    print(f"\n{'OK' if ok else 'MISMATCH'}: {sum(r['cases'] for r in checks)} comparisons, "
          f"{time.perf_counter() - started:.0f} s")
    report = {"ok": ok, "smoke": args.smoke, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "checks": checks, "timings": timings}
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        path = os.path.join(os.environ["OUT"], "gpu_check.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
