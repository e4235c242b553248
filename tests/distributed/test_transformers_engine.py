"""The transformers engine against plain transformers: tiny random models of architectures no native family covers
(tests/helpers/archs.py: Phi-2, GPT-NeoX, StarCoder2, gpt-oss, DeepSeek-V3, GLM-4.5, Llama 4, Qwen3-Next, Granite
4, OLMo 3, Mistral 3's image-text checkpoint), each trained by nd-adapter for 4 steps at dp_shard=2 under ZeRO-3 on
packed chat data (the hybrids' packed documents run as rows of their own: adapter/modeling/hf_unpack.py), against
transformers trained on the same prepared samples (each packed example on its own), the same masks and the same
normalisation (Σ loss / Σ trained tokens of the step), torch AdamW, fp32 on CPU; gpt-oss as OpenAI ships it (MXFP4
experts) trains dequantized as transformers loads it and exports 16-bit weights. A native family forced onto the
transformers engine gives the native engine's losses, so the two engines check each other. Context parallelism
(cp=2, dp_shard=1) through transformers' attention interface gives transformers' losses on Phi-2, DeepSeek-V3 (MLA,
on the ring), OLMo 3 (sliding-window and full layers) on packed documents and on StarCoder2 (every layer windowed)
unpacked, and says so in the run's first lines. Llama 4 in Axolotl's linearized layout (one linear per expert) gives
the losses of transformers' Llama 4 on the same weights, and exports in transformers' layout.

On a dense, a mixture-of-experts and a hybrid model, 4 processes: dp_shard=4 under ZeRO-3, exact HSDP (dp_replicate=2
× dp_shard=2) and tensor parallelism from the model's own plan (tp=2 × dp_shard=2, two micro-batches a step) give
transformers' losses (DeepSeek-V3's and OLMo 3's plans at tp=2 too; cp=2 × dp_shard=2 on the dense one; expert
parallelism from gpt-oss's own plan, ep=2 × dp_shard=4); a run saved under HSDP (gpt-oss's with ep=2) continues at
tp=2 × dp_shard=2 under ZeRO-2 on the same curve, gpt-oss's saved at ep=1 continues at ep=4 under ZeRO-2, and their
`save_pretrained` exports (gathered over TP, over EP) load in transformers with the reference's trained weights.
Compiled layers (Dynamo and AOTAutograd, the aot_eager backend) give transformers' losses at tp=2 with gradient
checkpointing on Phi-2 and at ep=2 × dp_shard=2 on gpt-oss, under ZeRO-2."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adapter import config
from tests.helpers.archs import ARCHS, HYBRID, VISION, linearized, make_arch, mxfp4, prequantized, reference_model
from tests.helpers.cli import run_cli
from tests.helpers.dist import run_workers
from tests.helpers.quant_expert_lora import nf4_round_trip_experts
from tests.helpers.runs import vocab_of
from tests.helpers.sft import axolotl_freeze, batch_of, hf_loss, make_model, make_moe, packed_examples, rel

pytestmark = pytest.mark.slow
SEQ, LR, STEPS = 128, 2e-3, 4
MODELS = (*ARCHS, *VISION)
# compiled layers where Dynamo meets the most: tp's collectives and gradient checkpointing on the dense model, the
# expert all-to-all and data-dependent routing on the MoE (the hybrids' torch fallback kernels take minutes to trace)
COMPILED = {"phi": {"tp_size": 2, "dp_shard_size": 1, "recompute": "full"}, "gpt_oss": {"ep_size": 2}}
TP_ARCHS = ("deepseek_v3", "olmo3")  # plans with MLA's kv_a_proj, and with gathered q/k/v and a split o_proj input
# context parallelism through transformers' attention interface (adapter/modeling/hf_cp.py): (packed, cp_comm_type)
CP_ARCHS = {"phi": (True, "all_gather"), "deepseek_v3": (True, "p2p"),  # MLA on the ring
            "olmo3": (True, "all_gather"),  # sliding-window and full layers
            "starcoder2": (False, "all_gather")}  # one causal stream per sample, every layer windowed


# nd-adapter's fused linear CE over the body's hidden states (model.fused_linear_ce: true): MoE, MLA, hybrid, windows
FUSED_CE = ("olmo3", "starcoder2", "deepseek_v3", "qwen3_next", "gpt_oss")


def _cfg(model_dir: str, root: str, pack: bool, engine: str = "auto", world: int = 2, steps: int = STEPS,
         zero: int = 3, ckpt: str | None = None, export: str | None = None, lora: dict | None = None,
         unfrozen: list[str] | None = None, optimizer: str = "adamw", ga: int = 1, liger: tuple = (),
         recompute: str = "none", compile: bool = False, dequantize: bool = False, fused_ce: bool | str = "auto",
         linearized: bool = False, **parallelism):
    from adapter.demo.build import ASSETS

    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache", "engine": engine,
                     "unfrozen_parameters": unfrozen, "liger": liger, "compile": compile, "dequantize": dequantize,
                     "fused_linear_ce": fused_ce, "linearized_experts": linearized},
           "parallelism": {"dp_shard_size": world, **parallelism},
           "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": ga}, "seq_len": SEQ, "precision": "fp32",
           "recompute": recompute,
           "optimizer": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "max_steps": steps, "clip_grad": 1e12,
                         "name": optimizer},
           "deepspeed": {"zero_stage": zero}, "checkpoint": {"dir": ckpt, "export_hf": export},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": pack, "prepared_path": f"{root}/prep-{pack}"}}
    if lora is not None:
        raw["lora"] = lora
    return config.build(raw, env={}, world_size=world)


def _worker(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for name in MODELS:  # the fixture's native models train below (llama) or in the LoRA test (qwen3_moe)
        lines: list[str] = []  # packed, the hybrids too (their documents run as rows of their own: hf_unpack)
        res = train(_cfg(models[name], f"{root}/{name}", True, fused_ce=name in FUSED_CE or "auto"), log=lines.append)
        out[name] = (res.losses, [ln for ln in lines if ln.startswith("engine:")])
    lines = []  # whole rows at cp = 1: its sliding-window layers through local_attention (checks.own_attention)
    out["olmo3 rows"] = (train(_cfg(models["olmo3"], f"{root}/olmo3-rows", False), log=lines.append).losses, lines)
    for name in TP_ARCHS:  # tensor parallelism from the model's own plan: MLA's split rope key, gathered q/k/v
        lines = []
        res = train(_cfg(models[name], f"{root}/{name}-tp", True, dp_shard_size=1, tp_size=2), log=lines.append)
        out[f"{name} tp"] = (res.losses, [ln for ln in lines if ln.startswith("engine:")])
    for name, (pack, comm) in CP_ARCHS.items():
        lines = []
        res = train(_cfg(models[name], f"{root}/{name}", pack, dp_shard_size=1, cp_size=2, cp_comm_type=comm,
                         fused_ce=name in FUSED_CE or "auto"), log=lines.append)  # each rank's chunk of tokens
        out[f"{name} cp"] = (res.losses, [ln for ln in lines if ln.startswith("engine:")])
    import functools

    import torch
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")  # Dynamo + AOTAutograd, for these runs only
    for name, over in COMPILED.items():  # compiled layers (ZeRO-2: not beside ZeRO-3's gathers)
        lines = []
        res = train(_cfg(models[name], f"{root}/{name}-compiled", True, zero=2, compile=True, **over),
                    log=lines.append)
        out[f"{name} compiled"] = (res.losses, [ln for ln in lines if ln.startswith("engine:")],
                                   counters["stats"]["unique_graphs"])  # Dynamo traced the layers (reset per run)
    torch.compile = compile_
    lines = []  # gpt-oss as OpenAI ships it (MXFP4 experts), dequantized as it loads; exported as 16-bit weights
    res = train(_cfg(models["gpt_oss-mxfp4"], f"{root}/mxfp4", True, dequantize=True, export=f"{root}/mxfp4/out"),
                log=lines.append)
    out["gpt_oss mxfp4"] = (res.losses, [ln for ln in lines if ln.startswith("weights:")], res.exported)
    lines = []  # Axolotl's linearized Llama 4 experts: transformers' model of the same weights, exported in its layout
    res = train(_cfg(models["llama4_text-linearized"], f"{root}/linearized", True, linearized=True,
                     export=f"{root}/linearized/out"), log=lines.append)
    out["llama4 linearized"] = (res.losses, [ln for ln in lines if ln.startswith("engine:")], res.exported)
    llama = models["llama"]
    out["llama forced"] = (train(_cfg(llama, f"{root}/forced", True, engine="transformers"),
                                 log=lambda s: None).losses, [])
    lines = []  # Liger's cross-entropy asked: the model's own loss (on CPU transformers' loss function), summed
    out["llama liger"] = (train(_cfg(llama, f"{root}/liger", True, engine="transformers", zero=2,
                                     liger=("fused_linear_cross_entropy", "rms_norm")), log=lines.append).losses,
                          [ln for ln in lines if ln.startswith("engine:")])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("hf-engine")
    tok = tiny_model(root / "tok")
    made = {name: str(make_arch(name, root / name, tok)) for name in MODELS}
    nf4 = str(prequantized(Path(made["phi"]), root / "phi-nf4"))  # bitsandbytes' codes saved: a pre-quantised base
    return {**made, "llama": str(make_model(root / "llama", tok)), "phi-nf4": nf4,
            "llama4_text-linearized": str(linearized(Path(made["llama4_text"]), root / "llama4-linearized")),
            "gpt_oss-mxfp4": str(mxfp4(Path(made["gpt_oss"]), root / "gpt_oss-mxfp4")),
            "qwen3_moe": str(make_moe(root / "qwen3_moe", tok, router_loss=False))}


def _reference(model_dir: str, cfg, dp: int = 2, model_out: list | None = None) -> list[float]:
    """transformers trained on the run's own prepared samples, in the order the `dp` ranks' samplers deal them
    (`model_out` receives the trained model)."""
    import torch

    from adapter.data import DPSampler
    from adapter.data.sft import prepare

    data = prepare(cfg, model_dir, vocab_of(cfg), builder=True, barrier=None, progress=False).train
    model = reference_model(Path(model_dir), quantize="dequantize" if cfg.model.dequantize else
                            cfg.lora.quantize_base if cfg.lora else None)
    if cfg.lora is not None and cfg.lora.quantize_experts and cfg.lora.target_parameters:
        nf4_round_trip_experts(model)  # adapted quantised experts: PEFT's delta over the dequantised weights
    if cfg.lora is not None:  # PEFT itself, seeded as the run seeds it
        import peft

        torch.manual_seed(cfg.seed)
        c = cfg.lora  # Axolotl's LoraConfig: all-linear, or the listed modules (none beside target_parameters)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=c.r, lora_alpha=c.alpha, target_modules="all-linear" if c.target_linear else c.target_modules or [],
            target_parameters=c.target_parameters, use_dora=c.use_dora, rank_pattern=c.rank_pattern or {},
            trainable_token_indices=c.trainable_token_indices,
            alpha_pattern=c.alpha_pattern or {}, init_lora_weights="gaussian" if c.init_weights == "gaussian" else True,
            task_type="CAUSAL_LM"))
    if cfg.lora is not None and cfg.lora.quantize_experts and not cfg.lora.target_parameters:  # as Axolotl's loader
        # (monkeypatch/moe_quant.py); adapted experts hold their NF4 round trip as plain weights instead (above)
        _axolotl_quantize_experts(model, cfg.lora.quantize_base)
    if cfg.model.unfrozen_parameters is not None:  # Axolotl's freezing on the HF model
        axolotl_freeze(model, cfg.model.unfrozen_parameters)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps,
                            weight_decay=0.0)
    its = [iter(DPSampler(len(data), dp_rank=r, dp_size=dp, micro_batch=1, seed=cfg.data.seed)) for r in range(dp)]
    losses = []
    for _ in range(STEPS):
        idx = [next(it)[0] for it in its]
        if cfg.data.sample_packing:
            parts = [(s, n) for i in idx for s, n, _ in packed_examples(model, data, i)]
            loss = sum(s for s, _ in parts) / max(sum(n for _, n in parts), 1.0)
        else:  # one example per row, padded after it: the whole row is causal and its tail untrained
            batch = batch_of(data, idx)
            loss = hf_loss(model, {**batch, "position_ids": torch.arange(SEQ).expand(dp, -1)})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if model_out is not None:
        model_out.append(model)
    return losses


def _axolotl_quantize_experts(model, fmt: str) -> None:
    """Axolotl 067b021's quantize_moe_experts (monkeypatch/moe_quant.py), on every >= 3-D parameter naming an expert:
    bitsandbytes' replace_parameter_4bit for a 4-bit base; for an 8-bit one Axolotl's own parametrisation (int8 codes
    of the fp16 weight, dequantised by int8_vectorwise_dequant), written out from its source, with the weight seen as
    rows of its last dimension (bitsandbytes' CUDA op does that itself, its CPU op needs it done)."""
    import bitsandbytes.functional as bnbf
    import torch
    import torch.nn.utils.parametrize as P
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    class Bnb8bitParametrization(torch.nn.Module):
        def __init__(self, row_stats):
            super().__init__()
            self.register_buffer("row_stats", row_stats)

        @torch.no_grad()
        def forward(self, q):
            return bnbf.int8_vectorwise_dequant(q.reshape(-1, q.shape[-1]), self.row_stats).reshape(q.shape)

    for name, p in list(model.named_parameters()):
        if p.dim() >= 3 and "expert" in name.lower():
            mod, _, pname = name.rpartition(".")
            module = model.get_submodule(mod)
            if fmt == "nf4":
                replace_parameter_4bit(module, pname, compress_statistics=True, quant_type="nf4")
                continue
            codes, stats, _ = bnbf.int8_vectorwise_quant(p.data.reshape(-1, p.shape[-1]).to(torch.float16))
            setattr(module, pname, torch.nn.Parameter(codes.reshape(p.shape), requires_grad=False))
            P.register_parametrization(module, pname, Bnb8bitParametrization(stats), unsafe=True)


def _same_weights(exported: str, model) -> None:
    """The export loads in transformers as it was saved (16-bit weights: no quantization_config) and computes what
    `model` computes (Adam moves near-zero gradients by ±lr: compare what the weights compute)."""
    import json

    assert "quantization_config" not in json.loads((Path(exported) / "config.json").read_text())
    probe = _probe(exported)
    assert rel(float(hf_loss(reference_model(Path(exported)), probe)), float(hf_loss(model, probe))) < 1e-4


def test_architectures_no_native_family_covers_match_transformers_at_dp_shard2_zero3(models, tmp_path):
    got = run_workers(_worker, 2, models, str(tmp_path), timeout=1200)[0]
    for name in MODELS:
        losses, said = got[name]
        assert len(said) == 1 and "engine: transformers' own" in said[0] and "no native family" in said[0], said
        if name in VISION:
            assert "its language model trains on text, the other towers frozen" in said[0]
        assert (name in FUSED_CE) == ("nd-adapter's fused linear CE over the body's hidden states" in said[0]), said
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}", True))
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
    # at cp = 1 on nd-adapter's kernels (packed documents by their boundaries: checks.own_attention) where they
    # compute the model's attention; not beside sinks (gpt-oss), chunked attention (Llama 4) or a hybrid's layers
    own = {name for name in MODELS if "nd-adapter's kernels" in got[name][1][0]}
    assert {"phi", "olmo3", "starcoder2", "deepseek_v3", "mistral3"} <= own, own
    assert not own & {"gpt_oss", "llama4_text", *HYBRID}, own
    want = _reference(models["olmo3"], _cfg(models["olmo3"], f"{tmp_path}/olmo3-rows", False))
    assert max(rel(a, b) for a, b in zip(got["olmo3 rows"][0], want)) < 1e-4, (got["olmo3 rows"][0], want)
    for name in TP_ARCHS:
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}-tp", True, dp_shard_size=1,
                                             tp_size=2), dp=1)
        losses, said = got[f"{name} tp"]
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
        assert "tp=2 from its own tensor-parallel plan" in said[0], said
    for name, (pack, comm) in CP_ARCHS.items():
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}", pack, dp_shard_size=1,
                                             cp_size=2, cp_comm_type=comm), dp=1)
        losses, said = got[f"{name} cp"]
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, comm, losses, want)
        assert "cp=2 through transformers' attention interface" in said[0], said
        assert (name in FUSED_CE) == ("fused linear CE" in said[0]), said
    for name, over in COMPILED.items():
        losses, said, graphs = got[f"{name} compiled"]
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}-compiled", True, **over),
                          dp=1 if over.get("dp_shard_size") == 1 else 2)
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
        assert "each decoder layer compiled" in said[0] and graphs > 0, (said, graphs)
    losses, said, exported = got["gpt_oss mxfp4"]
    trained: list = []
    want = _reference(models["gpt_oss-mxfp4"], _cfg(models["gpt_oss-mxfp4"], f"{tmp_path}/mxfp4", True,
                                                    dequantize=True), model_out=trained)
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (losses, want)
    assert max(rel(a, b) for a, b in zip(losses, got["gpt_oss"][0])) > 1e-2  # the codes, not the 16-bit original
    assert "dequantized by transformers' loader into 16-bit weights that train" in said[0], said
    _same_weights(exported, trained[0])  # a 16-bit checkpoint: no quantization_config left
    losses, said, exported = got["llama4 linearized"]
    trained = []  # transformers' own Llama 4 on the checkpoint the linearized one was written from
    want = _reference(models["llama4_text"], _cfg(models["llama4_text-linearized"], f"{tmp_path}/linearized", True,
                                                  linearized=True), model_out=trained)
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (losses, want)
    assert "its experts as one linear per expert and projection (model.linearized_experts: Axolotl's layout" in \
        said[0] and "exported in transformers' fused layout" in said[0], said
    _same_weights(exported, trained[0])  # transformers' layout: loads in transformers with no weight missing
    native = _reference(models["llama"], _cfg(models["llama"], f"{tmp_path}/forced", True))
    assert max(rel(a, b) for a, b in zip(got["llama forced"][0], native)) < 1e-4
    losses, said = got["llama liger"]
    assert "Liger's fused_linear_cross_entropy, rms_norm kernels where CUDA runs them" in said[0], said
    assert max(rel(a, b) for a, b in zip(losses, native)) < 1e-4, (losses, native)


