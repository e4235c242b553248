"""Mixture-of-experts SFT against plain transformers: a chat dataset, packed, trained by nd-adapter at
tp=2 (+SP), dp_shard=2 and ep=2 (each rank holding half the experts) for 4 steps, against transformers on the same
prepared samples (each example attended on its own), fp32 on CPU, with transformers' load-balancing loss in the
objective as its Trainer has it: every forward (one micro-batch of one DP process) adds router_aux_loss_coef × its
statistic over that micro-batch's real tokens, unaveraged over processes. So the layouts train different objectives
(one micro-batch of two samples against two of one), and the reference follows each: losses, aux losses and the
gradient norm (every expert counted once). A reference without the auxiliary loss differs: the test sees it; a
run with `model.output_router_logits: false` (Axolotl's model_config) over the config's true equals it. Qwen3-MoE
on the transformers engine (transformers' own model and its own load_balancing_loss_func) at dp_shard=2 and ep=2
gives the same losses, aux losses and gradient norms.

Qwen3-MoE also saves after 2 steps at tp=2, resumes at dp_shard=2 (the experts' [gate; up] re-cut per TP rank)
and exports: steps 3 and 4 equal the reference that switches objective there, and transformers loads the export
(no missing or unexpected tensor) with the trained weights (its logits are the reference's). At ep=2 it saves,
resumes at ep=2 and exports (every expert written by its holder), under ZeRO-3 and ZeRO-2 (whose model file
holds one rank's experts: the others come back from their fp32 partitions); an ep=2 checkpoint also resumes
at tp=2 (every rank all the experts), and one saved under ZeRO-2 resumes under ZeRO-3 (experts matched by their
global index). ZeRO-2 at ep=2 keeps each expert's optimizer partition among the ranks holding it. LoRA on the
attention (q/k/v/o, from a PEFT adapter with non-zero B) at tp=2, dp_shard=2 and ep=2 (ZeRO-3 and ZeRO-2) equals
transformers + PEFT with the same objective. With exact HSDP (4 ranks) the experts are partitioned inside each
replica and the replicas' partitions averaged."""
from __future__ import annotations

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.runs import vocab_of
from tests.helpers.sft import make_moe, packed_examples, peft_adapter, rel

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, WARMUP = 128, 2e-3, 4, 1
LAYOUTS = {"tp=2": ({"tp_size": 2, "dp_shard_size": 1}, 2), "dp_shard=2": ({"tp_size": 1, "dp_shard_size": 2}, 1),
           "ep=2": ({"tp_size": 1, "dp_shard_size": 2, "ep_size": 2}, 1),  # each rank 2 of the 4 experts
           "ep=2 zero2": ({"tp_size": 1, "dp_shard_size": 2, "ep_size": 2}, 1)}
