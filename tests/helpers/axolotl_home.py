"""A Hugging Face home for Axolotl's example configs without network: the base models they name (each model's real
config.json and a small byte-level tokenizer carrying the special tokens the examples ask for) in the local hub
cache, and small local datasets with the columns each example reads."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.hub import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs/models"
_LLAMA2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
           "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float16"}
_MISTRAL_V01 = {**_LLAMA2, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                "sliding_window": 4096, "torch_dtype": "bfloat16"}
_QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rope_theta": 1e6,
           "use_sliding_window": False, "sliding_window": 32768, "torch_dtype": "bfloat16"}
# Gemma 3 text models: the 1B's hub config as copied in public repositories (not byte-checked; configs/models/
# SOURCES.md), the 270M's published shape; stand-ins for planning, the weights are never read
_GEMMA3_TEXT = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768, "pad_token_id": 0,
                "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
                "rope_theta": 1000000,
                "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144,
                "bos_token_id": 2, "eos_token_id": [1, 106], "attention_bias": False}
# hub id -> a shipped config directory or a config.json's content (published shapes); more in TABLE below
MODELS: dict[str, str | dict] = {
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b", "NousResearch/Meta-Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b", "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
    "Qwen/Qwen3-8B": "qwen3-8b", "NousResearch/Llama-2-7b-hf": _LLAMA2, "mistralai/Mistral-7B-v0.1": _MISTRAL_V01,
    "Qwen/Qwen2.5-0.5B": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                          "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                          "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "NousResearch/Llama-3.2-1B": "llama-3.2-1b", "microsoft/Phi-3-mini-4k-instruct": "phi-3-mini-4k",
    "NousResearch/Meta-Llama-3-8B": {
        **json.loads((SHIPPED / "llama-3.1-8b/config.json").read_text()), "rope_scaling": None,
        "max_position_embeddings": 8192},
    "NousResearch/Meta-Llama-3-8B-Instruct": {
        **json.loads((SHIPPED / "llama-3.1-8b/config.json").read_text()), "rope_scaling": None,
        "max_position_embeddings": 8192},
    "Qwen/Qwen2-7B": {**_QWEN25, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                      "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                      "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "Qwen/Qwen3-32B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                       "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                       "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                       "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16"},
    "google/gemma-2-9b": "gemma-2-9b", "google/gemma-3-4b-it": "gemma-3-4b-it",
    "microsoft/Phi-3.5-mini-instruct": "phi-3.5-mini-instruct", "THUDM/GLM-4-32B-0414": "glm-4-32b-0414",
    "google/gemma-3-1b-it": {**_GEMMA3_TEXT, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                             "num_attention_heads": 4, "num_key_value_heads": 1},
    "google/gemma-3-270m-it": {**_GEMMA3_TEXT, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                               "num_attention_heads": 4, "num_key_value_heads": 1},
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b-v0.1", "google/gemma-3-12b-it": "gemma-3-12b-it",
    "google/gemma-3-27b-it": "gemma-3-27b-it",
    # Qwen3-30B-A3B's shape with the 2507 Instruct release's context (262,144) and RoPE base (1e7): a stand-in for
    # planning Axolotl's expert-parallel examples, the weights are never read
    "Qwen/Qwen3-30B-A3B-Instruct-2507": {**json.loads((SHIPPED / "qwen3-30b-a3b/config.json").read_text()),
                                         "max_position_embeddings": 262144, "rope_theta": 10000000},
    "Qwen/Qwen2.5-72B": {**_QWEN25, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
                         "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 152064,
                         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
}
# the other base models Axolotl's examples name: transformers' config defaults or published shapes, each entry's
# provenance in its "source" (the file's "_about" says how an entry is built)
TABLE = ROOT / "tests/fixtures/axolotl/models.json"


def _merged(base: dict, over: dict) -> dict:
    """`over` set into `base`, nested mappings merged; a nested mapping naming another model_type starts from that
    type's transformers defaults."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            sub = out[k]
            if "model_type" in v and v["model_type"] != sub.get("model_type"):
                from transformers import CONFIG_MAPPING
                sub = CONFIG_MAPPING[v["model_type"]]().to_dict()
            out[k] = _merged(sub, v)
        else:
            out[k] = v
    return out


def _resolved(entry: dict) -> dict:
    """A models.json entry as a config.json's content."""
    kind, _, name = (entry["base"] or ":").partition(":")
    if kind == "transformers":  # built with the flat keys, so that derived ones (layer_types, ...) follow them
        from transformers import CONFIG_MAPPING
        flat = {k: v for k, v in entry["config"].items() if not isinstance(v, dict) or k == "quantization_config"}
        base = CONFIG_MAPPING[name](**flat).to_dict()
    else:
        base = json.loads((SHIPPED / name / "config.json").read_text()) if kind == "shipped" else {}
    return _merged(base, entry["config"])


MODELS.update({k: v for k, v in json.loads(TABLE.read_text()).items() if not k.startswith("_")})


def model_config(repo: str, spec: str | dict | None = None) -> dict:
    """The config.json content MODELS gives `repo` (or `spec`, in MODELS' forms)."""
    spec = MODELS[repo] if spec is None else spec
    if isinstance(spec, str):
        return json.loads((SHIPPED / spec / "config.json").read_text())
    return _resolved(spec) if "source" in spec and "config" in spec else spec


