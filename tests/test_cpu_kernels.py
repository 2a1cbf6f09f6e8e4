"""The CPU bf16 kernels (bench/core/kernels/cpu_bf16.cpp), for every instruction tier this
CPU runs: each row's bits do not depend on the other rows of the call, a row's attention does
not depend on where its visible slots sit, masked slots (NaN included) never reach a row, and
the results stay close to fp32 references."""

import shutil
import subprocess
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from bench.core import cpu_kernels
from bench.core.provenance import cpu_flags

TIERS = [tier for tier, (needed, _) in cpu_kernels.TIERS.items() if needed <= cpu_flags()]
pytestmark = pytest.mark.skipif(not TIERS or not cpu_kernels.enabled(), reason="no kernel tier on this CPU")


COMPILER = shutil.which("c++")


def built_or_skip(tier: str | None = None):
    """The kernels of `tier`; skipped only where there is no compiler: with one, a build that
    fails is a failure (an AMX-only compile error once hid behind a skip on AVX512 hosts)."""
    built = cpu_kernels.kernels(tier)
    if built is None:
        if COMPILER:
            pytest.fail(f"the {tier or cpu_kernels.cpu_tier()} kernels do not build with {COMPILER} (stderr says why)")
        pytest.skip("no C++ compiler here")
    return built


@pytest.fixture(scope="module", params=TIERS)
def kernels(request):
    return built_or_skip(request.param)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler here")
@pytest.mark.parametrize("tier", list(cpu_kernels.TIERS))
def test_every_tier_compiles_on_any_host(tier):
    """Each tier's source compiles (syntax and types only), whether or not this CPU runs it: a
    host without AMX still checks the AMX branch."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    command = [COMPILER, "-fsyntax-only", "-std=c++20", "-fopenmp", *cpu_kernels.TIERS[tier][1], *includes,
               "-DTORCH_EXTENSION_NAME=syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H", str(cpu_kernels.SOURCE)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_linear_rows_are_independent_and_close(kernels):
    generator = torch.Generator().manual_seed(0)
    for n, k in ((1000, 577), (64, 576), (3, 1536)):
        w = torch.randn(n, k, generator=generator).bfloat16()
        x = torch.randn(21, k, generator=generator).bfloat16()
        packed = kernels.pack(w)
        together = kernels.linear(x, packed, n)
        alone = torch.cat([kernels.linear(x[i:i + 1], packed, n) for i in range(len(x))])
        assert together.shape == (21, n) and together.dtype == torch.float32
        assert torch.equal(together, alone)
        reference = x.float() @ w.float().T
        assert (together - reference).abs().max() <= 1e-4 * reference.abs().max()
        assert torch.equal(kernels.linear(x[None, :4], packed, n)[0], together[:4])  # leading dims kept


def _attention_reference(q, keys, values, visible, scale):
    return F.scaled_dot_product_attention(q.float()[None], keys.float()[None], values.float()[None],
                                          attn_mask=visible, scale=scale, enable_gqa=True)[0]


def test_attention_rows_are_independent_and_close(kernels):
    generator = torch.Generator().manual_seed(1)
    for n, span in ((1, 64), (5, 128), (20, 256), (3, 70)):
        q = torch.randn(9, n, 64, generator=generator).bfloat16()
        keys, values = (torch.randn(3, span, 64, generator=generator).bfloat16() for _ in range(2))
        visible = torch.rand(n, span, generator=generator) < 0.6
        visible[:, 0] = True
        out = kernels.attention(q, keys, values, visible, 0.125)
        alone = torch.cat([kernels.attention(q[:, i:i + 1], keys, values, visible[i:i + 1], 0.125)
                           for i in range(n)], dim=1)
        assert out.dtype == torch.bfloat16 and torch.equal(out, alone)
        reference = _attention_reference(q, keys, values, visible, 0.125)
        assert (out.float() - reference).abs().max() < 2e-2


def test_attention_depends_only_on_the_visible_sequence(kernels):
    """A tree row whose visible slots are scattered gets the bits of the same sequence laid
    out contiguously (a chain), and masked slots holding NaN change nothing."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(9, 1, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(3, 200, 64, generator=generator).bfloat16() for _ in range(2))
    visible = torch.rand(1, 200, generator=generator) < 0.4
    scattered_keys, scattered_values = keys.clone(), values.clone()
    scattered_keys[:, ~visible[0]] = float("nan")
    scattered_values[:, ~visible[0]] = float("nan")
    slots = visible[0].nonzero()[:, 0]
    chain_keys = torch.zeros(3, 256, 64).bfloat16()
    chain_values = torch.zeros(3, 256, 64).bfloat16()
    chain_keys[:, :len(slots)], chain_values[:, :len(slots)] = keys[:, slots], values[:, slots]
    chain_visible = torch.zeros(1, 256, dtype=torch.bool)
    chain_visible[0, :len(slots)] = True
    scattered = kernels.attention(q, scattered_keys, scattered_values, visible, 0.125)
    chain = kernels.attention(q, chain_keys, chain_values, chain_visible, 0.125)
    assert not scattered.isnan().any() and torch.equal(scattered, chain)


