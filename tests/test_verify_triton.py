"""Triton verification kernels against the torch reference, in Triton's CPU interpreter.

TRITON_INTERPRET must be set before bench.core.verify_triton defines its kernels (triton reads
it in @triton.jit), so it is set here at import and the module is reloaded if something
imported it earlier without it. The same comparisons run compiled on a GPU with
`python -m scripts.gpu_check`.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import bench.core.verify as verify_module  # noqa: E402
import bench.core.verify_triton  # noqa: E402
from bench.core.draft import Draft  # noqa: E402
from bench.core.sampling import SamplingConfig  # noqa: E402
from bench.core.verify import chain_reference, chain_weights, verify, verify_greedy  # noqa: E402

vt = bench.core.verify_triton
if not isinstance(vt._chain_partials, InterpretedFunction):
    vt = importlib.reload(bench.core.verify_triton)


def random_chain_case(vocab: int, n: int, generator: torch.Generator, masked: bool, scale: float = 3.0):
    """Target probs [n+1, V] (optionally top-k truncated, so p has zeros), a draft q close
    enough to p that chains get accepted, tokens drawn from q, and uniforms."""
    logits = torch.randn(n + 1, vocab, generator=generator) * scale
    if masked:
        kth = logits.topk(vocab // 10, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    q = (logits[:n].clamp(min=-30) + torch.randn(n, vocab, generator=generator)).softmax(-1)
    tokens = torch.multinomial(q, 1, generator=generator).squeeze(1) if n else torch.zeros(0, dtype=torch.long)
    return probs, q, tokens, torch.rand(n + 1, generator=generator)


@pytest.mark.parametrize("vocab, block_v", [(1000, 4096), (3000, 512), (5000, 1024)])
@pytest.mark.parametrize("one_hot", [False, True], ids=["q", "one-hot"])
def test_chain_kernel_matches_reference(vocab, block_v, one_hot):
    generator = torch.Generator().manual_seed(vocab + one_hot)
    accepted_lengths = []
    for case, n in enumerate([0, 1, 2, 4, 8, 16]):
        probs, q, tokens, uniforms = random_chain_case(vocab, n, generator, masked=case % 2 == 1,
                                                       scale=8.0 if one_hot else 3.0)
        if one_hot:  # deterministic drafts: the target's argmax (p ~ 0.9 there), so chains get accepted
            q, tokens = None, probs[:n].argmax(-1)
        n_ref, token_ref = chain_reference(probs, q, tokens, uniforms)
        residual = torch.empty(vocab)
        out = vt.chain_accept(probs, q, tokens, uniforms, residual_out=residual, block_v=block_v)
        assert vt.chain_result(out, vocab) == (int(n_ref), int(token_ref))
        assert torch.equal(residual, chain_weights(probs, q, tokens, n_ref)) or residual.sum() == 0
        accepted_lengths.append(int(n_ref))
    assert any(0 < length < n for length, n in zip(accepted_lengths, [0, 1, 2, 4, 8, 16], strict=True))


def test_chain_kernel_bf16_q_and_fallback():
    generator = torch.Generator().manual_seed(0)
    probs, q, tokens, uniforms = random_chain_case(2000, 6, generator, masked=False)
    q16 = q.to(torch.bfloat16)
    assert vt.chain_result(vt.chain_accept(probs, q16, tokens, uniforms, block_v=512), 2000) == \
        tuple(int(x) for x in chain_reference(probs, q16, tokens, uniforms))
    # A drafted token with p = q = 0 always fails and leaves a residual without mass: fall back to p.
    probs[0, 7] = 0.0
    same = probs[:1].clone()
    for u in (0.0, 0.3, 0.9999):
        uniforms = torch.tensor([u, u])
        expected = tuple(int(x) for x in chain_reference(probs[:2], same, torch.tensor([7]), uniforms))
        assert expected[0] == 0 and expected[1] != 7
        assert vt.chain_result(vt.chain_accept(probs[:2], same, torch.tensor([7]), uniforms, block_v=512),
                               2000) == expected


def test_chain_kernel_never_emits_masked_tokens():
    """Zero-weight tokens (top-k/top-p masks) around the draw: u = 0 and u -> 1 must land
    on positive-weight tokens, as in the reference."""
    probs = torch.zeros(1, 3000)
    probs[0, [700, 701, 2500]] = torch.tensor([0.25, 0.5, 0.25])
    for u, expected in ((0.0, 700), (0.3, 701), (0.8, 2500), (1.0 - 2**-24, 2500)):
        uniforms = torch.tensor([u])
        assert int(chain_reference(probs, None, torch.zeros(0, dtype=torch.long), uniforms)[1]) == expected
        out = vt.chain_accept(probs, None, torch.zeros(0, dtype=torch.long), uniforms, block_v=512)
        assert vt.chain_result(out, 3000) == (0, expected)


def random_tree(n: int, rng: random.Random, chain: bool) -> list[int]:
    if chain:
        return list(range(-1, n - 1))
    parents = []
    for i in range(n):  # bushy near the root, a few deep branches
        parents.append(-1 if i < 3 else rng.randrange(max(-1, i - 6), i))
    return parents


@pytest.mark.parametrize("vocab, block_v", [(1000, 4096), (4000, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_kernel_matches_reference(vocab, block_v, dtype):
    rng = random.Random(vocab)
    generator = torch.Generator().manual_seed(vocab)
    depths = []
    for case, n in enumerate([0, 1, 5, 16, 40]):
        parents = random_tree(n, rng, chain=case % 2 == 1)
        logits = torch.randn(n + 1, vocab, generator=generator).to(dtype)
        if case == 2:  # ties, across chunk boundaries: the first maximum must win
            logits = logits.round().clamp(max=2.0)
        targets = logits.argmax(-1).tolist()
        # Plant the target on ~80% of nodes so paths get deep.
        tokens = [targets[p + 1] if rng.random() < 0.8 else rng.randrange(vocab) for p in parents]
        draft = Draft(tokens, parents)
        expected = verify_greedy(draft, logits)
        out, kernel_targets = vt.greedy_tree(logits, torch.tensor(tokens, dtype=torch.int32),
                                             torch.tensor(parents, dtype=torch.int32),
                                             max(draft.depths(), default=0), block_v=block_v)
        assert kernel_targets.tolist() == targets
        assert vt.greedy_result(out) == (expected.accepted, expected.next_token)
        depths.append(len(expected.accepted))
    assert max(depths) >= 3


def test_greedy_kernel_on_trees_full_of_repeated_tokens():
    """Tokens from {0, 1} only, so a token recurs off the current path: the walk must only
    ever look at the current node's children (and take the first one that matches)."""
    rng = random.Random(2)
    for _ in range(25):
        n = rng.randrange(1, 14)
        draft = Draft([rng.randrange(2) for _ in range(n)], random_tree(n, rng, chain=False))
        logits = torch.zeros(n + 1, 64)
        logits[torch.arange(n + 1), [rng.randrange(2) for _ in range(n + 1)]] = 1.0
        expected = verify_greedy(draft, logits)
        out, _ = vt.greedy_tree(logits, torch.tensor(draft.tokens, dtype=torch.int32),
                                torch.tensor(draft.parents, dtype=torch.int32), max(draft.depths()))
        assert vt.greedy_result(out) == (expected.accepted, expected.next_token)


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.8, top_k=50),
                                 SamplingConfig(temperature=1.0, top_p=0.9)], ids=["greedy", "topk", "topp"])
