"""Axolotl's own LoRA and QLoRA examples of the supported families (tests/fixtures/axolotl, copied unchanged from
axolotl-ai-cloud/axolotl at 067b021: llama-3's lora-1b.yml, instruct-lora-8b.yml (8-bit base), qlora-1b.yml;
Mistral's lora.yml (8-bit) and qlora.yml, both at sequence_len 8192 over Mistral v0.1's 4096 window with
sample_packing; Qwen3's 8b-lora-fused-attn-compile.yaml and Qwen2's qlora-fsdp.yaml, whose FSDP parameter offload an
adapter run does not need, said in one line), unchanged but for local dataset paths: `plan` and `preprocess` pass,
and plan says what is trained and how the base is stored; qwen3/32b-qlora.yaml (torchao's 4-bit AdamW,
`adamw_torch_4bit`) too. Then gemma2/qlora.yml and gemma3/gemma-3-{1b,270m,4b}-qlora.yml (copied unchanged as
gemma2-qlora.yml, gemma-3-*-qlora.yml), and Phi's phi/phi3-ft.yml (LoRA, `alpaca:phi`, early stopping with the best
checkpoint exported), phi/lora-3.5.yaml (copied as phi-lora-3.5.yaml: an 8-bit base under packed qkv/gate_up linears,
`bfloat16: true`, the `phi_3` template) and the full fine-tune phi/phi3-ft-fsdp.yml (FSDP parameter offload named as
memory placement, not used); glm4/qlora-32b.yaml (copied as glm4-qlora-32b.yaml) lists gate_proj and up_proj, which
GLM-4 packs into gate_up_proj: skipped and said, as PEFT skips them. llama-3/qlora.yml and llama-2/qlora.yml (copied
as llama3-qlora.yml, llama2-qlora.yml) train with bitsandbytes' paged 32-bit AdamW: AdamW's update, paging named as
not used. mistral/mixtral/mixtral-qlora-fsdp.yml: QLoRA on a mixture of experts: the attention in NF4 and adapted,
the router and experts 16-bit and frozen, as transformers + bitsandbytes + PEFT leave them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.helpers.axolotl_home import alpaca_rows, cli_batch, localised, make_home, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/axolotl"
# example -> (what plan must say about the adapters, about the base)
PASS = {"lora-1b.yml": ("LoRA r 16, alpha 32 (scale 2), dropout 0.05 on q_proj, k_proj, v_proj, o_proj, gate_proj, "
                        "up_proj, down_proj of all 16 layers", "the base frozen, 16-bit"),
        "instruct-lora-8b.yml": ("LoRA r 32, alpha 16 (scale 0.5)", "the base frozen, int8"),
        "qlora-1b.yml": ("LoRA r 32, alpha 16", "the base frozen, NF4"),
        "mistral-lora.yml": ("LoRA r 32, alpha 16", "the base frozen, int8"),
        "mistral-qlora.yml": ("LoRA r 32, alpha 16", "the base frozen, NF4"),
        "qwen3-8b-lora-fused-attn-compile.yaml": ("LoRA r 32, alpha 64 (scale 2) on q_proj", "16-bit"),
        "qwen2-qlora-fsdp.yaml": ("LoRA r 32, alpha 64 (scale 2), dropout 0.05", "the base frozen, NF4")}
ALL7 = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
PHI = "qkv_proj, o_proj, gate_up_proj, down_proj"


def said(r: int, alpha: int, on: str, layers: int, base: str) -> tuple[str, str]:
    """What plan says of an example's adapters (dropout 0.05 in all of these) and of its base."""
    return f"LoRA r {r}, alpha {alpha} (scale {alpha / r:g}), dropout 0.05 on {on} of all {layers} layers", base


# Gemma 2 (QLoRA on all linears, soft-capping, eot_tokens <end_of_turn>, Axolotl's `gemma` template),
# Phi-3 (packed linears; 16-bit and 8-bit bases), GLM-4 (gate/up packed: the two names skipped), Llama 2/3 QLoRA
PASS.update({"gemma2-qlora.yml": said(32, 16, ALL7, 42, "the base frozen, NF4"),
             "phi3-ft.yml": said(64, 32, PHI, 32, "the base frozen, 16-bit"),
             "phi-lora-3.5.yaml": said(32, 16, PHI, 32, "the base frozen, int8"),
             "glm4-qlora-32b.yaml": said(16, 32, "q_proj, k_proj, v_proj, o_proj, down_proj", 61,
                                         "the base frozen, NF4"),
             "llama3-qlora.yml": said(32, 16, ALL7, 32, "the base frozen, NF4"),
             "llama2-qlora.yml": said(32, 16, ALL7, 32, "the base frozen, NF4"),
             "mixtral-qlora-fsdp.yml": said(32, 16, "q_proj, k_proj, v_proj, o_proj", 32, "the base frozen, NF4")})