REPRESENTATIVE = ("phi", "gpt_oss", "qwen3_next")  # one dense, one mixture of experts, one hybrid
LAYOUTS = {"dp_shard=4 ZeRO-3": {}, "dp_replicate=2 × dp_shard=2 (exact HSDP), recompute": {
    "dp_replicate_size": 2, "dp_shard_size": 2, "recompute": "full"},  # transformers' gradient checkpointing
           "tp=2 × dp_shard=2 ZeRO-3 (2 micro-batches)": {"tp_size": 2, "dp_shard_size": 2, "ga": 2}}
CP_LAYOUT = "cp=2 × dp_shard=2 ZeRO-3 (2 micro-batches)"
EP_ARCHS, EP_LAYOUT = ("gpt_oss",), "ep=2 × dp_shard=4 ZeRO-3"


def _layouts(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for name in REPRESENTATIVE:
        path, pack, at = models[name], True, f"{root}/{name}"
        said: list[str] = []
        out[name] = {lay: train(_cfg(path, at, pack, world=4, **over), log=said.append).losses
                     for lay, over in LAYOUTS.items()}
        out[name]["recompute said"] = [ln for ln in said if ln.startswith("recompute: transformers' gradient")]
        ck = f"{at}/ckpt"  # 2 steps under exact HSDP, then on at tp=2 × dp_shard=2 under ZeRO-2, exported
        ep = {"ep_size": 2} if name in EP_ARCHS else {}  # the MoE one saved with its experts split over 2 ranks
        train(_cfg(path, at, pack, world=4, steps=2, ckpt=ck, dp_replicate_size=2, dp_shard_size=2, **ep),
              log=lambda s: None)
        lines: list[str] = []
        moved = train(_cfg(path, at, pack, world=4, zero=2, ckpt=ck, export=f"{at}/export", tp_size=2,
                           dp_shard_size=2, ga=2), resume=True, log=lines.append)
        out[name]["moved"] = (moved.start_step, moved.losses, [ln for ln in lines if "resharded" in ln])
        out[name]["export"] = moved.exported
        if name in EP_ARCHS:  # its own expert-parallel plan: ep=2 from the start; ep=1 -> ep=4 at a resume
            lines = []
            out[name][EP_LAYOUT] = train(_cfg(path, at, pack, world=4, ep_size=2), log=lines.append).losses
            out[name]["ep said"] = [ln for ln in lines if ln.startswith("engine:")]
            ck = f"{at}/ckpt-ep"
            train(_cfg(path, at, pack, world=4, steps=2, ckpt=ck), log=lambda s: None)
            lines = []
            moved = train(_cfg(path, at, pack, world=4, zero=2, ckpt=ck, export=f"{at}/export-ep", ep_size=4),
                          resume=True, log=lines.append)
            out[name]["moved ep"] = (moved.start_step, moved.losses, [ln for ln in lines if "resharded" in ln])
            out[name]["export ep"] = moved.exported
    # cp on the dense one only: gpt-oss's attention sinks and Qwen3-Next's linear attention refuse it
    out["phi"][CP_LAYOUT] = train(_cfg(models["phi"], f"{root}/phi", True, world=4, cp_size=2, dp_shard_size=2, ga=2),
                                  log=lambda s: None).losses
    return out


def _probe(model_dir: str) -> dict:
    """One batch of the model's vocabulary with every position trained."""
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 1000, (2, SEQ + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, SEQ),
            "position_ids": torch.arange(SEQ).expand(2, -1)}


