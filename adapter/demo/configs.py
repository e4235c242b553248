"""What the CPU demo trains and the three configs it writes: its sizes (`Settings`, `QUICK` for the tests) and the
native YAML, the Axolotl fine-tuning YAML and the Axolotl LoRA YAML, each as a user would write it. The copies under
configs/ are these with repository-root paths (tests/distributed/test_demo_run.py keeps them in sync)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Sizes chosen so 4 CPU processes on 2 cores train in ~1-2 minutes and the loss falls by well over a nat."""

    vocab: int = 2048
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 352
    max_positions: int = 512
    seq_len: int = 128
    micro_batch: int = 4
    lr: float = 3e-3
    warmup: int = 10
    first_steps: int = 50   # `nd-adapter train --max-steps first_steps`
    total_steps: int = 100  # then `--resume --max-steps total_steps`
    save_every: int = 25
    min_drop: float = 1.5   # required fall (nats) from step 1 to the mean of the last 5 steps
    new_tokens: int = 24
    verify: bool = True     # `nd-adapter convert verify` (loads both models: ~10 s of imports on 2 cores)
    ft_epochs: int = 16     # the fine-tuning leg: epochs over adapter/demo/data/chat_genesis.jsonl (2 steps each)
    ft_seq_len: int = 256
    ft_lr: float = 1e-3
    lora_epochs: int = 16   # the LoRA leg: the same chat set, adapters on the pre-trained export
    lora_lr: float = 1e-2


QUICK = Settings(vocab=512, hidden=64, layers=2, ffn=128, max_positions=256, seq_len=64, micro_batch=2,
                 warmup=2, first_steps=6, total_steps=12, save_every=3, min_drop=0.3, new_tokens=8, verify=False,
                 ft_epochs=4, ft_seq_len=256, ft_lr=3e-3, lora_epochs=4, lora_lr=1e-2)


def render_config(s: Settings, prefix: str = "") -> str:
    """The run config as YAML. `prefix` is prepended to every path: "" inside the output dir, "demo-out/" for the
    copy shipped in configs/ (checkpoint.dir and export_hf are relative to the working directory, so that copy is
    run from the repository root)."""
    p = prefix
    return _align(f"""\
# nd-adapter CPU demo: a tiny random Llama (GQA, untied head) trained on Genesis with tp=2 x ZeRO-3 dp=2.
# Written by `python -m adapter.demo`. {_where(p)}
model:
  path: {p}model                    # HF checkpoint: architecture and tokenizer
  checkpoint: {p}megatron           # nd-adapter convert hf-to-megatron --hf {p}model --out {p}megatron --tp 2
parallelism:
  dp_replicate_size: 1
  dp_shard_size: 2                  # ZeRO-3 over 2 ranks
  tp_size: 2                        # Megatron tensor parallel
  cp_size: 1
batch:
  micro_batch_size: {s.micro_batch}
  gradient_accumulation_steps: 1   # global batch = {s.micro_batch} x 1 x 2 = {2 * s.micro_batch} sequences
seq_len: {s.seq_len}
precision: fp32                     # CPU
optimizer:
  lr: {s.lr}
  schedule: constant                # the same LR whether the run is split by --max-steps or not
  warmup_steps: {s.warmup}
  max_steps: {s.total_steps}
  clip_grad: 1.0
data:
  files: [{p}data/genesis.jsonl]
checkpoint:
  dir: {p}checkpoints
  save_every: {s.save_every}
  keep_last: 2
  export_hf: {p}hf-export            # HF checkpoint written at the end of every run
logging:
  every: 1
hardware:
  gpus_per_node: 4                  # processes on this machine (CPU ranks here)
""")


def _align(text: str, col: int = 40) -> str:
    """Line up trailing comments whatever the path prefix made the values' length."""
    out = []
    for line in text.splitlines():
        body, sep, note = line.partition(" # ")
        out.append(f"{body.rstrip():<{col - 2}}  # {note}" if sep and body.strip() else line)
    return "\n".join(out) + "\n"


def _where(prefix: str) -> str:
    if not prefix:
        return "Paths are relative to this directory: run nd-adapter from here."
    return (f"Paths are relative to the repository root: run from there once `make demo`\n# (python -m "
            f"adapter.demo.run --out {prefix.rstrip('/')}) has built them, e.g. to train on:\n#   nd-adapter train "
            f"--config configs/demo-llama-tiny.yaml --resume --max-steps 150")


def render_finetune(s: Settings, prefix: str = "") -> str:
    """The fine-tuning leg's config: Axolotl's own keys, as an Axolotl user writes them (nothing nd-adapter-only).
    `prefix` as for render_config ("demo-out/" for the copy shipped in configs/)."""
    p = prefix
    where = ("Paths are relative to this directory." if not p else
             "Paths are relative to the repository root, after `make demo`.")
    return _align(f"""\
# nd-adapter CPU demo, fine-tuning leg: an Axolotl-style YAML, unchanged. Written by `python -m adapter.demo`.
# {where}
base_model: {p}hf-export              # the model the pre-training leg exported (its weights are converted once)
tensor_parallel_size: 2
dp_shard_size: 2
sequence_len: {s.ft_seq_len}
micro_batch_size: 2
gradient_accumulation_steps: 1
num_epochs: {s.ft_epochs}
learning_rate: {s.ft_lr}
lr_scheduler: cosine
warmup_ratio: 0.1
datasets:
  - path: {p}data/chat_genesis.jsonl  # conversations about Genesis (adapter/demo/data)
    type: chat_template
chat_template: chatml
special_tokens:
  eos_token: "<|im_end|>"         # end of a turn: trained, and where generate stops
train_on_inputs: false             # system and user turns are masked
sample_packing: true
val_set_size: 0.1
evals_per_epoch: 1
output_dir: {p}finetuned
seed: 42
""")


def render_lora(s: Settings, prefix: str = "") -> str:
    """The LoRA leg's config: Axolotl's LoRA keys on the same chat set (`prefix` as for render_config)."""
    p = prefix
    where = ("Paths are relative to this directory." if not p else
             "Paths are relative to the repository root, after `make demo`.")
    return _align(f"""\
# nd-adapter CPU demo, LoRA leg: an Axolotl-style LoRA YAML, unchanged. Written by `python -m adapter.demo`.
# {where}
base_model: {p}hf-export              # frozen: only the adapters train
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_linear: true           # q, k, v, o, gate, up and down of every layer
tensor_parallel_size: 2
dp_shard_size: 2
sequence_len: {s.ft_seq_len}
micro_batch_size: 2
num_epochs: {s.lora_epochs}
learning_rate: {s.lora_lr}
lr_scheduler: cosine
warmup_ratio: 0.1
datasets:
  - path: {p}data/chat_genesis.jsonl
    type: chat_template
chat_template: chatml
special_tokens:
  eos_token: "<|im_end|>"
train_on_inputs: false
sample_packing: true
val_set_size: 0.1
evals_per_epoch: 1
output_dir: {p}lora-out               # the adapter, in PEFT's format
seed: 42
""")

