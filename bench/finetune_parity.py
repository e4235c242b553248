"""Fine-tuning parity on the machine it runs on: an HF checkpoint converted here, trained by `launch/train.py`,
against plain transformers trained on the very same batches (this project's token cache, packer and sampler).

    python bench/finetune_parity.py --shape small --steps 25 --out /tmp/parity      # the GPU test's run
    python bench/finetune_parity.py --shape 1b --steps 3 --out /tmp/parity-1b       # step-1 loss on the 1B shape
    python bench/finetune_parity.py --shape phi3-small --out /tmp/parity-phi3        # a Phi-3
    python bench/finetune_parity.py --shape gemma3-small --out /tmp/parity-gemma3    # a Gemma 3
    python bench/finetune_parity.py --shape qwen3moe-small --out /tmp/parity-moe    # a Qwen3-MoE
    python bench/finetune_parity.py --weights cache --steps 5 --out /tmp/parity-cache  # base_model's weights through
                                                   # the training run's own conversion cache (converted in the worker)

Why here and not only in CI: the converter once wrote wrong tensors only where CUDA is visible, so the claim
"a run starts from the user's weights" has to be proven on the GPU host's own torch. Writes RESULT {json} (curves,
relative differences) as its last line. HF rows: AMP (fp32 master weights, bf16 autocast: what our bf16 run is) and
pure bf16 (how far precision alone moves the curve).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # make_tiny_llama keyword arguments
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=1024, tie=True),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tie=True, vocab_size=128256),
    # Phi3ForCausalLM (packed qkv_proj / gate_up_proj, RoPE on 3/4 of each head, its pad token its EOS,
    # which the joined documents feed inside every sample), untied
    "phi3-small": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=1024, tie=False, family="phi3"),
    # Gemma 3: sandwich and q/k norms, GeGLU, a 256-token window on 3 of its 4 layers (FlashAttention's windowed
    # kernel on the GPU), local and global RoPE bases, tied
    "gemma3-small": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=1024, tie=True, family="gemma3"),
    # a Qwen3-MoE (8 experts of width 256, top 2, renormalised; q/k norms) with its load-balancing loss
    # on (coefficient 0.01), which both sides add to every micro-batch's loss
    "qwen3moe-small": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=256, tie=False, family="qwen3_moe"),
}


def make_tiny(out: Path, tokenizer_dir: Path, family: str, *, hidden, layers, heads, kv_heads, ffn, tie, device,
              max_positions=4096) -> Path:
    """A random Phi-3 (packed linears, RoPE on 3/4 of each head, pad = EOS) or Gemma 3 (a 256-token window on all
    but its last layer) with transformers' own init, in bf16, with the tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, Phi3Config, Qwen3MoeConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  tie_word_embeddings=tie, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**common, "intermediate_size": 4 * ffn}, head_dim=hidden // heads,
                             moe_intermediate_size=ffn, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                             output_router_logits=True, router_aux_loss_coef=0.01, use_sliding_window=False,
                             pad_token_id=None)
    elif family == "phi3":
        cfg = Phi3Config(**common, original_max_position_embeddings=max_positions, sliding_window=None,
                         partial_rotary_factor=0.75, pad_token_id=tok.eos_token_id)
    else:
        cfg = Gemma3TextConfig(**common, head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads,
                               sliding_window=256, pad_token_id=None,
                               layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(str(out))
    return out


STEP = re.compile(r"^step (\d+)/\d+ \| loss ([\d.]+)")


def build(out: Path, shape: str, device: str) -> dict[str, Path]:
    from adapter.demo.build import make_tiny_llama, train_tokenizer, write_demo_jsonl

    tok = out / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        train_tokenizer(out_dir=tok, vocab_size=2048)
    model = out / f"hf-{shape}"
    if not (model / "config.json").exists():
        kw = dict(SHAPES[shape])
        family = kw.pop("family", "llama")
        if family in ("phi3", "gemma3", "qwen3_moe"):
            make_tiny(model, tok, family, device=device, **kw)
        else:
            make_tiny_llama(model, tokenizer_dir=tok, max_positions=4096, dtype="bfloat16", device=device, **kw)
    data = write_demo_jsonl(out / "data" / "genesis.jsonl")
    return {"tokenizer": tok, "model": model, "data": data}


def run_ours(out: Path, paths: dict, a) -> list[float]:
    """Convert on this machine, then train through the one entry point (torchrun, one process)."""
    from adapter.convert.to_megatron import hf_to_megatron

    if a.engine == "transformers":  # transformers' own model reads the HF weights as they are
        model = {"path": str(paths["model"]), "init": "pretrained", "engine": "transformers", "compile": False,
                 "liger": [k for k in a.liger.split(",") if k]}
    elif a.weights == "convert":
        meg = out / f"megatron-{a.shape}"
        hf_to_megatron(paths["model"], meg, tp=1, overwrite=True, progress=False)
        model = {"path": str(paths["model"]), "checkpoint": str(meg)}
    else:  # no converted checkpoint named: the run converts base_model's weights into its cache itself
        shutil.rmtree(out / "weights-cache", ignore_errors=True)
        model = {"path": str(paths["model"]), "init": "pretrained", "cache_dir": str(out / "weights-cache")}
    model["compile"] = False  # eager, as the reference runs (compiled layers have their own tests)
    cfg = {"model": model, "seq_len": a.seq, "precision": a.precision,
           "batch": {"micro_batch_size": a.mbs, "gradient_accumulation_steps": 1},
           "optimizer": {"lr": a.lr, "schedule": "constant", "warmup_steps": 0, "max_steps": a.steps,
                         "weight_decay": 0.0, "clip_grad": 1.0, "state_dtype": a.state_dtype},
           "data": {"files": [str(paths["data"])], "cache_dir": str(out / "token-cache")}}
    (out / "run.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "1", str(ROOT / "launch/train.py"),
                        "--config", str(out / "run.yaml")], capture_output=True, text=True, env=env, timeout=1800)
    (out / "ours.log").write_text(p.stdout + p.stderr)
    if p.returncode:
        raise SystemExit(f"launch/train.py failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return [float(m.group(2)) for m in map(STEP.match, p.stdout.splitlines()) if m]


def run_hf(paths: dict, a, mode: str) -> list[float]:
    """The same batches through transformers: `amp` = fp32 weights and AdamW, bf16 autocast; `bf16` = all bf16."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from adapter.data import DPSampler, PackedDataset, build_batches, build_token_cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = build_token_cache([paths["data"]], paths["model"], a.out / "token-cache", progress=False)
    dataset = PackedDataset(cache, a.seq)
    sampler = DPSampler(len(dataset), dp_rank=0, dp_size=1, micro_batch=a.mbs, seed=1234)  # data.seed default
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).to(device)
    if mode == "bf16":
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=device == "cuda")
    losses, batches = [], build_batches(dataset, sampler)
    aux = bool(getattr(model.config, "output_router_logits", False))
    for _ in range(a.steps):
        b = {k: v.to(device) for k, v in next(batches).items()}
        with torch.autocast(device, dtype=torch.bfloat16, enabled=mode == "amp" and device == "cuda"):
            out = model(input_ids=b["tokens"], **({"output_router_logits": True} if aux else {}))
        per_token = F.cross_entropy(out.logits.float().flatten(0, 1), b["labels"].flatten(), reduction="none")
        loss = (per_token * b["loss_mask"].flatten()).sum() / b["loss_mask"].sum().clamp(min=1)
        # a mixture of experts adds coef × its load-balancing loss (the logged loss stays the LM loss, as ours)
        (loss + model.config.router_aux_loss_coef * out.aux_loss if aux else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--hf-modes", default="amp,bf16")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="our optimizer.state_dtype (bf16: compare with --hf-modes bf16, transformers' all-bf16 run)")
    ap.add_argument("--weights", choices=("convert", "cache"), default="convert",
                    help="convert here and name model.checkpoint, or let the run convert base_model itself")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine", choices=("megatron", "transformers"), default="megatron")
    ap.add_argument("--liger", default="", help="model.liger for --engine transformers, comma-separated")
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    a = ap.parse_args(argv)
    if a.fresh:
        shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    import torch

    paths = build(a.out, a.shape, "cuda" if torch.cuda.is_available() else "cpu")
    result = {"shape": a.shape, "steps": a.steps, "seq": a.seq, "mbs": a.mbs, "precision": a.precision,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "ours": run_ours(a.out, paths, a)}
    for mode in a.hf_modes.split(","):
        result[f"hf_{mode}"] = run_hf(paths, a, mode)
    ref = result.get("hf_amp") or result[f"hf_{a.hf_modes.split(',')[0]}"]
    result["ours_vs_hf_amp_rel"] = rel(result["ours"], ref)
    if "hf_bf16" in result and "hf_amp" in result:
        result["hf_bf16_vs_hf_amp_rel"] = rel(result["hf_bf16"], result["hf_amp"])
    if "hf_bf16" in result:
        result["ours_vs_hf_bf16_rel"] = rel(result["ours"], result["hf_bf16"])
    result["state_dtype"] = a.state_dtype
    for key in ("ours_vs_hf_amp_rel", "hf_bf16_vs_hf_amp_rel", "ours_vs_hf_bf16_rel"):
        if key in result:
            print(f"{key}: step 1 {result[key][0]:.2e}, max {max(result[key]):.2e}")
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