def test_verify_dispatch_gives_the_same_verdicts(monkeypatch, cfg):
    """verify() through the kernels (CPU tensors allowed for the test) equals the torch path."""
    generator = torch.Generator().manual_seed(4)
    cases = []
    for n in (0, 3, 7):
        logits = torch.randn(n + 1, 1500, generator=generator) * 2
        q = (logits[:n] + torch.randn(n, 1500, generator=generator)).softmax(-1)
        tokens = torch.multinomial(q, 1, generator=generator).squeeze(1).tolist() if n else []
        cases += [(Draft.chain(tokens, q), logits), (Draft.chain(tokens), logits)]
    cases.append((Draft([1, 2, 3, 4], [-1, -1, 0, 1]), torch.randn(5, 1500, generator=generator)))
    verdicts = {}
    for mode in ("torch", "triton"):
        monkeypatch.setattr(verify_module, "TRITON_DEVICES", ("cuda", "cpu") if mode == "triton" else ("cuda",))
        monkeypatch.setattr(verify_module, "use_triton", True)
        monkeypatch.setattr(verify_module, "triton_greedy", mode == "triton")
        seeded = torch.Generator().manual_seed(99)
        verdicts[mode] = [verify(draft, logits, cfg, seeded) for draft, logits in cases]
    assert verdicts["torch"] == verdicts["triton"]


def test_kernels_compile_for_hopper(tmp_path):
    """Every kernel compiles for sm_90 without a GPU (triton ships ptxas), so GPU-only
    lowering errors show up on a CPU machine too. A subprocess: triton cannot compile in a
    process where it was imported in interpreter mode."""
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--compile-only"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled" in done.stdout


def test_gpu_check_smoke(tmp_path, monkeypatch, capsys):
    """scripts.gpu_check's logic, with tiny sizes on the CPU interpreter."""
    from scripts import gpu_check

    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "mismatches" in printed and "speedup" in printed
    assert (tmp_path / "gpu_check.json").exists()
