"""Logits parity: tiny random HF models vs Megatron-Core GPTModel loaded from the converted checkpoint at tp 1, 2, 4.

Checkpoints are converted once (source tp=2, one at tp=4) and every TP size loads all of them in one spawn of gloo
processes, so resharding on load (tp=2 -> 1, 2, 4) is what is tested. Negative controls are the same Llama table
with one wrong transform: they must miss by orders of magnitude, proving the comparison can fail.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from adapter.convert.to_hf import megatron_to_hf
from adapter.convert.to_megatron import hf_to_megatron
from adapter.models import mapping as rules
from adapter.models.families import LLAMA_TABLE
from tests.helpers.dist import run_workers
from tests.helpers.hf import CASES, make_hf, tensors

pytestmark = pytest.mark.slow
ATOL = 1e-5
TPS = (1, 2, 4)
SEQ, BATCH = 16, 2


class PlainConcatQKV(rules.FusedQKV):
    """WRONG on purpose (negative control): q|k|v concatenated whole instead of interleaved per query group."""

    def to_megatron(self, ts, c):
        return torch.cat(list(ts))

    def to_hf(self, t, c):
        a = c.arch
        return [x.contiguous() for x in t.split([a.num_heads * a.head_dim] + [a.num_kv_heads * a.head_dim] * 2)]


class NaiveChunkGatedMLP(rules.GatedMLP):
    """WRONG on purpose (negative control): what a converter that chunks [gate; up] per TP rank would store."""

    def to_megatron(self, ts, c):
        gate, up = ts
        ranks = torch.cat([gate, up]).chunk(c.tp)                 # naive: rank r gets chunk r of [gate; up]
        halves = [r.chunk(2) for r in ranks]                      # Megatron reads rank r as [w_r; v_r]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def _with(megatron_key_suffix: str, cls) -> tuple:
    return tuple(cls(r.megatron, r.hf, r.tp_axis, r.when) if r.megatron.endswith(megatron_key_suffix) else r
                 for r in LLAMA_TABLE)


NEGATIVE = {  # name -> (case, table, source tp)
    "neg_qkv_plain_concat": ("llama", _with("linear_qkv.weight", PlainConcatQKV), 2),
    "neg_fc1_naive_chunk": ("llama", _with("linear_fc1.weight", NaiveChunkGatedMLP), 2),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("parity")
    tokens = torch.randint(0, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    cases, refs = [], {}
    plan = [(name, name, None, 2) for name in CASES] + [("llama_from_tp4", "llama", None, 4)]
    plan += [(name, case, table, tp) for name, (case, table, tp) in NEGATIVE.items()]
    for name, case, table, tp in plan:
        hf = root / f"hf_{case}"
        if not hf.exists():
            make_hf(case, hf)
        ckpt = hf_to_megatron(hf, root / f"meg_{name}", tp=tp, progress=False, table=table)
        if case not in refs:
            with torch.no_grad():
                refs[case] = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(tokens).logits
        cases.append((name, str(ckpt), None, (2,) if table else TPS))  # a wrong table is wrong at any tp
    refs.update({name: refs[case] for name, case, _, _ in plan})
    # the model may pad the vocab its own way (tp=1 default: 384 rows, checkpoint: 512)
    cases.append(("llama_own_padding", str(root / "meg_llama"), 384, (1,)))
    cases.append(("llama_more_padding", str(root / "meg_llama"), 1024, (2,)))  # extra rows start at zero
    refs["llama_own_padding"] = refs["llama_more_padding"] = refs["llama"]
    return root, tokens, cases, refs


def _worker(rank: int, world: int, cases, tokens, save_dir):
    """Every TP size in one spawn (imports dominate on 2 cores): world 4 = tp 1 x dp 4, tp 2 x dp 2, tp 4."""

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from adapter.convert.load import load_megatron_checkpoint
    from adapter.modeling.gpt import build_gpt_model, forward_logits
    from adapter.models.arch import ModelArch

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    try:
        for tp in TPS:
            ps.initialize_model_parallel(tp)
            for name, ckpt, padded, tps in cases:
                if tp not in tps:
                    continue
                meta = json.loads((Path(ckpt) / "nd_adapter.json").read_text())
                arch = ModelArch(**meta["arch"])
                model = build_gpt_model(arch, tp=tp, padded_vocab=padded or meta["padded_vocab_size"])
                load_megatron_checkpoint(model, ckpt)
                model.eval()
                with torch.no_grad():  # numpy: torch tensors would need fd passing back to the parent
                    out[tp, name] = forward_logits(model, tokens, vocab_size=arch.vocab_size).numpy()
                if tp == 2 and name == "llama":  # Megatron's own save of the same weights, to compare formats
                    dist_checkpointing.save(model.sharded_state_dict(), save_dir)
            ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return out if rank == 0 else None



def _layout(d: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    return {k: (getattr(v, "size", None), getattr(getattr(v, "properties", None), "dtype", None),
                sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(v, "chunks", [])))
            for k, v in md.items()}


def test_logits_match_hf_at_tp_1_2_4_and_format_matches_megatron_save(converted):
    root, tokens, cases, refs = converted
    save_dir = root / "mcore_save_tp2"
    save_dir.mkdir()
    logits = run_workers(_worker, max(TPS), cases, tokens, str(save_dir), timeout=400)[0]
    assert len(logits) == (len(CASES) + 1) * len(TPS) + len(NEGATIVE) + 2  # every case ran where planned
    for tp, name in logits:
        diff = (torch.from_numpy(logits[tp, name]) - refs[name]).abs().max().item()
        if name.startswith("neg_"):
            assert diff > 1e-2, f"{name} at tp={tp}: a wrong mapping went unnoticed (max |dlogit| {diff:.2e})"
        else:
            assert diff <= ATOL, f"{name} at tp={tp}: max |dlogit| {diff:.2e} > {ATOL}"
    # the streamed writer's keys, chunks, shapes and dtypes are exactly what Megatron itself saves at tp=2
    assert _layout(root / "meg_llama" / "release") == _layout(save_dir)
    # and Megatron's own save (what training's HF export writes) converts back to the original HF bit for bit
    saved = root / "mcore_root"
    shutil.copytree(root / "meg_llama", saved, ignore=shutil.ignore_patterns("release"))
    shutil.move(str(save_dir), saved / "release")
    back = megatron_to_hf(saved, root / "hf_from_mcore_save", progress=False)
    a, b = tensors(root / "hf_llama"), tensors(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
