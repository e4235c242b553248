"""HF <-> Megatron conversion in one process: round trips, layout, streaming, bad inputs.

Logits parity at tp 1/2/4 lives in test_convert_parity.py."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from adapter.convert import hf_io, to_hf, to_megatron
from adapter.convert import megatron_io as mio
from adapter.convert.load import load_megatron_checkpoint
from adapter.convert.to_hf import megatron_to_hf
from adapter.convert.to_megatron import hf_to_megatron
from adapter.convert.verify import verify
from adapter.errors import UserError
from adapter.models import mapping as rules
from adapter.models.arch import load_arch
from adapter.models.families import FAMILIES, LLAMA_TABLE
from tests.helpers.hf import flip_chunk, make_hf, tensors


@pytest.mark.parametrize("case", ["llama", "llama_tied", "qwen2", "qwen3", "phi3", "glm4", "gemma3", "gemma2"])
def test_round_trip_bit_exact_and_loads_in_transformers(tmp_path, monkeypatch, case):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(to_hf, "BLOCK", 1000)  # export in many row blocks, as it does for big tensors
    src = make_hf(case, tmp_path / "hf", dtype=torch.bfloat16)
    hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    back = megatron_to_hf(tmp_path / "meg", tmp_path / "back", shard_size="30KB", progress=False)
    a, b = tensors(src), tensors(back)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    assert (back / "model.safetensors.index.json").exists() and (back / "tokenizer.json").exists()
    assert (back / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(back)
    ref = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.randint(0, 300, (1, 8))
    assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("modern", [False, True])
def test_gemma3_image_text_checkpoint_converts_its_language_model(tmp_path, modern):
    """Gemma3ForConditionalGeneration: its language model is converted (either naming), the vision tower
    and projector are left out, the logits equal transformers' (text input) and the export is that language model as
    Gemma3ForCausalLM, bit for bit."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    from tests.helpers.hf import make_gemma3_vl

    src = make_gemma3_vl(tmp_path / "hf", modern_names=modern)
    names = hf_io.HFCheckpoint(src).names()
    assert any(n.startswith("model.vision_tower.") for n in names)
    out = hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    report = verify(src, out, seq_len=16)
    assert report["ok"] and report["exact"] == report["tensors"], report
    back = megatron_to_hf(out, tmp_path / "back", progress=False)
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    text = tensors(back)
    assert all(k.startswith("model.") and "vision" not in k for k in text)
    full = tensors(src)
    assert all(torch.equal(text[k], full[k.replace("model.", "model.language_model.", 1)]) for k in text)
    ids = torch.randint(0, 296, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = Gemma3ForCausalLM.from_pretrained(back, dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)


def test_layout_metadata_and_megatron_lm_tracker(tmp_path):
    src = make_hf("llama", tmp_path / "hf", dtype=torch.bfloat16)
    out = hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    assert (out / mio.TRACKER).read_text() == "release"
    ck = out / "release"
    assert json.loads((ck / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert {p.name for p in ck.iterdir()} == {"metadata.json", "common.pt", ".metadata", "__0_0.distcp"}
    meta = json.loads((out / mio.META).read_text())
    assert (meta["vocab_size"], meta["padded_vocab_size"], meta["vocab_divisible_by"]) == (300, 512, 128)
    assert (meta["dtype"], meta["source_tp"], meta["architecture"]) == ("bfloat16", 2, "LlamaForCausalLM")
    assert (out / "hf" / "config.json").exists() and (out / "hf" / "tokenizer.json").exists()
    r = mio.DistCheckpointReader(ck)
    assert r.shape("embedding.word_embeddings.weight") == (512, 64)
    assert r.shape("decoder.layers.self_attention.linear_qkv.weight") == (2, 128, 64)  # layers stacked
    assert r.shape("decoder.layers.mlp.linear_fc1.weight") == (2, 192, 64)
    emb = r.read("embedding.word_embeddings.weight")
    assert torch.equal(emb[:300], tensors(src)["model.embed_tokens.weight"]) and not emb[300:].any()
    fc1 = r.md.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    assert len(fc1.chunks) == 2 * 4  # per layer: [gate_0, gate_1, up_0, up_1] as a tp=2 save writes them
    common = torch.load(ck / "common.pt", weights_only=False)
    assert common["args"].tensor_model_parallel_size == 2 and common["args"].padded_vocab_size == 512


def test_streaming_reads_every_byte_once_into_one_buffer(tmp_path, monkeypatch):
    src = make_hf("llama", tmp_path / "hf")
    read, producers = [0], []
    orig_read, orig_init = hf_io.HFCheckpoint.read_rows, to_megatron._Producer.__init__

    def read_rows(self, name, row0, n, out):
        read[0] += out.nbytes
        return orig_read(self, name, row0, n, out)

    def init(self, *a):
        orig_init(self, *a)
        producers.append(self)

    monkeypatch.setattr(hf_io.HFCheckpoint, "read_rows", read_rows)
    monkeypatch.setattr(to_megatron._Producer, "__init__", init)
    hf_to_megatron(src, tmp_path / "meg", tp=4, progress=False)
    assert read[0] == sum(t.nbytes for t in tensors(src).values())  # each HF byte read once, straight to its chunk
    p = producers[0]
    assert p.builds == 2 * 2  # only row-parallel o_proj/down_proj are staged, once per layer (not per TP chunk)
    assert {k: len(v) for k, v in p.pool.bufs.items()} == {  # two reused buffers of the largest chunk (vocab / tp)
        "buf0": 512 // 4 * 64 * 4, "buf1": 512 // 4 * 64 * 4, "stage": 96 * 64 * 4}


def test_dtype_cast_and_bin_input(tmp_path):
    src = make_hf("qwen2", tmp_path / "hf", dtype=torch.float32, safe=False, shard=None)
    assert (src / "pytorch_model.bin").exists()
    out = hf_to_megatron(src, tmp_path / "meg", tp=1, dtype="bf16", progress=False)
    assert json.loads((out / mio.META).read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    back = megatron_to_hf(out, tmp_path / "back", dtype="fp32", progress=False)
    a, b = tensors(src), tensors(back)
    for k in a:
        assert b[k].dtype == torch.float32 and torch.equal(b[k], a[k].to(torch.bfloat16).float()), k
    report = verify(src, out, logits=False)
    assert report["tensors"] == len(a) and report["ok"]  # cast on purpose: reported, not failed


def test_verify_weights_reports_mismatch(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    out = hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    assert verify(src, out, logits=False)["exact"] == len(tensors(src))
    other = make_hf("llama", tmp_path / "hf2", seed=1)
    report = verify(other, out, logits=False)
    assert not report["ok"] and report["exact"] == 0


# ---- bad inputs: one-line UserError naming the problem, nothing left on disk --------------------------------------

def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith((name, "." + name))]


def _refused(src, out: Path, match: str, **kw):
    with pytest.raises(UserError, match=match) as e:
        hf_to_megatron(src, out, progress=False, **kw)
    assert "\n" not in str(e.value) and "Fix:" in str(e.value)
    assert _leftovers(out.parent, out.name) == []


def test_missing_shard(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    victim = sorted(src.glob("model-*.safetensors"))[1]
    victim.unlink()
    _refused(src, tmp_path / "meg", f"missing weight shard {victim.name}")


def test_truncated_safetensors(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    victim = sorted(src.glob("model-*.safetensors"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    _refused(src, tmp_path / "meg", "truncated safetensors file")
    victim.write_bytes(data[:5])
    _refused(src, tmp_path / "meg", r"truncated safetensors file \(no header\)")


def test_config_weights_shape_mismatch(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(src, tmp_path / "meg", r"mlp.gate_proj.weight=\[96, 64\]: shape disagrees with config.json")
    cfg["intermediate_size"], cfg["num_hidden_layers"] = 96, 3
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(src, tmp_path / "meg", "model.layers.2.input_layernorm.weight is missing")


def test_unknown_architecture_and_unmapped_tensor(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    _refused(src, tmp_path / "meg", "no native family .* without conversion")
    (src / "config.json").write_text(json.dumps(cfg))
    # a Qwen2 checkpoint (q/k/v biases) mislabelled as Llama: biases would be dropped silently -> refuse
    q = make_hf("qwen2", tmp_path / "q2")
    (q / "config.json").write_text(json.dumps({**json.loads((q / "config.json").read_text()),
                                               "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    _refused(q, tmp_path / "meg", "tensor.*the llama mapping table does not cover")


def test_existing_output_refused_unless_overwrite(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    out = tmp_path / "meg"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(UserError, match="already exists.*--overwrite"):
        hf_to_megatron(src, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep"]
    hf_to_megatron(src, out, overwrite=True, progress=False)
    assert (out / mio.TRACKER).exists() and not (out / "keep").exists()
    assert _leftovers(tmp_path, "meg") == ["meg"]
    with pytest.raises(UserError, match="overlaps the input"):
        hf_to_megatron(src, src / "sub", progress=False)


def test_bad_tp_and_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    src = make_hf("llama", tmp_path / "hf")
    _refused(src, tmp_path / "meg", "tp=3: does not divide num_attention_heads=4", tp=3)

    def boom(self, *a):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_io.HFCheckpoint, "read_rows", boom)
    with pytest.raises(KeyboardInterrupt):
        hf_to_megatron(src, tmp_path / "meg", progress=False)
    assert _leftovers(tmp_path, "meg") == []


def test_export_refuses_non_converted_dir_and_existing_out(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    with pytest.raises(UserError, match="latest_checkpointed_iteration.txt|nd_adapter.json"):
        megatron_to_hf(src, tmp_path / "back", progress=False)
    out = hf_to_megatron(src, tmp_path / "meg", progress=False)
    (tmp_path / "back").mkdir()
    with pytest.raises(UserError, match="already exists"):
        megatron_to_hf(out, tmp_path / "back", progress=False)
    with pytest.raises(UserError, match="shard_size='lots': not a size"):
        megatron_to_hf(out, tmp_path / "back2", shard_size="lots", progress=False)


def test_cli_exit_status(tmp_path, capsys):
    from adapter.cli import main

    src = make_hf("llama", tmp_path / "hf")
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "m"), "--tp", "2",
                 "--no-progress"]) == 0
    assert main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "m"), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "megatron-to-hf", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "b"),
                 "--no-progress"]) == 0
    assert main(["convert", "verify", "--hf", str(src), "--megatron", str(tmp_path / "m"), "--no-logits"]) == 0
    assert "OK" in capsys.readouterr().out


def test_safetensors_writer_matches_library(tmp_path):
    from safetensors.torch import load_file

    ts = {"a": torch.randn(3, 5).bfloat16(), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(0, 4)}
    items = [(k, tuple(v.shape), v.dtype) for k, v in ts.items()]
    hf_io.write_safetensors_sharded(tmp_path, items, lambda n: ts[n].split(2), shard_size=10**9)
    got = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in ts.items())
    (n,) = struct.unpack("<Q", (tmp_path / "model.safetensors").read_bytes()[:8])
    assert n % 8 == 0


def test_llama_table_is_declarative():
    assert all(type(r) in (rules.Copy, rules.Vocab, rules.FusedQKV, rules.GatedMLP) for r in LLAMA_TABLE)
    assert len({r.megatron for r in LLAMA_TABLE}) == len(LLAMA_TABLE)
    for fam in FAMILIES:  # every family's table is row-wise (the streaming converter plans rows) and unique by key
        assert all(r.rowwise for r in fam.table) and len({r.megatron for r in fam.table}) == len(fam.table)


def test_verify_logits_in_process_and_load_refuses_wrong_model(tmp_path):
    """verify's fp32 logit check (tp=1, world of 1 in this process) and load_megatron_checkpoint's refusals."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs a process without a default process group")
    src = make_hf("qwen3", tmp_path / "hf")
    good = hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    report = verify(src, good, seq_len=8)
    assert report["ok"] and report["max_abs_logit_diff"] <= 1e-5 and report["exact"] == report["tensors"]

    from dataclasses import replace

    from megatron.core import parallel_state as ps

    from adapter.modeling.gpt import build_gpt_model
    from tests.helpers.dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1)
        arch = load_arch(src)
        with pytest.raises(UserError, match="checkpoint shape differs from the model's"):
            load_megatron_checkpoint(build_gpt_model(replace(arch, ffn_hidden_size=128), padded_vocab=512), good)
        with pytest.raises(UserError, match="smaller than the checkpoint's vocab 300"):
            load_megatron_checkpoint(build_gpt_model(arch, padded_vocab=256), good)
        with pytest.raises(UserError, match="checkpoint lacks decoder.layers.self_attention.linear_qkv.bias"):
            load_megatron_checkpoint(build_gpt_model(replace(arch, qkv_bias=True), padded_vocab=512), good)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


# ---- the writer never depends on DCP's loader (with CUDA visible it resolved chunks ahead); checksums refuse damage


def test_writer_exact_when_dcp_resolves_ahead(tmp_path, monkeypatch):
    """With CUDA visible, DCP's FileSystemWriter resolves write items ahead of writing them (_OverlappingCpuLoader);
    the old writer then overwrote queued chunks in its reused buffers (19 of 21 tensors wrong, no error). Both of
    DCP's loaders are made to resolve everything first: the conversion must stay bit-exact."""
    import torch.distributed.checkpoint.filesystem as fs

    class ResolveAll(fs._SerialCpuLoader):
        def values(self):
            yield from [(self.resolve_fun(obj).detach(), obj) for _, obj in self.items]

    monkeypatch.setattr(fs, "_SerialCpuLoader", ResolveAll)
    monkeypatch.setattr(fs, "_OverlappingCpuLoader", lambda resolve_fun, **kw: ResolveAll(resolve_fun))
    src = make_hf("llama", tmp_path / "hf", dtype=torch.bfloat16)
    out = hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    report = verify(src, out, logits=False)
    assert report["ok"] and report["exact"] == report["tensors"] == len(tensors(src)), report["mismatched"]
    meta = json.loads((out / mio.META).read_text())
    reader = mio.DistCheckpointReader(mio.resolve_ckpt_dir(out))
    assert set(meta["checksums"]["chunks"]) == {mio.chunk_id(k, c.offsets) for k, c in reader.chunks()}


def test_bytes_on_disk_that_differ_from_the_produced_ones_publish_nothing(tmp_path, monkeypatch):
    """The read-back check: a chunk whose written bytes differ from those produced (here torch.save is handed a
    changed copy after the checksum was taken) fails the conversion with one line, and nothing is published."""
    real_save = torch.save
    hit = []

    def damaging_save(obj, f, *a, **kw):
        if isinstance(obj, torch.Tensor) and obj.numel() > 8 and not hit:
            hit.append(1)
            obj = obj.clone()
            obj.view(-1)[3] += 1
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(mio.torch, "save", damaging_save)
    src = make_hf("llama", tmp_path / "hf")
    _refused(src, tmp_path / "meg", "read back differs from what was written; nothing was published")
    assert hit


def test_damaged_checkpoint_is_refused_by_verify_export_and_load(tmp_path, capsys):
    import torch.distributed as dist

    from adapter.cli import main

    src = make_hf("llama", tmp_path / "hf")
    out = hf_to_megatron(src, tmp_path / "meg", tp=2, progress=False)
    chunk = flip_chunk(out, "linear_fc1.weight")
    capsys.readouterr()  # transformers' save_pretrained progress bar
    for argv in (["convert", "verify", "--hf", str(src), "--megatron", str(out), "--no-logits"],
                 ["convert", "megatron-to-hf", "--megatron", str(out), "--out", str(tmp_path / "back"),
                  "--no-progress"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"tensor chunk {chunk} does not match the checksum" in err[0], err
        assert "Fix: re-convert" in err[0]
    assert _leftovers(tmp_path, "back") == []
    if dist.is_initialized():
        pytest.skip("the load check needs a process without a default process group")
    from megatron.core import parallel_state as ps

    from adapter.modeling.gpt import build_gpt_model
    from tests.helpers.dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1)
        with pytest.raises(UserError, match=f"tensor chunk {chunk}"):
            load_megatron_checkpoint(build_gpt_model(load_arch(src), padded_vocab=512), out)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_checkpoint_without_checksums_still_loads_with_a_warning(tmp_path):
    src = make_hf("llama", tmp_path / "hf")
    out = hf_to_megatron(src, tmp_path / "meg", progress=False)
    meta = json.loads((out / mio.META).read_text())
    del meta["checksums"]
    (out / mio.META).write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="records no checksums"):
        assert verify(src, out, logits=False)["ok"]


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "olmoe"])
def test_fused_expert_tensors_convert_as_per_expert_ones(tmp_path, case):
    """transformers 5's own layout (3-D gate_up_proj / down_proj per layer, the router under mlp.gate) converts to
    the same Megatron checkpoint as the hub's per-expert layout of the same model, and exports back to that layout
    bit for bit; verify reads it too."""
    from adapter.convert.verify import verify

    fused = make_hf(case, tmp_path / "fused", fused=True)
    plain = make_hf(case, tmp_path / "plain")
    assert any(n.endswith("experts.gate_up_proj") for n in tensors(fused))
    hf_to_megatron(fused, tmp_path / "meg", tp=2, progress=False)
    back = megatron_to_hf(tmp_path / "meg", tmp_path / "back", progress=False)
    a, b = tensors(plain), tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = verify(fused, tmp_path / "meg", seq_len=8)
    assert report["exact"] == report["tensors"] and report["max_abs_logit_diff"] <= 1e-5, report
