"""The cost model: what one target verification pass costs on this device, t_v(k).

t_v(k) is the wall time of one target forward over k new tokens at a given context
length (the KV cache is rolled back after each pass, so every repeat sees the same
context). Speculative decoding pays off when τ · t_v(1) > t_draft + t_v(k): the ratio
t_v(k)/t_v(1) is what every draft budget is traded against (EAGLE-2's tree size,
DSpark's verification length, the speedup model printed beside measured speedups).

Random-weight engines of published shapes (`random_engine`) let the GPU check time
realistic targets without shipping their weights: latency does not depend on values.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.core.engine import Engine

# Published shapes (config.json of each model); weights are random.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
}

DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def random_engine(shape: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                  logit_scale: float = 1.0) -> Engine:
    """An Engine of a published shape with random weights (std 0.02, as at init).
    `logit_scale` sharpens the output distribution (a random model's is nearly flat)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, max_position_embeddings=8192)
    d, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = d // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    generator = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * std).to(dtype)

    state = {"model.embed_tokens.weight": randn(vocab, d, std=0.02 * logit_scale),
             "model.norm.weight": torch.ones(d, device=device, dtype=dtype)}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = randn(vocab, d, std=0.02 * logit_scale)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": torch.ones(d, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(d, device=device, dtype=dtype),
            p + "self_attn.q_proj.weight": randn(q_size, d), p + "self_attn.k_proj.weight": randn(kv_size, d),
            p + "self_attn.v_proj.weight": randn(kv_size, d), p + "self_attn.o_proj.weight": randn(d, q_size),
            p + "mlp.gate_proj.weight": randn(inner, d), p + "mlp.up_proj.weight": randn(inner, d),
            p + "mlp.down_proj.weight": randn(d, inner),
        })
    engine = Engine(config, state, device=device, dtype=dtype)
    del state
    if engine.device.type == "cuda" and not engine.invariant:
        from bench.core.static import enable_static

        enable_static(engine)  # as load_target: one CUDA graph per bucket
    return engine


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds for one call: CUDA events on a GPU, perf_counter elsewhere."""
    if device.type == "cuda":
        def cuda_time(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_time

    def cpu_time(fn: Callable[[], object]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    return cpu_time


def random_tree_mask(nodes: int, branching: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask [n+1, n+1] (root first) and depths of a breadth-first tree with `branching`
    children per node: the shape of a top-k token tree."""
    parents = [-1] + [(i - 1) // branching for i in range(1, nodes + 1)]
    depth = [0] * (nodes + 1)
    mask = torch.eye(nodes + 1, dtype=torch.bool)
    for i in range(1, nodes + 1):
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return mask.to(device), torch.tensor(depth, device=device)


def weight_bytes(engine: Engine) -> int:
    """Bytes of weights a one-token step reads: every layer's matrices and norms, the final
    norm and the lm_head (the embedding contributes one row; a tied lm_head counts once)."""
    tensors = [t for layer in engine.layers for t in layer.values() if t is not None]
    return sum(t.numel() * t.element_size() for t in [*tensors, engine.final_norm, engine.lm_head])


class BandwidthRead:
    """A full read of a large buffer with the threads the engine runs with: timed between the
    passes it is compared with, so the memory-bound limit and the step it bounds come from the
    same moments (on a shared VM the same read ran at 32 and at 64 GB/s in runs minutes apart)."""

    def __init__(self, device: torch.device, megabytes: int = 512) -> None:
        self.buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
        self.nbytes = self.buffer.numel() * 4
        self.buffer.sum()

    def __call__(self) -> None:
        self.buffer.sum()


def memory_bound(engine: Engine, step_seconds: list[float], read_seconds: list[float], read_bytes: int) -> dict:
    """The one-token step's memory-bound limit (weight bytes / measured read bandwidth) and the
    step as a multiple of it: `step_seconds[i]` and `read_seconds[i]` were timed in the same
    round, and the multiple is the median over rounds of the step over that round's limit."""
    nbytes = weight_bytes(engine)
    bandwidth = read_bytes / statistics.median(read_seconds)
    paired = [step / (nbytes * read / read_bytes) for step, read in zip(step_seconds, read_seconds)]
    return {"weight_bytes": nbytes, "read_bytes_per_s": bandwidth, "limit_s": nbytes / bandwidth,
            "fastest_read_bytes_per_s": read_bytes / min(read_seconds),
            "step_over_limit": statistics.median(paired) if paired else None,
            "step_over_limit_range": [min(paired), max(paired)] if paired else None,
            "rounds": [[step, read] for step, read in zip(step_seconds, read_seconds)] or None}


def matmul_rate(engine: Engine, rows: int = 16, repeats: int = 10) -> float:
    """FLOP/s of a `rows`-row pass through one layer's gate/up weight by the engine's own
    linear path (the CPU kernels where they run), the weight kept in cache by repetition:
    the arithmetic a k-row verification pass cannot beat, however its weights stream."""
    weight = engine.layers[0]["gate_up"]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(engine.device, engine.dtype)
    timer = _timer(engine.device)
    calls = 20

    def passes() -> None:
        for _ in range(calls):
            engine.linear(x, weight)

    with torch.inference_mode(), engine.rows_limited(engine.invariant):
        passes()
        seconds = min(timer(passes) for _ in range(repeats)) / calls
    return 2 * rows * weight.numel() / seconds


def compute_bound(engine: Engine, step_seconds: float | None, k: int = 16) -> dict:
    """The k-row pass's compute-bound floor (2 k FLOPs per linear weight at the measured
    matmul rate) and the least t_v(k)/t_v(1) it allows beside the measured one-row step:
    what no kernel can beat on this device (a CPU without matrix units is compute-bound
    well below k = 16)."""
    params = sum(t.numel() for t in engine._linear_weights())
    rate = matmul_rate(engine, k)
    floor = 2 * k * params / rate
    return {"k": k, "matmul_flops_per_s": rate, "floor_s": floor,
            "least_ratio_to_k1": floor / step_seconds if step_seconds else None}


def hf_generate_step(target, context: int = 512, new_tokens: int = 32, repeats: int = 3) -> dict:
    """Seconds per token of transformers' own greedy `generate` on the target's weights and
    dtype after a `context`-token prompt: (t(new_tokens) - t(1)) / (new_tokens - 1), so the
    prefill cancels. The outside reference the engine's one-token step is measured against."""
    from bench.core.target import load_hf_model

    engine = target.engine
    model = load_hf_model(target.path, str(engine.device), str(engine.dtype).removeprefix("torch."))
    timer = _timer(engine.device)
    prompt = torch.randint(0, engine.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(engine.device)

    def generate(n: int) -> None:
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    generate(2)
    one = statistics.median(timer(lambda: generate(1)) for _ in range(repeats))
    many = statistics.median(timer(lambda: generate(new_tokens)) for _ in range(repeats))
    return {"context": context, "new_tokens": new_tokens, "repeats": repeats,
            "step_s": max(many - one, 0.0) / (new_tokens - 1)}


def verify_latency(engine: Engine, ks: tuple[int, ...] = DEFAULT_KS, context: int = 512, repeats: int = 20,
                   warmup: int = 3, tree_sizes: tuple[int, ...] = (), progress: bool = False) -> dict:
    """Median seconds of one k-token verification pass (logits at every row) after a
    `context`-token prefix, for chains of every k and for top-2 trees of `tree_sizes` nodes.
    The cases take turns, one pass each per round, and each round ends with a read of a large
    buffer (the memory-bound limit's bandwidth): a drift of the machine's speed (a neighbour on
    a shared VM, a clock) then falls on every case alike, not on whichever was being timed."""
    from tqdm import tqdm

    device = engine.device
    timer = _timer(device)
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, engine.vocab_size, (context,), generator=generator)
    engine.prefill(prefix, logits_rows="none")
    cases = [("chain", k) for k in ks] + [("tree", n) for n in tree_sizes]
    passes = []
    for kind, k in cases:
        tokens = torch.randint(0, engine.vocab_size, (k,), generator=generator).to(device)
        if kind == "chain":
            positions, mask = None, None
        else:
            mask, depth = random_tree_mask(k - 1, 2, device)
            positions = depth + context

        def one_pass(tokens=tokens, positions=positions, mask=mask) -> None:
            engine.forward(tokens, positions, mask)
            engine.crop(context)

        for _ in range(warmup):
            one_pass()
        passes.append(one_pass)
    read = BandwidthRead(device)
    times: list[list[float]] = [[] for _ in cases]
    read_times = []
    for _ in tqdm(range(repeats), desc="t_v(k) rounds", disable=not progress):
        for case_times, one_pass in zip(times, passes):
            case_times.append(timer(one_pass))
        read_times.append(timer(read))
    rows = [{"kind": kind, "k": k, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
             "repeats": repeats} for (kind, k), t in zip(cases, times)]
    base = next((r["median_s"] for r in rows if r["kind"] == "chain" and r["k"] == 1), None)
    for row in rows:
        row["ratio_to_k1"] = row["median_s"] / base if base else None
    one_token = next((t for (kind, k), t in zip(cases, times) if kind == "chain" and k == 1), [])
    bound = memory_bound(engine, one_token, read_times, read.nbytes)
    return {"context": context, "rows": rows, "memory_bound": bound,
            "compute_bound": compute_bound(engine, base)}


def format_profile(profile: dict) -> str:
    lines = [f"{'kind':<6} {'k':>4} {'median ms':>10} {'t(k)/t(1)':>10}"]
    for row in profile["rows"]:
        ratio = f"{row['ratio_to_k1']:.2f}" if row["ratio_to_k1"] else "-"
        lines.append(f"{row['kind']:<6} {row['k']:>4} {row['median_s'] * 1e3:>10.3f} {ratio:>10}")
    bound = profile.get("memory_bound")
    if bound:
        spread = bound.get("step_over_limit_range")
        over = ""
        if bound.get("step_over_limit"):
            over = f"; t_v(1) = {bound['step_over_limit']:.2f}x it"
            over += f" (rounds {spread[0]:.2f}-{spread[1]:.2f}x)" if spread else ""
        lines.append(f"memory-bound one-token step: {bound['limit_s'] * 1e3:.2f} ms "
                     f"({bound['weight_bytes'] / 1e6:.0f} MB of weights at {bound['read_bytes_per_s'] / 1e9:.1f} "
                     f"GB/s measured){over}")
    compute = profile.get("compute_bound")
    if compute:
        measured = next((r for r in profile["rows"] if r["kind"] == "chain" and r["k"] == compute["k"]), None)
        least = compute.get("least_ratio_to_k1")
        ratio = measured.get("ratio_to_k1") if measured else None
        lines.append(f"compute-bound {compute['k']}-token pass: {compute['floor_s'] * 1e3:.2f} ms "
                     f"({compute['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s measured)"
                     + (f"; beside this t_v(1), t_v({compute['k']})/t_v(1) >= {least:.2f}" if least else "")
                     + (f" (measured {ratio:.2f})" if ratio else ""))
    hf, base = profile.get("hf_generate"), next((r for r in profile["rows"] if r["kind"] == "chain" and r["k"] == 1),
                                                 None)
    if hf and base:
        lines.append(f"transformers.generate: {hf['step_s'] * 1e3:.2f} ms per token; "
                     f"the engine's one-token step is {hf['step_s'] / base['median_s']:.2f}x faster")
    if profile.get("drafters"):
        lines.append(f"{'drafter':<10} {'draft ms/round':>15} {'verify ms/round':>16} {'nodes':>6} {'tau':>5}")
        for row in profile["drafters"]:
            if "skipped" in row:
                lines.append(f"{row['method']:<10} skipped: {row['skipped']}")
            else:
                lines.append(f"{row['method']:<10} {row['draft_ms_per_round']:>15.1f} "
                             f"{row['verify_ms_per_round']:>16.1f} {row['nodes_per_round']:>6.1f} {row['tau']:>5.2f}")
    return "\n".join(lines)


def chain_costs(profile: dict, max_k: int) -> list[float]:
    """t_v(k) in seconds for k = 0..max_k (index 0 unused, = t_v(1)), linearly
    interpolated between the profile's measured chain lengths (flat past the last)."""
    points = sorted((r["k"], r["median_s"]) for r in profile["rows"] if r["kind"] == "chain")
    if not points:
        raise ValueError("profile has no chain rows")
    costs = []
    for k in range(max_k + 1):
        k = max(k, 1)
        below = max((p for p in points if p[0] <= k), default=points[0])
        above = min((p for p in points if p[0] >= k), default=points[-1])
        if above[0] == below[0]:
            costs.append(below[1])
        else:
            share = (k - below[0]) / (above[0] - below[0])
            costs.append(below[1] + share * (above[1] - below[1]))
    return costs


def quick_chain_costs(engine: Engine, max_k: int, context: int = 256, repeats: int = 3) -> list[float]:
    """A few seconds' measurement of t_v(1..max_k) on this engine (for schedulers that
    need the verification cost curve when no stored `bench profile` exists).
    Leaves the engine's cache empty."""
    ks = tuple(sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if k < max_k} | {max_k}))
    profile = verify_latency(engine, ks, context=context, repeats=repeats, warmup=1)
    engine.reset()
    return chain_costs(profile, max_k)