def test_layouts_resume_at_another_layout_and_export_on_a_dense_a_moe_and_a_hybrid_model(models, tmp_path):
    got = run_workers(_layouts, 4, models, str(tmp_path), timeout=1200)[0]
    for name in REPRESENTATIVE:
        trained: list = []
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}", True, world=4),
                          dp=4, model_out=trained)
        for lay in (*LAYOUTS, *([CP_LAYOUT] if name == "phi" else []), *([EP_LAYOUT] if name in EP_ARCHS else [])):
            assert max(rel(a, b) for a, b in zip(got[name][lay], want)) < 1e-4, (name, lay, got[name][lay], want)
        assert len(got[name]["recompute said"]) == 1, got[name]["recompute said"]  # applied, on its 2 layers
        assert "on its 2 decoder layers" in got[name]["recompute said"][0], got[name]["recompute said"]
        start, losses, said = got[name]["moved"]
        assert start == 2 and len(said) == 1, (name, start, said)
        assert max(rel(a, b) for a, b in zip(losses, want[2:])) < 1e-4, (name, losses, want)
        ref = trained[0]
        probe = _probe(models[name])
        for export in ("export", *(["export ep"] if name in EP_ARCHS else [])):
            exported = reference_model(Path(got[name][export]))  # transformers loads it: the reference's model
            assert {n: p.shape for n, p in exported.named_parameters()} == \
                {n: p.shape for n, p in ref.named_parameters()}
            # Adam moves near-zero gradients by ±lr: compare what the weights compute
            assert rel(float(hf_loss(exported, probe)), float(hf_loss(ref, probe))) < 1e-4, (name, export)
        if name in EP_ARCHS:
            assert "ep=2 from its own expert-parallel plan" in got[name]["ep said"][0], got[name]["ep said"]
            start, losses, said = got[name]["moved ep"]
            assert start == 2 and len(said) == 1, (name, start, said)
            assert max(rel(a, b) for a, b in zip(losses, want[2:])) < 1e-4, (name, losses, want)


