"""The precision an Axolotl YAML asks for, trained as Axolotl trains it (docs/config.md, "Precision as Axolotl
trains"): one row per case, each an Axolotl YAML (a tiny Phi-2, the transformers engine, packed chat data, two
processes) whose weights', moments' and master partitions' dtypes after the run are checked and whose losses are
compared with transformers doing the same thing on the same batches.

* `bf16: true`, no deepspeed, no FSDP: Axolotl loads bf16 weights and transformers' Trainer steps torch's fused
  AdamW on them: bf16 weights, bf16 moments, no fp32 master (here ZeRO-3 with DeepSpeed's bf16 master partitions,
  the weights' own). The reference: the bf16 model, torch's fused AdamW on its weights.
* `bf16: true` with `deepspeed:` (Axolotl's zero3 and zero2 JSONs) and with FSDP (`dp_shard_size: 2`): fp32 masters
  and fp32 moments. The reference: fp32 masters stepped by torch's fused AdamW, copied into the bf16 model after each
  step.
* neither: fp32 weights and moments; the reference in fp32 (≤ 1e-4).
At lr 1e-4 a bf16 weight loses most updates (under half a bf16 step), so the two bf16 references part by ~4e-3
over 4 steps while each row stays within ~2e-4 of its own (the bf16 forward's differences): each bf16 row must be
nearer its own reference than the other's, and within half their gap.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter import config
from tests.helpers.dist import run_workers
from tests.helpers.sft import packed_examples, rel

pytestmark = pytest.mark.slow
SEQ, LR, STEPS, WORLD = 128, 1e-4, 4, 2
ROWS = {"bf16": {"bf16": True}, "bf16 deepspeed zero2": {"bf16": True, "deepspeed": "zero2"},
        "bf16 deepspeed": {"bf16": True, "deepspeed": "zero3"}, "bf16 fsdp": {"bf16": True, "dp_shard_size": 2},
        "fp32": {}}


def _yaml(model_dir: str, root: str, row: str, rank: int = 0) -> dict:
    from adapter.demo.build import ASSETS

    raw = {"base_model": model_dir, "sequence_len": SEQ, "micro_batch_size": 1, "gradient_accumulation_steps": 1,
           "learning_rate": LR, "lr_scheduler": "constant", "warmup_steps": 0, "max_steps": STEPS,
           "max_grad_norm": 1e12, "weight_decay": 0.0, "sample_packing": True, "chat_template": "chatml",
           "datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
           "dataset_prepared_path": f"{root}/prep", "output_dir": f"{root}/{row.replace(' ', '-')}"}
    over = dict(ROWS[row])
    if over.get("deepspeed"):
        over["deepspeed"] = str(_ds_json(root, int(over["deepspeed"][-1]), rank))
    return {**raw, **over}


def _ds_json(root: str, stage: int, rank: int) -> Path:
    """Axolotl's deepspeed_configs/zero{stage}_bf16.json as it ships ("auto" everywhere, bf16 enabled); one file per
    rank (a rank once read the file while another was rewriting it: empty JSON)."""
    import json

    p = Path(root) / f"zero{stage}_bf16.rank{rank}.json"
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    p.write_text(json.dumps({"zero_optimization": zero, "bf16": {"enabled": True}, "gradient_accumulation_steps":
                             "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
                             "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}))
    return p


def _worker(rank, world, model_dir, root):
    import torch

    from adapter.models.resolved import resolve_run
    from adapter.train.engine import init_distributed
    from adapter.train.trainer import Trainer

    init_distributed()
    out = {}
    for row in ROWS:
        cfg = config.build(_yaml(model_dir, root, row, rank), env={}, world_size=world)
        t = Trainer(resolve_run(cfg), log=lambda s: None)
        try:
            t.setup(False)
            res = t.fit(False)
            opt = t.engine.ds.optimizer
            moments = {str(v.dtype) for st in opt.optimizer.state.values() for k, v in st.items()
                       if k.startswith("exp_avg")}
            masters = {str(g.dtype) for g in getattr(opt, "fp32_partitioned_groups_flat", None) or
                       getattr(opt, "single_partition_of_fp32_groups", [])}
            weights = {str(p.dtype) for p in t.engine.ds.module.parameters() if p.requires_grad}
            out[row] = (res.losses, weights, moments, masters, t.run.cfg.optimizer.state_dtype,
                        torch.distributed.get_world_size())
        finally:
            t.close()
    return out


def _reference(model_dir: str, cfg, dtype, master: bool) -> list[float]:
    """transformers trained on the run's samples in the order the two ranks' samplers deal them: the model in
    `dtype`, torch's fused AdamW on its weights, or (`master`) on fp32 copies of them, copied back after each step."""
    import torch
    from transformers import AutoModelForCausalLM

    from adapter.data import DPSampler
    from adapter.data.sft import prepare
    from tests.helpers.runs import vocab_of

    data = prepare(cfg, model_dir, vocab_of(cfg), builder=True, barrier=None, progress=False).train
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    stepped = [p.detach().float().clone().requires_grad_(True) for p in params] if master else params
    opt = torch.optim.AdamW(stepped, lr=LR, betas=cfg.optimizer.betas, eps=cfg.optimizer.eps, weight_decay=0.0,
                            fused=True)
    its = [iter(DPSampler(len(data), dp_rank=r, dp_size=WORLD, micro_batch=1, seed=cfg.data.seed))
           for r in range(WORLD)]
    losses = []
    for _ in range(STEPS):
        parts = [(s, n) for it in its for s, n, _ in packed_examples(model, data, next(it)[0])]
        loss = sum(s for s, _ in parts) / max(sum(n for _, n in parts), 1.0)
        loss.backward()
        if master:
            for m, p in zip(stepped, params):
                m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        model.zero_grad()
        if master:
            with torch.no_grad():
                for m, p in zip(stepped, params):
                    p.copy_(m)
        losses.append(float(loss.detach()))
    return losses