FULL = {"phi3-ft-fsdp.yml": "fsdp_config.fsdp_offload_params: not used (memory placement only"}
FOUR_BIT = "qwen3-32b-qlora.yaml"  # adamw_torch_4bit: torchao's AdamW4bit, as transformers builds it
# Gemma 3's QLoRA examples (1B, 270M text models; 4B image-text) also list unfrozen_parameters, which with an adapter
# would train base weights (in Axolotl the patterns meet the PEFT model's base_model.model.* names): plan refuses it
# in one line (preprocess has nothing to say about it), and without that key each plans unchanged
GEMMA3 = ("gemma-3-1b-qlora.yml", "gemma-3-270m-qlora.yml", "gemma-3-4b-qlora.yml")
WITHOUT_UNFROZEN = "-no-unfrozen"
MODELS = ("NousResearch/Llama-3.2-1B", "NousResearch/Meta-Llama-3-8B-Instruct", "mistralai/Mistral-7B-v0.1",
          "Qwen/Qwen3-8B", "Qwen/Qwen2-7B", "Qwen/Qwen3-32B", "google/gemma-2-9b", "google/gemma-3-1b-it",
          "google/gemma-3-270m-it", "google/gemma-3-4b-it", "microsoft/Phi-3-mini-4k-instruct",
          "microsoft/Phi-3.5-mini-instruct", "THUDM/GLM-4-32B-0414",
          "NousResearch/Meta-Llama-3-8B", "NousResearch/Llama-2-7b-hf", "mistralai/Mixtral-8x7B-v0.1")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every example's `plan` and `preprocess`, in one process (each in its own working directory, as a user runs
    them from a checkout), with the base models' configs in a local HF cache."""
    root = tmp_path_factory.mktemp("axolotl-lora")
    home = make_home(root, models=MODELS)
    alpaca = write_jsonl(root / "data/alpaca.jsonl", alpaca_rows())
    chat = [{"messages": [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]}
            for r in alpaca_rows()]
    messages = write_jsonl(root / "data/messages.jsonl", chat)
    data = {"instruct-lora-8b.yml": messages, "phi-lora-3.5.yaml": messages}
    orca = write_jsonl(root / "data/conversations.jsonl", [  # SlimOrca's columns, as the Gemma examples map them
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": r["instruction"]},
                           {"from": "gpt", "value": r["output"]}]} for r in alpaca_rows()])
    data.update({n: orca for n in ("gemma2-qlora.yml", FOUR_BIT, *GEMMA3)})
    runs, labels = [], []
    for name in [*PASS, *FULL, FOUR_BIT, *GEMMA3, *(n + WITHOUT_UNFROZEN for n in GEMMA3)]:
        src = name.removesuffix(WITHOUT_UNFROZEN)
        work = root / (src.split(".")[0] + name[len(src):])
        work.mkdir()
        cfg = localised(FIXTURES / src, work / src, {0: data.get(src, alpaca)})
        if name != src:
            raw = yaml.safe_load(cfg.read_text())
            del raw["unfrozen_parameters"]
            cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        runs += [(str(work), ["plan", str(cfg), "--gpu", "h200"]), (str(work), ["preprocess", "--config", str(cfg)])]
        labels += [(name, "plan"), (name, "preprocess")]
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "ND_ADAPTER_CACHE": str(root / "cache")}
    return dict(zip(labels, cli_batch(runs, env, timeout=1200)))


@pytest.mark.parametrize("name", list(PASS))
def test_lora_examples_plan_and_preprocess_unchanged(results, name):
    code, out, err = results[(name, "plan")]
    assert code == 0, err
    said = " ".join(out.split())  # rich wraps long lines at spaces
    if "fsdp" in name:
        assert "fsdp_config.fsdp_offload_params: not used: an adapter run keeps its frozen base" in said
    adapters, base = PASS[name]
    assert f"adapter: {adapters}" in said and base in said[said.index("adapter: LoRA"):], out[:3000]
    assert "predicted peak" in out
    code, out, err = results[(name, "preprocess")]
    assert code == 0 and "prepared data:" in out, (out[-2000:], err[-2000:])


def test_phi_examples_say_what_they_change(results):
    """phi3-ft.yml: Axolotl's rule turns load_best_model_at_end on (an eval set, save_steps 5000 a multiple of
    eval_steps 1000) beside its early stopping; phi-lora-3.5.yaml (`bf16: true` and `bfloat16: true`) trains in
    bf16 as Axolotl does."""
    said = " ".join(results[("phi3-ft.yml", "plan")][1].split())
    assert "load_best_model_at_end: on (Axolotl's rule: unset counts as on, an eval set, save_steps a multiple of " \
        "eval_steps)" in said, said[:3000]
    assert "precision: bf16" in " ".join(results[("phi-lora-3.5.yaml", "plan")][1].split())
    said = " ".join(results[("glm4-qlora-32b.yaml", "plan")][1].split())
    assert "gate_proj, up_proj match no linear: glm4 packs them into gate_up_proj" in said, said[:3000]


