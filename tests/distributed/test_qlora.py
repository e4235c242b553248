"""QLoRA and the 8-bit base against bitsandbytes and PEFT (CPU, fp32): the base nd-adapter
quantises per TP shard equals, code for code and scale for scale, bitsandbytes' quantisation of each whole HF tensor
(NF4 with double quantisation: `quantize_4bit(compress_statistics=True)`; int8: `int8_vectorwise_quant`), and the
losses equal transformers + PEFT's on those dequantised weights, from the same adapter on the same samples; a resumed
QLoRA run continues exactly, from a checkpoint that holds no base weight (the base is quantised again)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_workers
from tests.helpers.lora import ALL7, bnb_reference, lora_cfg, lora_section, peft_reference
from tests.helpers.runs import vocab_of
from tests.helpers.sft import make_model, make_phi3, peft_adapter, rel

pytestmark = pytest.mark.slow
KW = {"r": 8, "lora_alpha": 16, "target_modules": ALL7}
# name: base format, (dp_shard, cp, tp), micro-batch, overrides -- each a world of 2
RUNS = {"nf4, tp=2 +SP": ("nf4", (1, 1, 2), 2, {}),
        "nf4, dp_shard=2 (ZeRO-3)": ("nf4", (2, 1, 1), 1, {}),
        "int8, tp=2, no SP": ("int8", (1, 1, 2), 2, {"sequence_parallel": False}),
        "nf4, Qwen2 (q/k/v biases), tp=2 +SP": ("nf4", (1, 1, 2), 2, {}),
        # Phi-3's packed qkv_proj / gate_up_proj, quantised by bitsandbytes as one tensor each
        "nf4, Phi-3 (packed linears), tp=2 +SP": ("nf4", (1, 1, 2), 2, {}),
        "int8, Phi-3 (packed linears), tp=2 +SP": ("int8", (1, 1, 2), 2, {})}
QWEN = "nf4, Qwen2 (q/k/v biases), tp=2 +SP"
PHI3 = {"r": 8, "lora_alpha": 16, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def _kind(name: str) -> str:
    return "qwen2" if name == QWEN else "phi3" if "Phi-3" in name else "llama"


def _qwen2(llama_dir: str, out: Path) -> str:
    """The Llama with Qwen2's architecture: the same weights plus random q/k/v biases (the quantised linear adds
    them as Megatron's would)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    c = llama.config
    cfg = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                      rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False, use_sliding_window=False,
                      bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    missing, _ = model.load_state_dict(llama.state_dict(), strict=False)
    assert missing and all(k.endswith("proj.bias") for k in missing), missing
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    for f in Path(llama_dir).glob("*token*"):
        shutil.copy(f, out / f.name)
    return str(out)


def _worker(rank, world, model_dir, adapter, root):
    import torch.distributed as dist

    from adapter.modeling.quant import quantized_weights
    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    out = {"resume": _resume(model_dir["llama"], adapter["llama"], root)}
    for name, (fmt, shape, micro, over) in RUNS.items():
        kind = _kind(name)
        model, start = model_dir[kind], adapter[kind]
        kw = PHI3 if kind == "phi3" else KW
        t = Trainer(resolve_run(lora_cfg(model, root, shape, micro, lora_section(kw, start) | {"quantize_base": fmt},
                             **over)), log=lambda s: None)
        try:
            t.setup()
            q = {k: (f, codes.clone(), scales.clone(), s) for k, (f, codes, scales, s)
                 in quantized_weights(t.engine.ds.module).items()}
            params = [n for n, _ in t.engine.ds.module.named_parameters()]
            r = t.fit()
            out[name] = {"losses": r.losses, "tp_rank": dist.get_rank(t.groups.tp), "params": params,
                         "quant": {k: (f, c.numpy(), s_.numpy(), shp) for k, (f, c, s_, shp) in q.items()}}
        finally:
            t.close()
    return out