def profile_path(target_name: str, device_type: str, dtype: str, threads: int | None = None) -> Path:
    """Where `bench profile` keeps this machine's t_v(k) for a target at `threads` torch threads
    (default: this process's): the cache, not results/ (a results folder is output; a method
    reads its input from the cache or an explicit path). One file per thread count, so a
    one-thread grid and a two-thread run each find their own."""
    from bench.core.target import cache_dir

    threads = threads or torch.get_num_threads()
    return cache_dir() / "profiles" / target_name / f"{device_type}-{dtype}-t{threads}.json"


def stored_chain_costs(target, max_k: int, path: Path | None = None) -> list[float] | None:
    """t_v(0..max_k) from a stored `bench profile` of this target on this machine (the
    cached one, or `path`): same weights (fingerprint), dtype, device name and torch
    threads; None when there is none. A choice made from it (Medusa's tree size) is the
    same at every build, so a run's settings do not change with a few seconds of timing noise."""
    import json

    from bench.core.provenance import cpu_isa, device_name

    device = target.engine.device
    dtype = str(target.engine.dtype).removeprefix("torch.")
    path = Path(path) if path else profile_path(target.name, device.type, dtype)
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
        provenance = profile.get("provenance") or {}
        same_cpu = device.type != "cpu" or provenance.get("cpu_isa", cpu_isa()) == cpu_isa()  # older: no tier kept
        if (profile.get("fingerprint") == target.fingerprint and profile.get("dtype") == dtype
                and provenance.get("device_name") == device_name(str(device)) and same_cpu
                and provenance.get("torch_threads") == torch.get_num_threads()):
            return chain_costs(profile, max_k)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def best_size(gains: list[float], costs: list[float], draft_seconds: float = 0.0) -> int:
    """Draft size n maximising expected tokens per second (1 + gains[n]) / (t_draft + t_v(n+1)),
    where gains[n] = expected accepted drafts with n nodes (gains[0] = 0) and costs[k] = t_v(k)
    for k up to len(gains) (as chain_costs returns). Ties go to the smaller tree."""
    rates = [(1 + gain) / (draft_seconds + costs[n + 1]) for n, gain in enumerate(gains)]
    return max(range(len(rates)), key=lambda n: (rates[n], -n))