LORA = {"r": 4, "alpha": 8, "target_linear": True}
QLORA = {**LORA, "quantize_base": "nf4"}
# Axolotl's quantize_moe_experts: the attention adapted, the experts' 3-D weights NF4 beside the NF4 linears
QEXPERTS = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "quantize_base": "nf4",
            "quantize_experts": True}
INT8_EXPERTS = {**QEXPERTS, "quantize_base": "int8"}
UNFROZEN = ["^model.layers.1.", "^lm_head.weight[:512]"]
DORA = {**LORA, "use_dora": True}
# Axolotl's lora_rank_pattern / lora_alpha_pattern and peft_init_lora_weights: gaussian, as PEFT applies them
PATTERNS = {**LORA, "rank_pattern": {"q_proj": 8, "down_proj": 2}, "alpha_pattern": {"v_proj": 32},
            "init_weights": "gaussian"}
TOKENS = {**LORA, "trainable_token_indices": [3, 17, 200]}  # Axolotl's peft_trainable_token_indices
EXPERTS = {"r": 4, "alpha": 8, "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
# Axolotl's Gemma 4 26B-A4B QLoRA: the experts quantised (NF4) and adapted too, beside the attention's adapters
QEXPERT_LORA = {**QEXPERTS, "target_parameters": EXPERTS["target_parameters"]}


def _expert_lora(models, root) -> dict:
    """LoRA on the fused expert parameters alone (Axolotl's lora_target_parameters): gpt-oss under ZeRO-3,
    exported; Qwen3-MoE, a native family the native adapters cannot take it on, under ZeRO-2."""
    from tests.helpers.runs import train

    out = {}
    for name, zero in (("gpt_oss", 3), ("qwen3_moe", 2)):
        lines: list[str] = []
        res = train(_cfg(models[name], f"{root}/{name}-experts", True, lora=EXPERTS, zero=zero,
                         export=f"{root}/{name}-experts/adapter"), log=lines.append)
        out[f"{name} experts"] = (res.losses, res.exported, [ln for ln in lines if ln.startswith(("lora:", "engine:"))])
    lines = []  # the experts NF4 and adapted (quantize_moe_experts + lora_target_parameters), ZeRO-3, exported
    res = train(_cfg(models["qwen3_moe"], f"{root}/qexperts", True, lora=QEXPERT_LORA,
                     export=f"{root}/qexperts/adapter"), log=lines.append)
    out["qexperts"] = (res.losses, res.exported, [ln for ln in lines if ln.startswith("lora:")])
    return out


def _check_expert_lora(got: dict, models, tmp_path) -> None:
    """PEFT's losses on the same batches; the engine line says why Qwen3-MoE left the native engine; PEFT loads the
    gpt-oss export and computes the trained model's logits, and `merge-lora` folds the expert deltas in."""
    import peft
    import torch

    for name, zero in (("gpt_oss", 3), ("qwen3_moe", 2)):
        losses, exported, said = got[f"{name} experts"]
        trained: list = []
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}-experts", True, lora=EXPERTS,
                                             zero=zero), model_out=trained)
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
        assert "on experts.down_proj, experts.gate_up_proj (PEFT on transformers' model)" in said[1], said
        if name == "qwen3_moe":
            assert "the native engine does not reproduce it: lora.target_parameters=" in said[0], said
            continue
        probe = _probe(models[name])
        loaded = peft.PeftModel.from_pretrained(reference_model(Path(models[name])), exported)
        with torch.no_grad():
            logits = [m(input_ids=probe["tokens"], position_ids=probe["position_ids"]).logits
                      for m in (loaded, trained[0])]
        assert torch.allclose(*logits, rtol=0, atol=1e-4), (logits[0] - logits[1]).abs().max()
        b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
        assert len(b) == 4 and all(p.abs().sum() > 0 for p in b)  # two experts' parameters × two layers, trained
        conf = tmp_path / "merge-experts.yaml"
        conf.write_text(yaml.safe_dump({"model": {"path": models[name]}, "lora": EXPERTS}))
        code, _, err = run_cli("merge-lora", "--config", str(conf), "--adapter", exported,
                               "--out", str(tmp_path / "merged-experts"))
        assert code == 0, err
        merged = reference_model(tmp_path / "merged-experts")
        assert rel(float(hf_loss(merged, probe)), float(hf_loss(trained[0], probe))) < 1e-4
    # quantised and adapted experts: PEFT over the NF4 round trip of the expert weights (plain values, `_reference`),
    # and the export loads in PEFT on that base, computing what the trained model computes
    losses, exported, said = got["qexperts"]
    trained = []
    cfg = _cfg(models["qwen3_moe"], f"{tmp_path}/qexperts", True, lora=QEXPERT_LORA)
    want = _reference(models["qwen3_moe"], cfg, model_out=trained)
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (losses, want)
    assert "experts.down_proj, experts.gate_up_proj" in said[0] and "quantised too" in said[0], said
    base = reference_model(Path(models["qwen3_moe"]), quantize="nf4")
    nf4_round_trip_experts(base)
    probe = _probe(models["qwen3_moe"])
    loaded = peft.PeftModel.from_pretrained(base, exported)
    loaded.train()  # bitsandbytes' NF4 linears take another CPU kernel in eval mode (patches/bnb_cpu.py)
    assert rel(float(hf_loss(loaded, probe)), float(hf_loss(trained[0], probe))) < 1e-4