# the special tokens Axolotl's examples name (special_tokens:, chat templates), which their real tokenizers have: a
# special token the tokenizer lacks is added as a new one (with an adapter, only beside a trained embedding)
SPECIAL = ["<|eot_id|>", "<|finetune_right_pad_id|>", "<|start_header_id|>", "<|end_header_id|>", "<s>", "</s>",
           "<unk>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>",
           "<|end|>", "<|eot|>", "<|finetune_right_pad|>", "<|startoftext|>"]  # the last: Llama 4's, Yi's


def tokenizer(root: Path) -> Path:
    from transformers import AutoTokenizer

    from adapter.demo.build import train_tokenizer

    out = train_tokenizer(out_dir=root / "tokenizer", vocab_size=1024)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(SPECIAL, special_tokens=True)
    tok.save_pretrained(str(out))
    return out


def make_home(root: Path, models=tuple(MODELS)) -> Path:
    """HF_HOME with `models` cached (config.json + the small tokenizer)."""
    home, tok = root / "home", tokenizer(root)
    for repo in models:
        src = root / "src" / repo.replace("/", "--")
        src.mkdir(parents=True, exist_ok=True)
        (src / "config.json").write_text(json.dumps(model_config(repo)))
        for f in tok.iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        add_to_hub_cache(home, repo, src)
    return home


def alpaca_rows(n: int = 64) -> list[dict]:
    return [{"instruction": f"Name the number after {i}.", "input": "" if i % 2 else f"{i}",
             "output": f"The number after {i} is {i + 1}. " * (1 + i % 4)} for i in range(n)]


def long_rows(n: int, words: int, field: str) -> list[dict]:
    """Documents of about `words` words (each word a few tokens of the small tokenizer)."""
    return [{field: " ".join(f"word{(i * 7919 + j) % 9973}" for j in range(words))} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def localised(example: Path, out: Path, data: dict[int, Path]) -> Path:
    """The example's YAML, unchanged but for `datasets[i].path` -> data[i] (and the hub-only `data_files`)."""
    raw = yaml.safe_load(example.read_text())
    for i, path in data.items():
        entry = raw["datasets"][i]
        entry["path"] = str(path)
        entry.pop("data_files", None)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def localised_in_workdirs(root: Path, examples: dict[str, dict[int, Path]]) -> dict[str, Path]:
    """Each example (tests/fixtures/axolotl) localised (`localised`) in a working directory of its own under `root`,
    with the DeepSpeed JSON it names beside it, as a user runs it from a checkout."""
    out = {}
    for name, data in examples.items():
        work = root / name.split(".")[0]
        work.mkdir()
        out[name] = localised(ROOT / "tests/fixtures/axolotl" / name, work / name, data)
        deepspeed_configs_beside(out[name], work)
    return out


def deepspeed_configs_beside(example: Path, out_dir: Path) -> None:
    """Axolotl's deepspeed_configs/ where an example names one (it reads them relative to the working directory)."""
    raw = example.read_text()
    m = re.search(r"^deepspeed:\s*([^\s#]\S*\.json)", raw, re.M)  # not a commented-out value
    if m:
        src = ROOT / "tests/fixtures/axolotl" / Path(m.group(1)).name
        dst = out_dir / m.group(1)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.read_text())


def offline_env(home: Path, root: Path) -> dict:
    """The environment the examples' CLI runs get: `home`'s hub cache only, this checkout's package."""
    return {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT), "ND_ADAPTER_CACHE": str(root / "cache")}


def cli(argv: list[str], env: dict, cwd: Path, timeout: int = 1500) -> tuple[int, str, str]:
    """`nd-adapter ARGV` in its own process, from `cwd` (as a user runs an example from a checkout)."""
    p = subprocess.run([sys.executable, "-m", "adapter", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


_DRIVER = """
import contextlib, io, json, os, sys
from adapter.cli import main
out = []
for cwd, argv in json.loads(sys.argv[1]):
    os.chdir(cwd)
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main(argv)
    out.append([code, o.getvalue(), e.getvalue()])
print("RESULTS " + json.dumps(out))
"""


def cli_batch(runs: list[tuple[Path, list[str]]], env: dict, timeout: int = 1500) -> list[tuple[int, str, str]]:
    """`nd-adapter ARGV` for each (cwd, argv), one after the other in one process of their own (as `cli`, without a
    fresh interpreter's imports for each: ~4 s apiece on these machines). For commands that start no ranks."""
    p = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([(str(c), a) for c, a in runs])], env=env,
                       capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line, p.stderr[-3000:]
    return [(code, out, err) for code, out, err in json.loads(line[8:])]


def with_local_model(example: Path, out_dir: Path, model: dict | None = None, drop=("datasets",), **keys) -> Path:
    """The example's YAML written to `out_dir`, its `base_model` (a hub id) replaced by a local directory holding
    only that model's config.json (MODELS; `model` replaces it), the keys in `drop` removed and `keys` set: a shape
    to plan or rehearse without a hub cache or a tokenizer."""
    raw = yaml.safe_load(example.read_text())
    conf = model_config(raw["base_model"], model)
    (out_dir / "model").mkdir(parents=True)
    (out_dir / "model/config.json").write_text(json.dumps(conf))
    for key in drop:
        raw.pop(key, None)
    path = out_dir / example.name
    path.write_text(yaml.safe_dump({**raw, "base_model": str(out_dir / "model"), **keys}, sort_keys=False))
    return path