ZERO = {"ep=2 zero2": 2}  # deepspeed.zero_stage (default: 3)
HSDP = {"tp_size": 1, "dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2}  # 4 ranks: experts inside replicas
GROUPS = {"tp=2": 1, "dp_shard=2": 2, "ep=2": 2, "ep=2 zero2": 2}  # micro-batches per step (one per data-parallel
# process)
FAMILIES = ("qwen3_moe", "olmoe")
ATTENTION = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _cfg(model_dir: str, root: str, layout: str, steps: int = STEPS, schedule: str = "cosine", aux=None,
         lora=None, quantize_base=None, engine: str = "auto", compile: bool = False, **checkpoint):
    from adapter.demo.build import ASSETS

    parallelism, micro = LAYOUTS[layout] if layout != "hsdp" else (HSDP, 1)
    raw = {"model": {"path": model_dir, "cache_dir": f"{root}/cache", "engine": engine, "compile": compile},
           "parallelism": parallelism,
           "batch": {"micro_batch_size": micro, "gradient_accumulation_steps": 1}, "seq_len": SEQ,
           "precision": "fp32",
           "optimizer": {"lr": LR, "schedule": schedule, "warmup_steps": WARMUP if schedule == "cosine" else 0,
                         "max_steps": steps, "clip_grad": 1e12},
           "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                    "chat_template": "chatml", "sample_packing": True, "prepared_path": f"{root}/prep"},
           "checkpoint": checkpoint}
    if layout in ZERO:
        raw["deepspeed"] = {"zero_stage": ZERO[layout]}
    if aux is not None:  # over config.json's output_router_logits (Axolotl's model_config)
        raw["model"]["output_router_logits"] = aux
    if lora is not None:  # LoRA on the attention, from a PEFT adapter (lora.init_from)
        raw["lora"] = {"r": ATTENTION["r"], "alpha": ATTENTION["lora_alpha"],
                       "target_modules": ATTENTION["target_modules"], "init_from": lora,
                       **({"quantize_base": quantize_base} if quantize_base else {})}
    return config.build(raw, env={}, world_size=4 if layout == "hsdp" else 2)


def _worker(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    out, quiet = {}, (lambda s: None)
    for fam in FAMILIES:
        for name in LAYOUTS:
            res = run(_cfg(models[fam], f"{root}/{fam}", name), log=quiet)
            out[f"{fam} {name}"] = (res.losses, res.aux_losses, res.grad_norms)
    out["aux off"] = run(_cfg(models["qwen3_moe"], f"{root}/qwen3_moe", "tp=2", aux=False), log=quiet).losses
    for name in ("dp_shard=2", "ep=2"):  # transformers' own model: its own load_balancing_loss_func, added per forward
        said: list[str] = []
        res = run(_cfg(models["qwen3_moe"], f"{root}/qwen3_moe", name, engine="transformers"), log=said.append)
        out[f"hf {name}"] = (res.losses, res.aux_losses, res.grad_norms,
                             [ln for ln in said if ln.startswith("mixture of experts:")])
    # ... with its decoder layers compiled (the router-logit hooks inside the compiled layers; Dynamo + AOTAutograd)
    import functools

    import torch

    eager_compile, torch.compile = torch.compile, functools.partial(torch.compile, backend="aot_eager")
    try:
        res = run(_cfg(models["qwen3_moe"], f"{root}/qwen3_moe", "ep=2 zero2", engine="transformers", compile=True),
                  log=quiet)
        out["hf compiled"] = (res.losses, res.aux_losses, torch._dynamo.utils.counters["stats"]["unique_graphs"])
    finally:
        torch.compile = eager_compile
    for name in ("tp=2", "dp_shard=2", "ep=2", "ep=2 zero2"):
        out[f"lora {name}"] = run(_cfg(models["qwen3_moe"], f"{root}/qwen3_moe", name, schedule="constant",
                                       lora=models["adapter"]), log=quiet).losses
    where = f"{root}/qwen3_moe"
    ck = {"dir": f"{root}/moved", "save_every": 2}
    run(_cfg(models["qwen3_moe"], where, "tp=2", steps=2, schedule="constant", **ck), log=quiet)
    res = run(_cfg(models["qwen3_moe"], where, "dp_shard=2", schedule="constant", export_hf=f"{root}/export", **ck),
              resume=True, log=quiet)
    out["moved"] = (res.start_step, res.losses)
    # expert parallelism: saved at ep=2, resumed at ep=2 (exported) and at tp=2 (every rank all the experts)
    ck = {"dir": f"{root}/ep", "save_every": 2}
    run(_cfg(models["qwen3_moe"], where, "ep=2", steps=2, schedule="constant", **ck), log=quiet)
    res = run(_cfg(models["qwen3_moe"], where, "ep=2", schedule="constant", export_hf=f"{root}/export-ep", **ck),
              resume=True, log=quiet)
    out["ep resumed"] = (res.start_step, res.losses)
    ck2 = {"dir": f"{root}/ep-zero2", "save_every": 2}  # ZeRO-2: one rank's model file, every rank's partitions
    run(_cfg(models["qwen3_moe"], where, "ep=2 zero2", steps=2, schedule="constant", **ck2), log=quiet)
    res = run(_cfg(models["qwen3_moe"], where, "ep=2 zero2", schedule="constant", export_hf=f"{root}/export-ep2",
                   **ck2), resume=True, log=quiet)
    out["ep zero2 resumed"] = (res.start_step, res.losses)
    # moved: ep=2 under ZeRO-3 resumed at tp=2 (all experts on every rank, the flat AdamW); ep=2 under ZeRO-2
    # resumed at ep=2 under ZeRO-3 (each rank's experts read from the other stage's files)
    for saved, resumed in (("ep=2", "tp=2"), ("ep=2 zero2", "ep=2")):
        ck = {"dir": f"{root}/move-{saved}", "save_every": 2}
        run(_cfg(models["qwen3_moe"], where, saved, steps=2, schedule="constant", **ck), log=quiet)
        res = run(_cfg(models["qwen3_moe"], where, resumed, schedule="constant", **ck), resume=True, log=quiet)
        out[f"moved {saved}"] = (res.start_step, res.losses)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("moe-sft")
    tok = tiny_model(root / "tok")
    models = {fam: str(make_moe(root / fam, tok, fam)) for fam in FAMILIES}
    models["adapter"] = str(peft_adapter(models["qwen3_moe"], ATTENTION, root / "adapter"))
    return models


def _reference(model_dir, data, cfg, groups: list[int], aux_on: bool = True, schedule: str = "cosine",
               adapter: str | None = None, per_step: int = 2):
    """(LM losses, mean aux per micro-batch, the model) of transformers trained on each step's `per_step` samples split
    into `groups[step]` micro-batches (one per DP process); `adapter`: transformers + PEFT from that adapter."""
    import torch
    from transformers import AutoModelForCausalLM, get_constant_schedule, get_cosine_schedule_with_warmup
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from adapter.data import DPSampler

    order = iter(DPSampler(len(data.train), dp_rank=0, dp_size=1, micro_batch=per_step, seed=cfg.data.seed))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    c = hf.config
    if adapter is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, adapter, is_trainable=True)
    trained = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, WARMUP, STEPS) if schedule == "cosine" else get_constant_schedule(opt)
    losses, auxes, norms = [], [], []
    for n in groups:
        samples = next(order)
        total, count, aux_total, aux_values = 0.0, 0.0, 0.0, []
        for group in (samples[j * len(samples) // n:(j + 1) * len(samples) // n] for j in range(n)):
            router: list[list[torch.Tensor]] = [[] for _ in range(c.num_hidden_layers)]
            for i in group:
                for loss_sum, n_tokens, out in packed_examples(hf, data.train, i, output_router_logits=True):
                    total, count = total + loss_sum, count + n_tokens
                    for layer, logits in enumerate(out.router_logits):
                        router[layer].append(logits)
            aux = load_balancing_loss_func(tuple(torch.cat(r) for r in router), c.num_experts,
                                           c.num_experts_per_tok)
            aux_total, aux_values = aux_total + aux, aux_values + [float(aux)]
        loss = total / count
        (loss + (c.router_aux_loss_coef * aux_total if aux_on else 0.0)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trained, 1e12)))  # the whole gradient's norm, unclipped
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        auxes.append(sum(aux_values) / len(aux_values))
    _reference.norms = norms  # the last call's, read by the test
    return losses, auxes, hf