def _lora(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = {}
    for name in REPRESENTATIVE:
        lines: list[str] = []
        res = train(_cfg(models[name], f"{root}/{name}", name not in HYBRID, lora=LORA,
                         export=f"{root}/{name}/adapter"), log=lines.append)
        out[name] = (res.losses, res.exported, [ln for ln in lines if ln.startswith("lora:")])
    # LoRA on attention beside expert parallelism (gpt-oss's own EP plan): the experts split, the adapters whole
    out["gpt_oss ep"] = train(_cfg(models["gpt_oss"], f"{root}/gpt_oss-ep", True, lora=LORA, ep_size=2),
                              log=lambda s: None).losses
    lines = []  # LoRA at tp=2: B split on colwise bases, A on rowwise ones; the export gathered over TP
    res = train(_cfg(models["phi"], f"{root}/phi-tp", True, lora=LORA, export=f"{root}/phi-tp/adapter",
                     dp_shard_size=1, tp_size=2), log=lines.append)
    out["lora tp"] = (res.losses, res.exported)
    lines = []  # QLoRA: the base loaded in NF4 by bitsandbytes, its codes partitioned by ZeRO-3
    out["qlora"] = train(_cfg(models["phi"], f"{root}/qlora", True, lora=QLORA, zero=3), log=lines.append).losses
    out["qlora said"] = [ln for ln in lines if ln.startswith("lora:") or "NF4 base's codes" in ln]
    # the same NF4 codes from a pre-quantised checkpoint (its quantization_config), loaded as they are, ZeRO-2
    out["qlora prequantized"] = train(_cfg(models["phi-nf4"], f"{root}/qlora-pre", True, lora=QLORA, zero=2),
                                      log=lambda s: None).losses
    lines = []  # bitsandbytes' AdamW8bit stepped by ZeRO-3
    out["8bit"] = train(_cfg(models["phi"], f"{root}/8bit", True, optimizer="adamw_8bit"), log=lines.append).losses
    out["8bit said"] = [ln for ln in lines if ln.startswith("optimizer:")]
    lines = []  # torchao's AdamW4bit stepped by ZeRO-3 (each partition's whole blocks 4-bit, the rest fp32)
    out["4bit"] = train(_cfg(models["phi"], f"{root}/4bit", True, optimizer="adamw_4bit"), log=lines.append).losses
    out["4bit said"] = [ln for ln in lines if ln.startswith("optimizer:")]
    lines = []  # unfrozen_parameters on transformers' names: one layer and half of lm_head's rows
    out["unfrozen"] = train(_cfg(models["phi"], f"{root}/unfrozen", True, unfrozen=UNFROZEN), log=lines.append).losses
    out["unfrozen said"] = [ln for ln in lines if "tensors trained" in ln]
    lines = []  # quantize_moe_experts on a native mixture: `auto` takes the transformers engine; ZeRO-3 with every
    cfg = _cfg(models["qwen3_moe"], f"{root}/qlora-experts", True, lora=QEXPERTS)  # parameter partitioned
    cfg = cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(update={"param_persistence_threshold": 0})})
    out["qlora experts"] = (train(cfg, log=lines.append).losses,
                            [ln for ln in lines if ln.startswith(("engine:", "lora:")) or "base's codes" in ln])
    ck = f"{root}/qlora-experts-ckpt"  # saved at step 2 (adapters and optimizer), resumed: the base quantised again
    train(cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"max_steps": 2}),
                                 "checkpoint": cfg.checkpoint.model_copy(update={"dir": ck})}), log=lambda s: None)
    resumed = train(cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"dir": ck})}),
                    resume=True, log=lambda s: None)
    out["qlora experts resumed"] = (resumed.start_step, resumed.losses)
    lines = []  # the same with an 8-bit base: Axolotl's own int8 parametrisation of the experts
    out["int8 experts"] = (train(_cfg(models["qwen3_moe"], f"{root}/int8-experts", True, lora=INT8_EXPERTS),
                                 log=lines.append).losses, [ln for ln in lines if ln.startswith("lora:")])
    lines = []  # a native mixture of experts with unfrozen_parameters: `auto` takes the transformers engine
    out["moe unfrozen"] = (train(_cfg(models["qwen3_moe"], f"{root}/moe-unfrozen", True, unfrozen=UNFROZEN),
                                 log=lines.append).losses, [ln for ln in lines if ln.startswith("engine:")])
    out.update(_expert_lora(models, root))
    for name, lora in (("dora", DORA), ("patterns", PATTERNS), ("tokens", TOKENS)):  # a native family: `auto` takes the
        lines = []  # transformers engine (PEFT's DoRA, per-module ranks and alphas, gaussian A), ZeRO-3
        res = train(_cfg(models["llama"], f"{root}/{name}", True, lora=lora, export=f"{root}/{name}/adapter"),
                    log=lines.append)
        out[name] = (res.losses, res.exported, [ln for ln in lines if ln.startswith(("engine:", "lora:"))])
    return out