@pytest.mark.parametrize("name", list(FULL))
def test_full_fine_tune_examples_plan_and_preprocess_unchanged(results, name):
    code, out, err = results[(name, "plan")]
    said = " ".join(out.split())
    assert code == 0 and FULL[name] in said and "predicted peak" in out, (out[-3000:], err[-2000:])
    code, out, err = results[(name, "preprocess")]
    assert code == 0 and "prepared data:" in out, (out[-2000:], err[-2000:])


def test_the_4bit_adamw_example_plans_and_preprocesses_unchanged(results):
    code, out, err = results[(FOUR_BIT, "plan")]
    assert code == 0 and "AdamW4bit" in " ".join(out.split()), (out[-3000:], err[-2000:])
    code, out, err = results[(FOUR_BIT, "preprocess")]
    assert code == 0 and "prepared data:" in out, (out[-2000:], err[-2000:])


@pytest.mark.parametrize("name", GEMMA3)
def test_gemma3_examples_refuse_unfrozen_parameters_and_plan_without_it(results, name):
    code, _, err = results[(name, "plan")]
    assert code == 2 and err.count("\n") == 1 and err.startswith(
        "nd-adapter: error: unfrozen_parameters=['^model.language_model.*', '^lm_head.*']: a LoRA run trains its "
        "adapters"), err
    code, out, err = results[(name, "preprocess")]
    assert code == 0 and "prepared data:" in out, err[-2000:]
    code, out, err = results[(name + WITHOUT_UNFROZEN, "plan")]
    said = " ".join(out.split())
    assert code == 0 and "adapter: LoRA r 32, alpha 16 (scale 0.5) on q_proj, k_proj, v_proj, o_proj, gate_proj, " \
        "up_proj, down_proj" in said and "the base frozen, NF4" in said, (out[-3000:], err[-2000:])
    if "4b" in name:  # the image-text checkpoint: its language model is what plans (and trains)
        assert "Gemma3ForConditionalGeneration (gemma3_vl): 3.88B params" in said


def _early_stop_worker(rank, world, example: str):
    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    cfg = config.load(example, env={}, world_size=1)
    first = train(cfg, log=lambda s: None)
    lines: list[str] = []
    again = train(cfg, resume=True, log=lines.append)
    return {"evals": first.eval_losses, "early": first.stopped_early, "final": first.final_step,
            "best": first.best_step, "again": (again.final_step, again.stopped_early, again.losses),
            "said": [ln for ln in lines if ln.startswith("finished")]}


def test_phi3_ft_stops_early_and_its_resume_says_it_has_finished(tmp_path):
    """The early-stopping resume from the file that showed it (phi/phi3-ft.yml, tests/fixtures/axolotl): its
    early_stopping_patience ends the run; `--resume` of the early-stopped run used to train on and stop again at the
    same step instead of saying it had finished. The example as it is but for its scale (a tiny Phi-3 and alpaca
    rows, 256-token sequences, an eval and a save every step, and a learning rate that makes the eval loss turn)."""
    from tests.helpers.dist import run_workers
    from tests.helpers.sft import make_phi3
    from tests.helpers.sft_data import tiny_model

    model = make_phi3(tmp_path / "phi3", tiny_model(tmp_path / "tok"))
    data = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows())
    raw = yaml.safe_load(localised(FIXTURES / "phi3-ft.yml", tmp_path / "phi3-ft.yml", {0: data}).read_text())
    assert raw["early_stopping_patience"] == 3 and raw["adapter"] == "lora"  # what is under test, unchanged
    raw.update(base_model=str(model), output_dir=str(tmp_path / "out"), sequence_len=256, eval_steps=1,
               save_steps=1, max_steps=12, learning_rate=30.0, val_set_size=0.1, warmup_ratio=0.0,
               dataset_prepared_path=str(tmp_path / "prep"))
    example = tmp_path / "run.yml"
    example.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = run_workers(_early_stop_worker, 1, str(example), timeout=600)[0]
    assert r["early"] and r["final"] < 12, r
    best = min((loss, step) for step, loss in r["evals"] if step > 0)[1]  # HF's callback: evals after a step
    assert r["best"] == best and r["final"] - best == 3, r  # patience 3: three evals without a better loss
    final, early, losses = r["again"]
    assert (final, early, losses) == (r["final"], True, []), r
    assert r["said"] and f"after step {r['final']}" in r["said"][0], r
