"""GPU host only: DPO's three ways of running a pair on one GPU, bf16, agree: padded rows (SDPA), the shared-prompt
stream (FlashAttention varlen, each prompt once) and that stream through compiled layers (inductor; the stream's
length changes with every micro-batch, so after its second value the graphs take it as a symbol instead of
recompiling per length). The exact semantics (fp32, against TRL) are tests/distributed/test_dpo.py's; here the CUDA
kernels and inductor's code run them."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _worker(rank, world, model, data, root):
    import torch
    from torch._dynamo.utils import counters

    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train

    torch.cuda.set_device(rank)
    init_distributed()
    out = {}
    for name, share, compiled in (("padded", False, False), ("stream", "auto", False), ("compiled", "auto", True)):
        raw = {"model": {"path": model, "engine": "megatron", "compile": compiled, "cache_dir": f"{root}/cache"},
               "objective": "dpo", "dpo": {"beta": 0.1, "share_prompt": share},
               "lora": {"r": 8, "alpha": 16, "target_linear": True}, "seq_len": 256, "precision": "bf16",
               "batch": {"micro_batch_size": 1, "gradient_accumulation_steps": 2},
               "optimizer": {"lr": 2e-3, "schedule": "constant", "warmup_steps": 0, "max_steps": 6},
               "data": {"datasets": [{"path": data, "type": "chat_template.default"}], "chat_template": "chatml",
                        "prepared_path": f"{root}/prep"}, "eval": {"per_epoch": 0}}
        said: list[str] = []
        before = counters["stats"]["unique_graphs"]
        res = train(config.build(raw, env={}, world_size=world), log=said.append)
        graphs = counters["stats"]["unique_graphs"] - before
        out[name] = {"losses": res.losses, "rewards": res.rewards, "graphs": graphs,
                     "pairs": [s for s in said if s.startswith("pairs:")]}
    return out


def test_dpo_stream_and_compiled_layers_match_padded_rows_on_cuda(tmp_path):
    from adapter.demo.build import make_tiny_llama
    from tests.helpers.sft_data import tiny_model, varied_pairs, write_jsonl

    tok = tiny_model(tmp_path / "t", vocab=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2, seed=0)
    data = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs())
    got = run_workers(_worker, 1, str(model), str(data), str(tmp_path), timeout=600)[0]
    print({k: (v["losses"], [r["logps/chosen"] for r in v["rewards"]], v["graphs"]) for k, v in got.items()})
    assert got["padded"]["pairs"] == [] and all(v["pairs"][0].startswith("pairs: each pair's prompt runs once")
                                                for k, v in got.items() if k != "padded"), got
    want = got["padded"]
    for name in ("stream", "compiled"):
        run = got[name]
        assert len(run["losses"]) == 6
        for a, b in zip(run["losses"], want["losses"], strict=True):
            assert abs(a - b) <= 1e-2, (name, run["losses"], want["losses"])
        for ra, rb in zip(run["rewards"], want["rewards"], strict=True):
            for k in ("logps/chosen", "logps/rejected"):
                assert abs(ra[k] - rb[k]) <= 2e-2 * abs(rb[k]), (name, k, ra[k], rb[k])
            assert abs(ra["rewards/margins"] - rb["rewards/margins"]) <= 2e-2 + 0.2 * abs(rb["rewards/margins"])
    assert abs(want["rewards"][-1]["rewards/margins"]) > 1e-3  # the adapters moved the policy off the reference
    # 12 micro-batches of as many lengths: the layers' graphs (policy, reference; static, then one symbolic each)
    # stay few, where static graphs would recompile for every length
    assert got["compiled"]["graphs"] - got["stream"]["graphs"] <= 6, got["compiled"]["graphs"]