def test_lora_and_qlora_through_peft_on_the_transformers_engine_match_peft_at_dp_shard2(models, tmp_path):
    """LoRA under ZeRO-3 on the dense, MoE and hybrid model (and PEFT loads the export), and at tp=2; QLoRA
    (bitsandbytes' NF4 base, as transformers' load_in_4bit makes it) under ZeRO-3 against PEFT on the same NF4
    base; Axolotl's unfrozen_parameters (a layer, half of lm_head's rows) against Axolotl's freezing of the HF model;
    8-bit and 4-bit AdamW under ZeRO-3 tracking torch's AdamW; `merge-lora` on the exported adapter giving the same
    model; LoRA on the experts' fused parameters (`_check_expert_lora`); LoRA beside gpt-oss's expert parallelism
    (ep=2) on the same curve as at dp_shard=2."""
    import peft

    got = run_workers(_lora, 2, models, str(tmp_path), timeout=1200)[0]
    for name in REPRESENTATIVE:
        losses, exported, said = got[name]
        assert len(said) == 1 and "(PEFT on transformers' model)" in said[0], said
        trained: list = []
        want = _reference(models[name], _cfg(models[name], f"{tmp_path}/{name}", name not in HYBRID, lora=LORA),
                          model_out=trained)
        assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
        if name == "gpt_oss":
            assert max(rel(a, b) for a, b in zip(got["gpt_oss ep"], want)) < 1e-4, (got["gpt_oss ep"], want)
        loaded = peft.PeftModel.from_pretrained(reference_model(Path(models[name])), exported)
        probe = _probe(models[name])
        assert rel(float(hf_loss(loaded, probe)), float(hf_loss(trained[0], probe))) < 1e-4, name
        if name == "phi":  # merge-lora: PEFT's merge on transformers' model, loadable as a plain model
            conf = tmp_path / "merge.yaml"
            conf.write_text(yaml.safe_dump({"model": {"path": models[name]}, "lora": LORA}))
            code, _, err = run_cli("merge-lora", "--config", str(conf), "--adapter", exported,
                                   "--out", str(tmp_path / "merged"))
            assert code == 0, err
            merged = reference_model(tmp_path / "merged")
            assert not any("lora" in n for n, _ in merged.named_parameters())
            assert rel(float(hf_loss(merged, probe)), float(hf_loss(trained[0], probe))) < 1e-4
    trained = []
    want = _reference(models["phi"], _cfg(models["phi"], f"{tmp_path}/phi-tp", True, lora=LORA, dp_shard_size=1,
                                          tp_size=2), dp=1, model_out=trained)
    losses, exported = got["lora tp"]
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (losses, want)
    loaded = peft.PeftModel.from_pretrained(reference_model(Path(models["phi"])), exported)
    assert rel(float(hf_loss(loaded, probe)), float(hf_loss(trained[0], probe))) < 1e-4
    want = _reference(models["phi"], _cfg(models["phi"], f"{tmp_path}/qlora", True, lora=QLORA))
    assert max(rel(a, b) for a, b in zip(got["qlora"], want)) < 1e-4, (got["qlora"], want)
    assert any("NF4 through bitsandbytes" in ln for ln in got["qlora said"]), got["qlora said"]
    assert any("ZeRO-3 partitions the NF4 base's codes" in ln for ln in got["qlora said"]), got["qlora said"]
    assert max(rel(a, b) for a, b in zip(got["qlora prequantized"], got["qlora"])) < 1e-6, got["qlora prequantized"]
    fp32 = _reference(models["phi"], _cfg(models["phi"], f"{tmp_path}/8bit", True))  # torch's AdamW
    eight = got["8bit"]
    assert eight[0] == pytest.approx(fp32[0], rel=1e-5) and eight != fp32, (eight, fp32)  # the moments differ
    assert max(rel(a, b) for a, b in zip(eight, fp32)) < 2e-3, (eight, fp32)  # and track torch's
    assert got["8bit said"] == ["optimizer: DeepSpeed's ZeRO-3 stepping bitsandbytes' AdamW8bit (fp32 master "
                                "partitions, 8-bit moments)"], got["8bit said"]
    four = got["4bit"]
    assert four[0] == pytest.approx(fp32[0], rel=1e-5) and four not in (fp32, eight), (four, eight, fp32)
    assert max(rel(a, b) for a, b in zip(four, fp32)) < 5e-3, (four, fp32)  # 16 levels a block: 3.1e-3 seen
    assert got["4bit said"] == ["optimizer: DeepSpeed's ZeRO-3 stepping torchao's AdamW4bit (fp32 master "
                                "partitions, 4-bit moments in their whole blocks of 256)"], got["4bit said"]
    want = _reference(models["phi"], _cfg(models["phi"], f"{tmp_path}/unfrozen", True, unfrozen=UNFROZEN))
    assert max(rel(a, b) for a, b in zip(got["unfrozen"], want)) < 1e-4, (got["unfrozen"], want)
    assert "lm_head.weight rows 0:512" in got["unfrozen said"][0], got["unfrozen said"]
    losses, said = got["moe unfrozen"]
    want = _reference(models["qwen3_moe"], _cfg(models["qwen3_moe"], f"{tmp_path}/moe-unfrozen", True,
                                                unfrozen=UNFROZEN))
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (losses, want)
    assert "freezing parts of a mixture-of-experts model is built on the transformers engine only" in said[0], said
    _check_expert_lora(got, models, tmp_path)
    losses, said = got["qlora experts"]
    _same_as_quantized_experts(losses, QEXPERTS, f"{tmp_path}/qlora-experts", models, apart=1e-4)
    for needle in ("4-bit experts are built on the transformers engine only", "3-D expert weights (",
                   "NF4 base's codes (the experts' too)"):
        assert any(needle in ln for ln in said), (needle, said)
    assert got["qlora experts resumed"] == (2, losses[2:]), (got["qlora experts resumed"], losses)
    losses, said = got["int8 experts"]
    _same_as_quantized_experts(losses, INT8_EXPERTS, f"{tmp_path}/int8-experts", models, apart=1e-5)
    assert "in int8 by Axolotl's parametrisation" in said[0], said
    for name, lora, why, line in (
            ("dora", DORA, "DoRA (PEFT's weight-decomposed LoRA) is built on", "lora: DoRA r 4"),
            ("patterns", PATTERNS, "per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern) are built on",
             "lora: LoRA r 4"),
            ("tokens", TOKENS, "training single token rows (PEFT's trainable_token_indices) is built on",
             "lora: LoRA r 4")):
        _check_peft_option(got[name], name, lora, why, line, models, tmp_path)