def test_moe_sft_matches_transformers_with_its_aux_loss_at_tp2_and_dp_shard2(models, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.data.sft import prepare

    got = run_workers(_worker, 2, models, str(tmp_path), timeout=900)[0]
    for fam in FAMILIES:
        cfg = _cfg(models[fam], f"{tmp_path}/{fam}", "tp=2")
        data = prepare(cfg, models[fam], vocab_of(cfg), builder=True, barrier=None, progress=False)
        assert data.reused  # the runs' own prepared samples
        for name, groups in GROUPS.items():
            ref, ref_aux, _ = _reference(models[fam], data, cfg, [groups] * STEPS)
            losses, auxes, norms = got[f"{fam} {name}"]
            ref_norms = _reference.norms
            assert len(losses) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref)), \
                (fam, name, losses, ref)
            assert len(auxes) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(auxes, ref_aux)), \
                (fam, name, auxes, ref_aux)
            # the gradient norm (what clipping reads): every expert counted once, over the ep ranks too
            assert all(rel(a, b) <= 1e-5 for a, b in zip(norms, ref_norms)), (fam, name, norms, ref_norms)
        without, _, _ = _reference(models[fam], data, cfg, [1] * STEPS, aux_on=False)
        # the aux gradient matters: 5e-4 at step 3 (step 1 runs at the warm-up's zero learning rate)
        assert max(rel(a, b) for a, b in zip(got[f"{fam} tp=2"][0], without)) > 1e-4
        if fam == "qwen3_moe":  # model.output_router_logits: false over config.json's true trains without it
            assert all(rel(a, b) <= 2e-6 for a, b in zip(got["aux off"], without)), (got["aux off"], without)
            for name in ("dp_shard=2", "ep=2"):  # the transformers engine: the same objective, the same numbers
                ref, ref_aux, _ = _reference(models[fam], data, cfg, [GROUPS[name]] * STEPS)
                losses, auxes, norms, said = got[f"hf {name}"]
                assert all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref)), (name, losses, ref)
                assert len(auxes) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(auxes, ref_aux)), (auxes, ref_aux)
                assert all(rel(a, b) <= 1e-5 for a, b in zip(norms, _reference.norms)), (norms, _reference.norms)
                assert "load-balancing loss × router_aux_loss_coef" in said[0], said
            losses, auxes, graphs = got["hf compiled"]  # ep=2 under ZeRO-2, each decoder layer compiled
            assert graphs > 0 and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref)), (graphs, losses, ref)
            assert len(auxes) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(auxes, ref_aux)), (auxes, ref_aux)
    cfg = _cfg(models["qwen3_moe"], f"{tmp_path}/qwen3_moe", "tp=2")
    data = prepare(cfg, models["qwen3_moe"], vocab_of(cfg), builder=True, barrier=None, progress=False)
    # LoRA on the attention of a mixture of experts, with the load-balancing loss: against transformers + PEFT
    for name, groups in (("tp=2", 1), ("dp_shard=2", 2), ("ep=2", 2), ("ep=2 zero2", 2)):
        ref, _, _ = _reference(models["qwen3_moe"], data, cfg, [groups] * STEPS, schedule="constant",
                               adapter=models["adapter"])
        assert all(rel(a, b) <= 2e-6 for a, b in zip(got[f"lora {name}"], ref)), (name, got[f"lora {name}"], ref)
    ref, _, hf = _reference(models["qwen3_moe"], data, cfg, [1, 1, 2, 2], schedule="constant")
    begun, losses = got["moved"]
    assert begun == 2 and len(losses) == 2 and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref[2:])), \
        (losses, ref)
    exported, info = AutoModelForCausalLM.from_pretrained(f"{tmp_path}/export", dtype=torch.float32,
                                                          output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.as_tensor(data.train[0]["tokens"][:64])[None]
    with torch.no_grad():
        diff = (exported(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-3, diff
    ref, _, hf = _reference(models["qwen3_moe"], data, cfg, [2, 2, 2, 2], schedule="constant")
    begun, losses = got["ep resumed"]
    assert begun == 2 and len(losses) == 2 and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref[2:])), (losses, ref)
    begun, losses = got["ep zero2 resumed"]
    assert begun == 2 and len(losses) == 2 and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref[2:])), (losses, ref)
    begun, losses = got["moved ep=2 zero2"]  # ZeRO-2 at ep=2 -> ZeRO-3 at ep=2: the same objective
    assert begun == 2 and len(losses) == 2 and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref[2:])), (losses, ref)
    exported = AutoModelForCausalLM.from_pretrained(f"{tmp_path}/export-ep", dtype=torch.float32)
    with torch.no_grad():
        diff = (exported(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-3, diff  # every expert written by the rank that holds it
    ref, _, _ = _reference(models["qwen3_moe"], data, cfg, [2, 2, 1, 1], schedule="constant")
    begun, losses = got["moved ep=2"]  # ep=2 -> tp=2: every rank all the experts, one micro-batch a step
    assert begun == 2 and len(losses) == 2 and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref[2:])), (losses, ref)
    exported = AutoModelForCausalLM.from_pretrained(f"{tmp_path}/export-ep2", dtype=torch.float32)  # ZeRO-2's
    with torch.no_grad():
        diff = (exported(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-3, diff


def _hsdp_worker(rank, world, models, root):
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    res = run(_cfg(models["qwen3_moe"], f"{root}/qwen3_moe", "hsdp"), log=lambda s: None)
    return res.losses, res.aux_losses, res.grad_norms


def test_moe_sft_with_experts_inside_exact_hsdp_replicas(models, tmp_path):
    """dp_replicate=2 × dp_shard=2 with ep=2: each replica holds every expert, partitioned over its own ranks holding
    them; the replicas' gradient partitions averaged (exact HSDP). Equal to transformers on 4 micro-batches a step."""
    from adapter.data.sft import prepare

    losses, auxes, norms = run_workers(_hsdp_worker, 4, models, str(tmp_path), timeout=600)[0]
    cfg = _cfg(models["qwen3_moe"], f"{tmp_path}/qwen3_moe", "hsdp")
    data = prepare(cfg, models["qwen3_moe"], vocab_of(cfg), builder=True, barrier=None, progress=False)
    ref, ref_aux, _ = _reference(models["qwen3_moe"], data, cfg, [4] * STEPS, per_step=4)
    assert len(losses) == STEPS and all(rel(a, b) <= 2e-6 for a, b in zip(losses, ref)), (losses, ref)
    assert all(rel(a, b) <= 2e-6 for a, b in zip(auxes, ref_aux)), (auxes, ref_aux)
    assert all(rel(a, b) <= 1e-5 for a, b in zip(norms, _reference.norms)), (norms, _reference.norms)


def _qlora_worker(rank, world, model, adapter, root):
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    out = {}
    for name in ("tp=2", "ep=2"):
        t = Trainer(resolve_run(_cfg(model, root, name, schedule="constant", lora=adapter, quantize_base="nf4")),
                    log=lambda s: None)
        try:
            t.setup()
            module = t.engine.ds.module
            out[name] = {"losses": t.fit().losses, "params": {n: str(p.dtype) for n, p in module.named_parameters()},
                         "buffers": [n for n, _ in module.named_buffers() if n.endswith("qcodes")]}
        finally:
            t.close()
    return out


def test_moe_qlora_quantises_the_attention_as_bitsandbytes_and_equals_peft(tmp_path):
    """QLoRA on a mixture of experts as transformers + bitsandbytes load it (`load_in_4bit`): the attention's linears
    in NF4, the router and the experts left in the compute dtype (they are not nn.Linear modules there), LoRA on
    q/k/v/o. At tp=2 (+SP) and at ep=2 (ZeRO-3) the losses equal transformers + PEFT on the model whose attention
    weights are bitsandbytes' dequantised NF4, with the load-balancing loss."""
    from adapter.data.sft import prepare
    from tests.helpers.lora import bnb_reference
    from tests.helpers.sft_data import tiny_model

    tok = tiny_model(tmp_path / "tok")
    model = str(make_moe(tmp_path / "wide", tok, hidden=128))  # NF4's blocks of 64 inside each rank's row at tp=2
    adapter = str(peft_adapter(model, ATTENTION, tmp_path / "adapter"))
    deq, codes = bnb_reference(model, "nf4", tmp_path / "deq")
    assert sorted({k.split(".")[-2] for k in codes}) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # attention only
    got = run_workers(_qlora_worker, 2, model, adapter, str(tmp_path), timeout=900)[0]
    cfg = _cfg(model, str(tmp_path), "tp=2", schedule="constant", lora=adapter, quantize_base="nf4")
    data = prepare(cfg, model, vocab_of(cfg), builder=True, barrier=None, progress=False)
    unquantised, _, _ = _reference(model, data, cfg, [1] * STEPS, schedule="constant", adapter=adapter)
    refs = {}
    for name, groups in (("tp=2", 1), ("ep=2", 2)):
        refs[name] = ref = _reference(deq, data, cfg, [groups] * STEPS, schedule="constant", adapter=adapter)[0]
        losses = got[name]["losses"]
        assert len(losses) == STEPS and all(rel(a, b) <= 1e-5 for a, b in zip(losses, ref)), (name, losses, ref)
        assert got[name]["buffers"] and all(".self_attention." in n for n in got[name]["buffers"]), got[name]
        experts = [n for n in got[name]["params"] if ".experts." in n or ".router." in n]
        assert experts and all(got[name]["params"][n] == "torch.float32" for n in experts)  # 16-bit (here fp32)
    assert rel(unquantised[0], refs["tp=2"][0]) > 1e-4  # NF4 changed the attention: the comparison can fail
