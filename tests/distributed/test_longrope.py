"""LongRoPE past the original context (Phi-3.5-mini / Phi-4-mini): transformers rotates a micro-batch with
the long factors when any of its positions passes `original_max_position_embeddings` (max(position_ids) + 1 >
original), else with the short ones. A tiny Phi-3 with an original context of 12 tokens against transformers, plain
causal (32 tokens: long) and packed (a micro-batch with a 16- and a 20-token document is long throughout, its
short documents too, as transformers rotates a padding-free packed row; one whose documents all fit is short), at
cp 1 and 2; and a short plain batch of samples padded past the original context (the padded length decides)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_workers

pytestmark = pytest.mark.slow
TOL = 1e-5
S, ORIGINAL = 32, 12
LONG = ([3, 11, 2, 16], [20, 12])   # the longest document passes the original context: long factors
SHORT = ([3, 9, 2, 12, 6], [12, 12, 8])  # every document fits: short factors, though the rows are 32 long


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import json

    from transformers import AutoModelForCausalLM

    from adapter.convert.to_megatron import hf_to_megatron
    from tests.helpers.hf import make_hf

    root = tmp_path_factory.mktemp("longrope")
    hf_dir = make_hf("phi3_longrope", root / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["original_max_position_embeddings"] = ORIGINAL  # so that 32-token batches pass it
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.arange(1, 2 * S + 1).view(2, S)  # token id = flat position + 1
    with torch.no_grad():
        ref = {"plain": hf(ids).logits}
        # packed: each document on its own (transformers' SDPA path does not mask a packed row apart), with the
        # factors its micro-batch picks: max(position_ids) + 1 over all of them (Axolotl's padding-free rows)
        rope = hf.model.rotary_emb
        for name, docs in (("long", LONG), ("short", SHORT)):
            if name == "long":  # past the original: long_inv_freq (cached by the plain run) for every document
                assert hasattr(rope, "long_inv_freq")
                hf.config.rope_parameters["original_max_position_embeddings"] = 0
            ref[name] = torch.cat([hf(ids[i:i + 1, sum(d[:j]):sum(d[:j + 1])]).logits[0]
                                   for i, d in enumerate(docs) for j in range(len(d))])
            hf.config.rope_parameters["original_max_position_embeddings"] = ORIGINAL
        # the negative control: the short factors throughout differ from what transformers does past the original
        hf.config.rope_parameters["original_max_position_embeddings"] = 10 ** 6
        del rope.long_inv_freq
        short_everywhere = hf(ids).logits
    assert (short_everywhere - ref["plain"]).abs().max() > 1e-2
    return ids, str(hf_to_megatron(hf_dir, root / "meg", tp=1, progress=False)), ref


def _worker(rank, world, ids, ckpt, ref):
    import json
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from adapter.convert.load import load_megatron_checkpoint
    from adapter.kernels.attention import split_for_cp
    from adapter.kernels.thd import local_multiple, pack_batch
    from adapter.modeling.gpt import build_gpt_model
    from adapter.models.arch import ModelArch
    from adapter.patches.mcore import install_cpu_shims

    install_cpu_shims()
    dist.init_process_group("gloo")
    meta = json.loads((Path(ckpt) / "nd_adapter.json").read_text())
    arch = ModelArch(**meta["arch"])
    assert arch.rope_original_max == ORIGINAL and arch.rope_long_factor is not None
    out = {}
    for cp in (1, 2):
        r = rank if cp > 1 else 0
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
        model = build_gpt_model(arch, cp=cp, padded_vocab=meta["padded_vocab_size"])
        load_megatron_checkpoint(model, ckpt)
        model.eval()
        v = arch.vocab_size
        with torch.no_grad():
            got = model(split_for_cp(ids, cp, r), None, None)[..., :v]
            out[f"plain_cp{cp}"] = (got - split_for_cp(ref["plain"], cp, r)).abs().max().item()
            # 8 tokens of samples padded to S (Axolotl's pad_to_sequence_len): transformers sees S positions and
            # rotates with the long factors; causal, so its first 8 logits are the S-token run's
            short = split_for_cp(ids[:, :8], cp, r)
            for padded in (S, None):
                model.rope_padded_len = padded
                diff = (model(short, None, None)[..., :v] - split_for_cp(ref["plain"][:, :8], cp, r)).abs().max()
                out[f"padded_cp{cp}" if padded else f"control_unpadded_cp{cp}"] = diff.item()
            for name, docs in (("long", LONG), ("short", SHORT)):
                seg = torch.tensor([[i for i, n in enumerate(d) for _ in range(n)] for d in docs])
                full = {"tokens": ids, "labels": ids, "loss_mask": torch.ones(2, S), "segment_ids": seg}
                local, params = pack_batch(full, cp_size=cp, cp_rank=r, multiple=local_multiple(S, cp, 1))
                got = model(local["tokens"], local["position_ids"], None, packed_seq_params=params)[0, :, :v]
                real = local["tokens"][0] > 0
                out[f"{name}_cp{cp}"] = (got[real] - ref[name][local["tokens"][0][real] - 1]).abs().max().item()
    return out


def test_long_factors_switch_per_micro_batch_as_transformers(model):
    ids, ckpt, ref = model
    for r in run_workers(_worker, 2, ids, ckpt, ref, timeout=400):
        bad = {k: v for k, v in r.items() if not (v > 1e-2 if k.startswith("control") else v <= TOL)}  # NaN too
        assert not bad and len(r) == 10, r