def _check_peft_option(got, name: str, lora: dict, why: str, line: str, models, tmp_path) -> None:
    """A PEFT option the native engine does not build (Axolotl's peft_use_dora, lora_rank_pattern /
    lora_alpha_pattern, peft_init_lora_weights: gaussian) on a native family: the transformers engine under `auto`,
    saying why; the same losses as PEFT with the option on transformers' model at dp_shard=2 under ZeRO-3, and the
    export loads in PEFT as the trained model."""
    import peft

    losses, exported, said = got
    assert any(why in ln for ln in said) and any(ln.startswith(line) for ln in said), said
    trained: list = []
    want = _reference(models["llama"], _cfg(models["llama"], f"{tmp_path}/{name}", True, lora=lora),
                      model_out=trained)
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (name, losses, want)
    loaded = peft.PeftModel.from_pretrained(reference_model(Path(models["llama"])), exported)
    saved = loaded.peft_config["default"]
    assert (saved.use_dora, saved.rank_pattern, saved.alpha_pattern, saved.trainable_token_indices) == (
        bool(lora.get("use_dora")), lora.get("rank_pattern", {}), lora.get("alpha_pattern", {}),
        lora.get("trainable_token_indices")), saved
    rows = lora.get("trainable_token_indices")
    if rows:  # the exported rows were trained: they left the base's
        delta = loaded.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta["default"]
        base = reference_model(Path(models["llama"])).model.embed_tokens.weight[rows]
        assert (delta - base).abs().max() > 1e-3, (delta - base).abs().max()
    probe = _probe(models["llama"])
    assert rel(float(hf_loss(loaded, probe)), float(hf_loss(trained[0], probe))) < 1e-4