def test_layer_halves_match_the_torch_layer(kernels, default_target):
    """The fused halves compute the engine's own layer (same roundings per op, sums in
    another order): within a few bf16 ulps of the torch ops, every row on its own."""
    from bench.core.engine import Engine
    from bench.core.target import load_state_dict

    engine = Engine(default_target.config, load_state_dict(default_target.path), dtype=torch.bfloat16)
    layer = engine.layers[3]
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 6, engine.hidden_size, generator=generator) * 0.5).bfloat16()
    cos, sin = engine.rope(torch.arange(100, 106))
    cos, sin = cos[None, None], sin[None, None]
    torch_qkv = engine.attention_inputs(layer, x, cos, sin)  # outside a pass: the torch ops
    qkv_packed, width = kernels.pack(layer["qkv"]), layer["qkv"].shape[0]  # this tier's layout
    fused = kernels.layer_inputs(x[0], layer["in_norm"], qkv_packed, width, None, cos[0, 0], sin[0, 0],
                                 engine.num_heads, engine.num_kv_heads, engine.eps)
    for ours, theirs in zip(fused, torch_qkv):
        assert ours.shape == theirs[0].shape
        assert (ours.float() - theirs[0].float()).abs().max() <= 0.02 * theirs.float().abs().max()
    alone = [kernels.layer_inputs(x[0, i:i + 1], layer["in_norm"], qkv_packed, width, None, cos[0, 0, i:i + 1],
                                  sin[0, 0, i:i + 1], engine.num_heads, engine.num_kv_heads, engine.eps)
             for i in range(6)]
    for part, pieces in zip(fused, zip(*alone)):
        assert torch.equal(part, torch.cat(pieces, dim=1))

    attn = torch.randn(1, engine.num_heads, 6, engine.head_dim, generator=generator).bfloat16()
    theirs = engine.attention_output_and_mlp(layer, x, attn)[0]
    args = (kernels.pack(layer["o"]), layer["post_norm"], kernels.pack(layer["gate_up"]), layer["gate_up"].shape[0],
            kernels.pack(layer["down"]), engine.eps)
    rows = attn[0].transpose(0, 1).reshape(6, -1)
    ours = kernels.layer_outputs(x[0], rows, *args)
    assert (ours.float() - theirs.float()).abs().max() <= 0.02 * theirs.float().abs().max()
    assert torch.equal(ours, torch.cat([kernels.layer_outputs(x[0, i:i + 1], rows[i:i + 1], *args)
                                        for i in range(6)]))