def test_axolotl_precision_rows_train_as_axolotl_does(tmp_path):
    import torch

    from tests.helpers.archs import make_arch
    from tests.helpers.sft_data import tiny_model

    model = str(make_arch("phi", tmp_path / "phi", tiny_model(tmp_path / "tok")))
    got = run_workers(_worker, WORLD, model, str(tmp_path), timeout=900)[0]
    bf16 = "{'torch.bfloat16'}"
    want_dtypes = {"bf16": (bf16, bf16, bf16, "bf16"), "bf16 deepspeed zero2": (bf16, "{'torch.float32'}",
                                                                    "{'torch.float32'}", "fp32"),
                   "bf16 deepspeed": (bf16, "{'torch.float32'}", "{'torch.float32'}", "fp32"),
                   "bf16 fsdp": (bf16, "{'torch.float32'}", "{'torch.float32'}", "fp32"),
                   "fp32": ("{'torch.float32'}", "{'torch.float32'}", "{'torch.float32'}", "fp32")}
    for row, (weights, moments, masters, state) in want_dtypes.items():
        _, w, m, ma, sd, world = got[row]
        assert (str(w), str(m), str(ma), sd) == (weights, moments, masters, state), (row, w, m, ma, sd)
    cfg = config.build(_yaml(model, str(tmp_path), "fp32"), env={}, world_size=WORLD)
    fp32 = _reference(model, cfg, torch.float32, master=False)
    assert max(rel(a, b) for a, b in zip(got["fp32"][0], fp32)) < 1e-4, (got["fp32"][0], fp32)
    pure = _reference(model, cfg, torch.bfloat16, master=False)
    mixed = _reference(model, cfg, torch.bfloat16, master=True)
    gap = max(rel(a, b) for a, b in zip(pure, mixed))
    for row, ref, other in (("bf16", pure, mixed), ("bf16 deepspeed", mixed, pure),
                            ("bf16 deepspeed zero2", mixed, pure), ("bf16 fsdp", mixed, pure)):
        mine = max(rel(a, b) for a, b in zip(got[row][0], ref))
        theirs = max(rel(a, b) for a, b in zip(got[row][0], other))
        assert mine < theirs and mine < gap / 2, (row, got[row][0], ref, other)
