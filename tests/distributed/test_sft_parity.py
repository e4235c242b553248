"""SFT's reference parity: a chat_template dataset with turns of very different lengths, packed, trained by
nd-adapter at tp=2 and at dp_shard=2 for several steps (and unpacked at cp=2, where each micro-batch is cut after
its last trained position), against plain transformers trained on the same prepared samples (each example attended
on its own), the same masks and the same normalisation (Σ loss / Σ trained tokens of the step), torch AdamW under
transformers' cosine schedule with warm-up, fp32 on CPU. Likewise a Phi-3 (packed HF linears, its pad token its EOS,
partial rotary, LongRoPE) and a GLM-4 (post-norms, interleaved partial rotary, q/k/v biases) the same way, packed, at
tp=2 (+SP) and dp_shard=2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.runs import vocab_of
from tests.helpers.sft import make_gemma, make_glm4, make_model, make_phi3, packed_examples, rel

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, WARMUP = 128, 2e-3, 4, 1
LAYOUTS = {"tp=2": ({"tp_size": 2, "dp_shard_size": 1}, 2, True),
           "dp_shard=2": ({"tp_size": 1, "dp_shard_size": 2}, 1, True),
           "unpacked cp=2": ({"cp_size": 2, "dp_shard_size": 1}, 2, False)}


def _cfg(model_dir: str, root: str, parallelism: dict, micro: int, pack: bool = True):
    from adapter.demo.build import ASSETS

    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache"}, "parallelism": parallelism,
           "batch": {"micro_batch_size": micro, "gradient_accumulation_steps": 1}, "seq_len": SEQ,
           "precision": "fp32",
           "optimizer": {"lr": LR, "schedule": "cosine", "warmup_steps": WARMUP, "max_steps": STEPS,
                         "clip_grad": 1e12},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": pack, "prepared_path": f"{root}/prep"}}
    return config.build(raw, env={}, world_size=2)


FAMILIES = ("phi3", "glm4", "gemma3", "gemma2")  # Phi-3, GLM-4, Gemma 3 and 2: packed at tp=2 (+SP) and dp_shard=2
PACKED = ("tp=2", "dp_shard=2")


def _worker(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    out = {name: run(_cfg(models["llama"], root, par, mb, pack), log=lambda s: None).losses
           for name, (par, mb, pack) in LAYOUTS.items()}
    for fam in FAMILIES:
        for name in PACKED:
            par, mb, pack = LAYOUTS[name]
            out[f"{fam} {name}"] = run(_cfg(models[fam], f"{root}/{fam}", par, mb, pack), log=lambda s: None).losses
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("sft-parity")
    tok = tiny_model(root / "tok")  # the demo tokenizer with chatml's markers as specials
    return {"llama": str(make_model(root / "model", tok)), "phi3": str(make_phi3(root / "phi3", tok)),
            "glm4": str(make_glm4(root / "glm4", tok)), "gemma3": str(make_gemma(root / "gemma3", tok, 3)),
            "gemma2": str(make_gemma(root / "gemma2", tok, 2))}


def test_chat_sft_matches_transformers_packed_at_tp2_dp2_and_unpacked_at_cp2(model_dir, tmp_path):

    from adapter.data.sft import prepare

    got = run_workers(_worker, 2, model_dir, str(tmp_path), timeout=900)[0]
    refs = {}
    for pack in (True, False):
        cfg = _cfg(model_dir["llama"], str(tmp_path), LAYOUTS["tp=2"][0], 2, pack)
        data = prepare(cfg, model_dir["llama"], vocab_of(cfg), builder=True, barrier=None, progress=False)
        assert data.reused  # the runs' own prepared samples
        lengths = [b - a for i in range(len(data.train)) for a, b in zip(data.train.examples(i)[:-1],
                                                                         data.train.examples(i)[1:])]
        assert max(lengths) > 3 * min(lengths)  # turns (and so examples) of very different lengths
        if not pack:  # the cut is real: most samples end well before seq_len
            assert sorted(lengths)[len(lengths) // 2] < SEQ // 2
        refs[pack] = _reference(model_dir["llama"], data, cfg)
    assert refs[True][-1] < refs[True][0] and refs[False][-1] < refs[False][0]
    cfg = _cfg(model_dir["phi3"], f"{tmp_path}/phi3", LAYOUTS["tp=2"][0], 2, True)
    data = prepare(cfg, model_dir["phi3"], vocab_of(cfg), builder=True, barrier=None, progress=False)
    pad = json.loads((Path(model_dir["phi3"]) / "config.json").read_text())["pad_token_id"]
    assert pad is not None and sum(int((data.train[i]["tokens"] == pad).sum()) for i in range(len(data.train)))
    refs["phi3"] = _reference(model_dir["phi3"], data, cfg)  # the pad token is fed (each example ends with it)
    for fam in ("glm4", "gemma3", "gemma2"):
        cfg = _cfg(model_dir[fam], f"{tmp_path}/{fam}", LAYOUTS["tp=2"][0], 2, True)
        data = prepare(cfg, model_dir[fam], vocab_of(cfg), builder=True, barrier=None, progress=False)
        if fam.startswith("gemma"):  # examples longer than the window: the local layers' windows matter
            assert max(b - a for i in range(len(data.train)) for a, b in zip(data.train.examples(i)[:-1],
                                                                              data.train.examples(i)[1:])) > 16
        refs[fam] = _reference(model_dir[fam], data, cfg)
    assert {f"{f} {n}" for f in FAMILIES for n in PACKED} <= got.keys()
    for name, losses in got.items():
        fam = name.split()[0]
        ref = refs[fam] if fam in FAMILIES else refs[LAYOUTS[name][2]]
        # fp32 reduction-order noise is ~2e-7 here; 2e-6 still sees a post-norm whose gradient is not summed over
        # TP under sequence parallelism (6e-6 after 4 steps), which the 1e-4 would not
        assert len(losses) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref)), (name, losses, ref)


def _reference(model_dir, data, cfg) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    from adapter.data import DPSampler

    # every layout reads the same 2 samples per step (one round of dp × micro-batch = 2 of the sampler's order)
    order = iter(DPSampler(len(data.train), dp_rank=0, dp_size=1, micro_batch=2, seed=cfg.data.seed))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, WARMUP, STEPS)  # what HF Trainer / Axolotl run for cosine
    ref = []
    for _ in range(STEPS):
        total, count = 0.0, 0.0
        for i in next(order):
            for loss_sum, n, _ in packed_examples(hf, data.train, i):
                total, count = total + loss_sum, count + n
        loss = total / count
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ref.append(float(loss.detach()))
    return ref