def _local(r, fmt, fused, layer):
    """A rank's codes [rows, cols] and scales [rows, blocks] of one linear."""
    import numpy as np

    f, c, s, (rows, cols) = r["quant"][(layer, fused)]
    assert f == fmt
    return (np.stack([c >> 4, c & 15], 1).reshape(rows, cols) if fmt == "nf4" else c), s.reshape(rows, -1)


def _hf_view(results, fmt, arch, layer: int, fused: str):
    """Every TP rank's local codes and scales of one Megatron linear, laid out as the HF tensors it fuses."""
    import numpy as np
    import torch

    from adapter.modeling.quant import COLUMN, hf_row_sets, packed_of
    from adapter.models.lora import placement
    from adapter.models.mapping import Ctx, merge_blocks

    ranks = sorted(results, key=lambda r: r["tp_rank"])
    tp = len(ranks)
    names = [n for n, _, _ in placement(arch, fused, tp).pieces]
    packed = packed_of(arch, fused)
    if packed is not None:  # one HF tensor: the ranks' local rows in Megatron's order, then the family's own rule
        def whole(i):
            local = [torch.from_numpy(_local(r, fmt, fused, layer)[i]) for r in ranks]
            return packed.to_hf(merge_blocks(local, 0, packed.parts), Ctx(arch, 0))[0].numpy()
        return {names[0]: (whole(0), whole(1))}
    codes, scales = {}, {}
    for r in ranks:
        c, s = _local(r, fmt, fused, layer)
        rows = c.shape[0]
        sets = [x.numpy() for x in hf_row_sets(arch, fused, tp, rows)] if fused in COLUMN else [np.arange(rows)]
        for n, rows_of in zip(names, sets):
            codes.setdefault(n, []).append(c[rows_of])
            scales.setdefault(n, []).append(s[rows_of])
    axis = 0 if fused in COLUMN else 1  # TP splits a column-parallel linear's rows, a row-parallel one's columns
    return {n: (np.concatenate(codes[n], axis),
                # int8's row scales are whole on every rank of a row-parallel linear (a max over TP)
                np.concatenate(scales[n], axis) if fmt == "nf4" or axis == 0 else scales[n][0])
            for n in codes}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama wide enough for NF4's blocks at tp=2 (hidden 128: every rank's input width a multiple of 64),
    a PEFT adapter with non-zero B, the bitsandbytes references."""
    from tests.helpers.sft_data import tiny_model

    root = tmp_path_factory.mktemp("qlora")
    tok = tiny_model(root / "tok")
    model = str(make_model(root / "model", tok, hidden=128))
    models = {"llama": model, "qwen2": _qwen2(model, root / "qwen2"),
              "phi3": str(make_phi3(root / "phi3", tok, hidden=128))}
    adapters = {k: str(peft_adapter(m, PHI3 if k == "phi3" else KW, root / f"adapter-{k}")) for k, m in models.items()}
    refs = {fmt: bnb_reference(model, fmt, root / f"deq-{fmt}") for fmt in ("nf4", "int8")}
    refs["qwen2"] = bnb_reference(models["qwen2"], "nf4", root / "deq-qwen2")
    refs.update({f"phi3-{fmt}": bnb_reference(models["phi3"], fmt, root / f"deq-phi3-{fmt}")
                 for fmt in ("nf4", "int8")})
    return root, models, adapters, refs


def test_quantised_base_equals_bitsandbytes_and_losses_equal_peft(setup):
    import numpy as np

    from adapter.data.sft import prepare
    from adapter.models.arch import load_arch
    from adapter.models.lora import hf_modules

    root, models, adapters, refs = setup
    got = run_workers(_worker, 2, models, adapters, str(root), timeout=1200)
    archs = {k: load_arch(m) for k, m in models.items()}
    r = got[0]["resume"]  # a resumed QLoRA run continues bit-exactly, from a checkpoint of adapters only
    assert r["first"] + r["second"] == r["whole"], r
    assert r["module"] and all(".lora." in k or k.endswith("_extra_state") for k in r["module"]), r["module"]
    for name, (fmt, shape, _, _) in RUNS.items():
        if name == QWEN:
            continue  # the same shapes: its codes are checked through its losses
        per_rank = [g[name] for g in got]
        if shape[2] == 1:  # dp_shard: each rank holds the whole base, quantised alike
            per_rank = per_rank[:1]
        arch, ref = archs[_kind(name)], refs[fmt if _kind(name) == "llama" else f"phi3-{fmt}"][1]
        for layer in range(arch.num_layers):
            for fused in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                for hf, (codes, scales) in _hf_view(per_rank, fmt, arch, layer, fused).items():
                    want_codes, want_scales = ref[hf_modules(arch)[hf].format(i=layer) + ".weight"]
                    assert np.array_equal(codes, want_codes), (name, layer, hf)
                    assert np.array_equal(scales.reshape(want_scales.shape), want_scales), (name, layer, hf)
    ref_losses = {}
    for key, kind in (("nf4", "llama"), ("int8", "llama"), ("qwen2", "qwen2"), ("phi3-nf4", "phi3"),
                      ("phi3-int8", "phi3")):
        kw = PHI3 if kind == "phi3" else KW
        cfg = lora_cfg(models[kind], root, (1, 1, 2), 2, lora_section(kw, adapters[kind]) | {"quantize_base": "nf4"})
        data = prepare(cfg, Path(models[kind]), vocab_of(cfg), builder=True, barrier=None, progress=False)
        ref_losses[key] = peft_reference(str(refs[key][0]), adapters[kind], data, cfg)["losses"]
    assert rel(ref_losses["nf4"][0], ref_losses["int8"][0]) > 1e-4  # the formats differ: the test can fail
    assert rel(ref_losses["nf4"][0], ref_losses["qwen2"][0]) > 1e-4  # so do the biases
    assert rel(ref_losses["phi3-nf4"][0], ref_losses["phi3-int8"][0]) > 1e-4
    for name, (fmt, *_), in RUNS.items():
        kind = _kind(name)
        losses, want = got[0][name]["losses"], ref_losses[{"llama": fmt, "qwen2": "qwen2"}.get(kind, f"phi3-{fmt}")]
        assert all(rel(a, b) <= 1e-4 for a, b in zip(losses, want)), (name, losses, want)
    # no decoder linear keeps a 16-bit weight: embeddings, norms, the LM head and the adapters are the parameters
    for name in RUNS:
        params = got[0][name]["params"]
        assert any(".lora." in n for n in params) and not any(n.endswith(("linear_qkv.weight", "linear_proj.weight",
                                                                         "linear_fc1.weight", "linear_fc2.weight"))
                                                              for n in params), params


def _resume(model_dir, adapter, root):
    """4 QLoRA steps whole, and 2 + 2 resumed; what the checkpoint holds (in the main test's process group)."""
    import torch

    from tests.helpers.runs import train as run

    lora = lora_section(KW, adapter) | {"quantize_base": "nf4"}

    def cfg(steps, ckpt):
        return lora_cfg(model_dir, root, (1, 1, 2), 2, lora, steps=steps, **{"checkpoint.dir": f"{root}/{ckpt}"})

    whole = run(cfg(4, "q-whole"), log=lambda s: None)
    first = run(cfg(2, "q-cut"), log=lambda s: None)
    second = run(cfg(4, "q-cut"), resume=True, log=lambda s: None)
    latest = Path(f"{root}/q-cut/latest").read_text().strip()
    states = torch.load(sorted(Path(f"{root}/q-cut/{latest}").glob("*model_states.pt"))[0], map_location="cpu",
                        weights_only=False)
    return {"whole": whole.losses, "first": first.losses, "second": second.losses,
            "module": sorted((states.get("module") or {}).keys())}