def test_engine_uses_the_kernels_and_stays_close_to_the_torch_path(default_target, monkeypatch):
    """A bf16 engine on a CPU with a tier runs its passes after the prefill on the kernels
    (bf16 K/V cache); its logits stay close to the earlier fp64-attention path's, and the
    greedy token agrees."""
    from bench.core.engine import Engine
    from bench.core.target import load_state_dict

    built_or_skip()
    state = load_state_dict(default_target.path)
    engine = Engine(default_target.config, state, dtype=torch.bfloat16)
    assert engine.kernels is not None and engine.cache_dtype == torch.bfloat16
    monkeypatch.setenv("SPEC_BENCH_CPU_KERNELS", "0")
    cpu_kernels.kernels.cache_clear()
    try:
        plain = Engine(default_target.config, state, dtype=torch.bfloat16)
    finally:
        monkeypatch.delenv("SPEC_BENCH_CPU_KERNELS")
        cpu_kernels.kernels.cache_clear()
    assert plain.kernels is None and plain.cache_dtype == torch.float64
    prompt = torch.tensor(default_target.tokenizer("The capital of France is")["input_ids"])
    block = torch.tensor([12, 345, 6789, 10])
    outputs = []
    for each in (engine, plain):
        each.prefill(prompt)
        outputs.append(each.forward(block).logits)
    ours, theirs = outputs
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_slot_attention_rows_equal_attention_alone(kernels):
    """Self-distillation's step: each sequence's new token over its own filled slots gets the
    bits of `attention` for that token alone over a span padded with masked slots."""
    generator = torch.Generator().manual_seed(4)
    lengths = torch.tensor([1, 17, 64, 100, 33])
    q = torch.randn(5, 9, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(5, 3, 128, 64, generator=generator).bfloat16() for _ in range(2))
    keys[0, :, 50:] = float("nan")  # past a row's length: never read
    out = kernels.slot_attention(q, keys, values, lengths, 0.125)
    for b, n in enumerate(lengths.tolist()):
        visible = torch.zeros(1, 128, dtype=torch.bool)
        visible[0, :n] = True
        alone = kernels.attention(q[b][:, None], keys[b], values[b], visible, 0.125)[:, 0]
        assert torch.equal(out[b], alone), b


def test_packed_linear_matches_and_repacks_on_change():
    """cpu_kernels.linear: bf16 inference on the packed weight (the kernel's result, bias
    added), a weight changed in place repacked, and F.linear wherever a gradient is needed."""
    built_or_skip()
    layer = cpu_kernels.PackedLinear(40, 24).bfloat16().requires_grad_(False)
    x = torch.randn(3, 40).bfloat16()
    built = cpu_kernels.kernels()
    expected = (built.linear(x, built.pack(layer.weight), 24) + layer.bias).bfloat16()
    assert torch.equal(layer(x), expected)
    assert (layer(x).float() - F.linear(x.float(), layer.weight.float(), layer.bias.float())).abs().max() < 0.05
    with torch.no_grad():
        layer.weight.mul_(2)
    assert torch.equal(layer(x), (built.linear(x, built.pack(layer.weight), 24) + layer.bias).bfloat16())
    trained = cpu_kernels.PackedLinear(40, 24).bfloat16()  # requires grad: autograd's F.linear
    out = trained(x)
    assert out.requires_grad and torch.equal(out, F.linear(x, trained.weight, trained.bias))


TINY = """#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler here")
def test_a_build_killed_midway_does_not_wedge_the_next(tmp_path, monkeypatch):
    """kill -9 during the build (torch's own `lock` file left behind, as a killed build leaves
    it): the next build proceeds; a lock held by a live builder is waited for at most
    BENCH_KERNEL_LOCK_TIMEOUT seconds, then the kernels are skipped with one line."""
    import os
    import signal
    import sys
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    tier = cpu_kernels.cpu_tier()
    code = ("import sys; from pathlib import Path; from bench.core import cpu_kernels; "
            f"cpu_kernels.build(Path({str(source)!r}), {tier!r}, prefix='tiny')")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    name = cpu_kernels.build_name(source, tier, "tiny", ["-O3", "-fopenmp", *cpu_kernels.TIERS[tier][1]])
    folder = tmp_path / "ext" / name
    deadline = time.monotonic() + 60
    while not folder.exists() and time.monotonic() < deadline:  # the child holds the lock and builds
        time.sleep(0.05)
    time.sleep(0.5)
    child.send_signal(signal.SIGKILL)
    child.wait()
    (folder / "lock").write_text("")  # what torch's FileBaton leaves when its owner dies
    built = cpu_kernels.build(source, tier, prefix="tiny")
    assert torch.equal(built.twice(torch.ones(3)), torch.full((3,), 2.0))
    # A live holder: waited for, then given up on with one line (kernels() goes on without them).
    import fcntl

    holder = open(folder.with_name(name + ".build-lock"), "a+")
    fcntl.flock(holder, fcntl.LOCK_EX)
    monkeypatch.setenv("BENCH_KERNEL_LOCK_TIMEOUT", "1")
    with pytest.raises(cpu_kernels.LockTimeout, match="build-lock"):
        cpu_kernels.build(source, tier, prefix="tiny")
    holder.close()
