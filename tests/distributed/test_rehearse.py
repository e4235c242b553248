"""`nd-adapter rehearse`: a shipped multi-GPU config's exact layout on CPU processes (train, save, resume)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def rehearse(config: str, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "adapter", "rehearse", "--config", config, "--steps", "2", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


# The 8-process dp_shard 2 × cp 2 × tp 2 layout of configs/qwen3-8b-cp-tp.yaml is rehearsed through Axolotl's own
# qwen3-8b-fsdp-tp-cp.yaml (the same layout and seq 8192, with packed SFT data: test_axolotl_examples.py); the shipped
# config itself is planned in tests/unit/test_plan_cli.py.


def test_rehearse_refuses_a_bad_layout_before_starting(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text((ROOT / "configs/llama-3.1-8b-hsdp-tp.yaml").read_text().replace("tp_size: 2", "tp_size: 3")
                   .replace("models/llama-3.1-8b", str(ROOT / "configs/models/llama-3.1-8b")))
    p = rehearse(str(cfg), timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("nd-adapter: error: parallelism")


@pytest.mark.slow
def test_rehearse_phi4_mini_with_longrope_at_tp2(tmp_path):
    """The tiny stand-in of a Phi-4-mini (packed linears, RoPE on 3/4 of each head, LongRoPE with 48
    factors) keeps those switches at its tiny head size and trains, saves and resumes at tp=2."""
    import json

    model = tmp_path / "phi-4-mini"
    model.mkdir()
    conf = json.loads((ROOT / "configs/models/phi-4-mini-shape/config.json").read_text())
    conf.update(max_position_embeddings=131072, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + i / 20 for i in range(48)],
        "long_factor": [2.0 + i / 10 for i in range(48)]})
    (model / "config.json").write_text(json.dumps(conf))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nparallelism: {{tp_size: 2}}\nseq_len: 4096\nprecision: bf16\n"
                   "data: {synthetic: true}\noptimizer: {max_steps: 10}\nhardware: {gpus_per_node: 2}\n")
    p = rehearse(str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rehearsal ok: 2 processes, layout 1x1x1x2, saved at step 1 and resumed" in p.stdout


@pytest.mark.slow
def test_rehearse_gemma3_image_text_at_cp2(tmp_path):
    """Gemma-3-4B-it (its hub config.json: an image-text checkpoint whose language model is trained) keeps a
    sliding layer (window shrunk below the rehearsal's sequence) and a global one with their own RoPE bases, and
    trains, saves and resumes at cp=2 (the window on the all-gathered keys)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {ROOT / 'configs/models/gemma-3-4b-it'}}}\nparallelism: {{cp_size: 2}}\n"
                   "seq_len: 4096\nprecision: bf16\ndata: {synthetic: true}\noptimizer: {max_steps: 10}\n"
                   "hardware: {gpus_per_node: 2}\n")
    p = rehearse(str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rehearsal ok: 2 processes, layout 1x1x2x1, saved at step 1 and resumed" in p.stdout, p.stdout[-2000:]
    assert "model: the language model of Gemma3ForConditionalGeneration is trained" in p.stdout + p.stderr


@pytest.mark.slow
def test_rehearse_olmoe_with_expert_parallelism_beside_tp():
    """The shipped OLMoE config (tp 2 × dp_shard 2, ep 2) on 4 processes: a tiny OLMoE with all 64 experts
    (each rank 32) trains with the load-balancing loss, saves and resumes."""
    p = rehearse("configs/olmoe-1b-7b-ep.yaml")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rehearsing on 4 CPU processes: dp_replicate=1 dp_shard=2 cp=1 tp=2 ep=2" in p.stdout
    assert "the rehearsal's tiny model: 16 of the 64 experts, top 8" in p.stdout  # 8 per ep rank
    assert "mixture of experts: 16 experts, top 8, load-balancing loss" in p.stdout
    assert "layout 1x2x1x2 ep 2, saved at step 1 and resumed" in p.stdout and "Traceback" not in p.stdout + p.stderr


@pytest.mark.slow
def test_rehearse_qwen2_qlora_example_at_tp2(tmp_path):
    """Axolotl's qwen2/qlora-fsdp.yaml (Qwen2-7B: 28 heads, NF4 base) at tp 2 on 2 processes, with synthetic tokens
    (no eval set): the tiny model's head_dim grows to keep NF4's blocks of 64 in every rank's rows (a head_dim of 8
    made a width of 224, refused as if the user's tp_size were at fault), and it trains, saves and resumes."""
    from tests.helpers.axolotl_home import with_local_model

    cfg = with_local_model(ROOT / "tests/fixtures/axolotl/qwen2-qlora-fsdp.yaml", tmp_path,
                           drop=("datasets", "val_set_size"), tensor_parallel_size=2, sequence_len=256)
    p = rehearse(str(cfg), "--nproc", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rehearsal ok: 2 processes, layout 1x1x1x2, saved at step 1 and resumed" in p.stdout, p.stdout[-2000:]


@pytest.mark.slow
def test_rehearse_a_transformers_engine_model_with_peft_lora(tmp_path):
    """gpt-oss-20b's config (transformers' GptOssConfig defaults are that model's) has no native family: the
    rehearsal cuts its config.json small (one sliding and one full layer, experts and sinks kept) and trains
    transformers' own model with PEFT's LoRA at dp_shard=2 under ZeRO-3, saves and resumes."""
    import json

    import transformers

    model = tmp_path / "gpt-oss-20b"
    model.mkdir()
    conf = transformers.GptOssConfig().to_dict()
    (model / "config.json").write_text(json.dumps({**conf, "architectures": ["GptOssForCausalLM"]}))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nparallelism: {{dp_shard_size: 2}}\nseq_len: 4096\nprecision: bf16\n"
                   "data: {synthetic: true}\noptimizer: {max_steps: 10}\nhardware: {gpus_per_node: 2}\n"
                   "lora: {r: 8, alpha: 16, target_linear: true}\n")
    p = rehearse(str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rehearsal ok: 2 processes, layout 1x2x1x1, saved at step 1 and resumed" in p.stdout, p.stdout[-2000:]
    assert "engine: transformers' own GptOssForCausalLM" in p.stdout
    assert "(PEFT on transformers' model)" in p.stdout


@pytest.mark.slow
def test_rehearse_axolotl_vision_qlora_at_dp2(tmp_path):
    """Axolotl's Gemma 3 vision QLoRA example, unchanged but for its checkpoint (a tiny image-text one with its
    processor) and its rows (one in three with an image), at dp_shard 2: the tiny copy carries the checkpoint's
    processor files, every rank builds its random 4-bit base (transformers 5.25 saves only on rank 0 under a process
    group: adapter/patches/hf_save.py), and micro-batches without an image get the blank filler, so DeepSpeed's
    gradient buckets agree across the ranks. It trains, saves and resumes."""
    import yaml

    from tests.helpers.image_text import gemma3_vlm, rows
    from tests.helpers.sft_data import write_jsonl

    raw = yaml.safe_load((ROOT / "tests/fixtures/axolotl/gemma-3-4b-vision-qlora.yml").read_text())
    raw.update(base_model=str(gemma3_vlm(tmp_path)), output_dir=str(tmp_path / "out"), dp_shard_size=2,
               datasets=[{"path": str(write_jsonl(tmp_path / "mm.jsonl", rows(tmp_path, 24, images_every=3))),
                          "type": "chat_template"}])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    p = rehearse(str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rehearsal ok: 2 processes, layout 1x2x1x1, saved at step 1 and resumed" in p.stdout, p.stdout[-2000:]
