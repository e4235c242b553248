"""GPU host only (`pytest -m gpu`): the 4- and 8-bit LoRA base on CUDA equals bitsandbytes' CUDA kernels, and LoRA /
QLoRA runs on one GPU follow transformers + PEFT (+ bitsandbytes for QLoRA, loaded as Axolotl loads it) on the same
batches within bf16's band, a mixture of experts' too (only its attention quantised)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.dist import run_workers
from tests.helpers.lora import ALL7, lora_section
from tests.helpers.sft import make_model, peft_adapter, rel

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
KW = {"r": 8, "lora_alpha": 16, "target_modules": ALL7}
ATTENTION = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def test_quantised_base_on_cuda_equals_bitsandbytes_cuda():
    """bitsandbytes' CUDA kernels quantise what Axolotl loads on GPUs: ours, per shard, must give their codes."""
    import bitsandbytes.functional as bnbf
    import torch

    from adapter.modeling.quant import int8_quantize, nf4_quantize

    assert torch.cuda.is_available()
    w = (torch.randn(1024, 2048, device="cuda") * 0.02).to(torch.bfloat16)
    codes, scales = nf4_quantize(w, None, "linear_fc2", 1, 0, None)
    q, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(codes, q.reshape(-1))
    assert torch.equal(scales, (bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset).float())
    deq = torch.ops.bitsandbytes.dequantize_4bit(codes, scales, 64, "nf4", [1024, 2048], torch.bfloat16)
    assert torch.equal(deq, bnbf.dequantize_4bit(q, state))
    cb, stats = int8_quantize(w, True, 1, None)  # a column-parallel linear
    ref_cb, ref_stats, _ = bnbf.int8_vectorwise_quant(w.half())  # Int8Params quantises the fp16 weight
    assert torch.equal(stats, ref_stats) and (cb.int() - ref_cb.int()).abs().max() <= 1  # CUDA rounds half away
    assert (cb != ref_cb).float().mean() < 1e-3


@pytest.mark.parametrize("fused", ["linear_qkv", "linear_fc1"])
def test_packed_phi3_base_on_cuda_equals_bitsandbytes_of_the_whole_hf_tensor(fused):
    """Phi-3's qkv_proj / gate_up_proj: bitsandbytes quantises each as one tensor (one double-quantisation vector
    in the HF row order); ours, in Megatron's row order, must give the same codes and scales row for row."""
    import bitsandbytes.functional as bnbf
    import torch

    from adapter.modeling.quant import nf4_quantize, packed_of
    from adapter.models.arch import arch_from_hf_dict
    from adapter.models.mapping import Ctx

    arch = arch_from_hf_dict({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 1024,
                              "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2048,
                              "num_hidden_layers": 1, "vocab_size": 512})
    rule, c = packed_of(arch, fused), Ctx(arch, 0)
    rows = 1024 + 2 * 256 if fused == "linear_qkv" else 2 * 2048
    hf = (torch.randn(rows, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    hf[: rows // 3] *= 4  # rows of another scale, so that mixing the parts' absmaxes would show
    codes, scales = nf4_quantize(rule.to_megatron([hf], c), arch, fused, 1, 0, None)
    q, state = bnbf.quantize_4bit(hf, blocksize=64, compress_statistics=True, quant_type="nf4")
    want = (bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset).float().view(rows, -1)
    assert torch.equal(scales.view(rows, -1), rule.to_megatron([want], c))
    per = lambda p: torch.stack([p >> 4, p & 15], 1).reshape(rows, 1024)  # noqa: E731
    assert torch.equal(per(codes), rule.to_megatron([per(q.reshape(-1))], c))


SEQ, LR, STEPS, MICRO = 256, 2e-3, 4, 2


def _cfg(model_dir: str, root: str, adapter: str, fmt: str | None, kw: dict = KW):
    """One GPU, bf16, synthetic tokens (the GPU host has no `datasets`): every token trained; a mixture of experts
    without its load-balancing loss (the reference computes the LM loss alone)."""
    from adapter import config

    lora = lora_section(kw, adapter) | {"quantize_base": fmt}
    moe = {"output_router_logits": False} if kw == ATTENTION else {}
    return config.build({"model": {"path": model_dir, "cache_dir": f"{root}/cache", "fused_kernels": True, **moe},
                         "batch": {"micro_batch_size": MICRO, "gradient_accumulation_steps": 1}, "seq_len": SEQ,
                         "precision": "bf16", "lora": lora, "data": {"synthetic": True},
                         "optimizer": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "max_steps": STEPS,
                                       "clip_grad": 1e12}}, env={}, world_size=1)


def _worker(rank, world, model_dir, adapter, root, kw):
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    out = {}
    for fmt in (None, "nf4"):
        t = Trainer(resolve_run(_cfg(model_dir, root, adapter, fmt, kw)), log=lambda s: None)
        try:
            t.setup()
            out[str(fmt)] = t.fit().losses
        finally:
            t.close()
    return out


def _reference(model_dir: str, adapter: str, cfg, **load) -> list[float]:
    """transformers + PEFT from the adapter on the run's samples, in its order (fp32 AdamW on fp32 adapters)."""
    import torch
    import torch.nn.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from adapter.data import DPSampler
    from adapter.data.synthetic import SyntheticData

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map={"": 0}, **load)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    data = SyntheticData(base.config.vocab_size, SEQ, cfg.seed)
    order = iter(DPSampler(len(data), dp_rank=0, dp_size=1, micro_batch=MICRO, seed=cfg.data.seed,
                           data_key="data.files"))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        batch = [data[i] for i in next(order)]
        ids = torch.as_tensor(np.stack([b["tokens"] for b in batch]), device="cuda")
        labels = torch.as_tensor(np.stack([b["labels"] for b in batch]), device="cuda")
        logits = model(input_ids=ids).logits.float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_lora_and_qlora_on_one_gpu_follow_peft(tmp_path, kind):
    """16-bit and NF4 bases; a mixture of experts (Qwen3-MoE, 4 experts, top 2) with LoRA on q/k/v/o, whose NF4 base
    is the attention alone, as transformers + bitsandbytes load it (router and experts in bf16)."""
    import torch
    from transformers import BitsAndBytesConfig

    from tests.helpers.sft import make_moe
    from tests.helpers.sft_data import tiny_model

    tok = tiny_model(tmp_path / "tok")
    model = str(make_model(tmp_path / "model", tok, hidden=256) if kind == "llama" else
                make_moe(tmp_path / "model", tok, hidden=256))
    kw = KW if kind == "llama" else ATTENTION
    adapter = str(peft_adapter(model, kw, tmp_path / "adapter"))
    got = run_workers(_worker, 1, model, adapter, str(tmp_path), kw, timeout=900)[0]
    cfg = _cfg(model, str(tmp_path), adapter, None, kw)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    ref = {"None": _reference(model, adapter, cfg), "nf4": _reference(model, adapter, cfg, quantization_config=nf4)}
    assert rel(ref["None"][0], ref["nf4"][0]) > 1e-3  # the 4-bit base changes the loss: the test can fail
    for fmt, losses in got.items():
        assert rel(losses[0], ref[fmt][0]) < 1e-2, (fmt, losses, ref[fmt])
        assert all(rel(a, b) < 3e-2 for a, b in zip(losses, ref[fmt])), (fmt, losses, ref[fmt])