def _same_as_quantized_experts(losses, lora: dict, root: str, models, apart: float) -> None:
    """`losses` equal transformers + PEFT with Axolotl's quantised experts (`lora`) and at least `apart` away from the
    same run with 16-bit experts: the experts' codes are what it trained on."""
    want = _reference(models["qwen3_moe"], _cfg(models["qwen3_moe"], root, True, lora=lora))
    assert max(rel(a, b) for a, b in zip(losses, want)) < 1e-4, (losses, want)
    plain = _reference(models["qwen3_moe"], _cfg(models["qwen3_moe"], root, True,
                                                 lora={**lora, "quantize_experts": False}))
    assert max(rel(a, b) for a, b in zip(losses, plain)) > apart, (losses, plain)


def _resume_one_rank(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    init_distributed()
    out = []
    for name, kw in (("qlora", {"lora": QLORA}), ("4bit", {"optimizer": "adamw_4bit"})):
        ck = f"{root}/{name}-ckpt"

        def cfg(name=name, kw=kw, **k):
            return _cfg(models["phi"], f"{root}/{name}", True, world=1, **kw, **k)

        whole = train(cfg(), log=lambda s: None).losses
        train(cfg(steps=2, ckpt=ck), log=lambda s: None)
        resumed = train(cfg(ckpt=ck), resume=True, log=lambda s: None)
        out.append((name, whole, resumed.start_step, resumed.losses))
    return out


def test_checkpoints_without_zero_partitions_resume_at_one_rank(models, tmp_path):
    """One rank (no ZeRO partitions: DeepSpeed saves the module's state and the optimizer's in one file): a QLoRA run
    (the frozen NF4 base left out, its absmax buffers kept) and a full fine-tune with torchao's 4-bit AdamW (its
    states are tensor subclasses, which torch.load refuses under DeepSpeed's map_location) saved at step 2 resume on
    the uninterrupted run's curve (the sweep of Axolotl's examples found both: apertus and command-r QLoRA, Llama 4
    Scout with adamw_torch_4bit)."""
    for name, whole, start, losses in run_workers(_resume_one_rank, 1, models, str(tmp_path), timeout=600)[0]:
        assert start == 2 and max(rel(a, b) for a, b in zip(losses, whole[2:])) < 1e-6, (name, losses, whole)
