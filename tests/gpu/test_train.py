"""GPU host only: the training entry point on one GPU (NCCL), bf16, tiny model; run with `pytest -m gpu`."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_workers

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _worker(rank, world, model_dir):
    import torch

    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    torch.cuda.set_device(rank)
    init_distributed()
    raw = {"model": {"path": model_dir}, "parallelism": {"tp_size": world}, "seq_len": 256, "precision": "bf16",
           "batch": {"micro_batch_size": 2}, "optimizer": {"lr": 1e-3, "warmup_steps": 0, "max_steps": 8,
                                                          "schedule": "constant"},
           "data": {"synthetic": True}}
    return run(config.build(raw, env={}, world_size=world), log=lambda s: None).losses


def test_train_tp_on_gpus(tmp_path):
    import torch

    from adapter.demo.build import make_tiny_llama, train_tokenizer

    tok = train_tokenizer(out_dir=tmp_path / "tok", vocab_size=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2)
    world = min(2, torch.cuda.device_count())
    losses = run_workers(_worker, world, str(model), timeout=600)[0]
    assert len(losses) == 8 and all(x == x for x in losses)


def _zero2_worker(rank, world, model_dir, patched):
    import torch

    from adapter import config
    from adapter.patches import zero
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    torch.cuda.set_device(rank)
    if not patched:  # DeepSpeed's own stage-2 epilogue and step, host waits included
        zero.install_zero12_step = lambda optimizer: None
    init_distributed()
    raw = {"model": {"path": model_dir, "compile": False}, "parallelism": {"dp_shard_size": world}, "seq_len": 256,
           "precision": "fp32",
           "batch": {"micro_batch_size": 2}, "optimizer": {"lr": 1e-3, "warmup_steps": 0, "max_steps": 8,
                                                          "schedule": "constant", "clip_grad": 0.5},
           "deepspeed": {"zero_stage": 2, "reduce_bucket_size": 20000}, "data": {"synthetic": True}}
    lines = []
    losses = run(config.build(raw, env={}, world_size=world), log=lines.append).losses
    return losses, [float(x.split("grad_norm ")[1].split()[0]) for x in lines if x.startswith("step ")]


@pytest.mark.skipif(not __import__("torch").cuda.device_count() >= 2, reason="needs 2 CUDA devices")
def test_zero2_without_host_waits_matches_deepspeed(tmp_path):
    """adapter.patches.zero (device-side clipping, stream-ordered epilogue with overlap_comm and many small buckets)
    must train exactly as DeepSpeed's own stage-2 path on GPUs."""
    from adapter.demo.build import make_tiny_llama, train_tokenizer

    tok = train_tokenizer(out_dir=tmp_path / "tok", vocab_size=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2)
    ours, ours_gn = run_workers(_zero2_worker, 2, str(model), True, timeout=600)[0]
    theirs, theirs_gn = run_workers(_zero2_worker, 2, str(model), False, timeout=600)[0]
    assert len(ours) == 8 and max(theirs_gn) > 0.5  # clipping was active
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-5, (ours, theirs)
    assert max(abs(a - b) for a, b in zip(ours_gn, theirs_gn)) < 1e-3, (ours_gn, theirs_gn)


def _reshard_worker(rank, world, model_dir, root):
    import torch

    from adapter import config
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    torch.cuda.set_device(rank)
    init_distributed()

    def cfg(precision, steps, impl, ckpt=None):
        raw = {"model": {"path": model_dir, "compile": False}, "seq_len": 256, "precision": precision,
               "batch": {"micro_batch_size": 2}, "data": {"synthetic": True},
               "optimizer": {"lr": 1e-3, "warmup_steps": 0, "max_steps": steps, "schedule": "constant",
                             "impl": impl}}
        if ckpt:
            raw["checkpoint"] = {"dir": f"{root}/{ckpt}"}
        return config.build(raw, env={}, world_size=world)

    out = {}
    for precision in ("fp32", "bf16"):
        whole = run(cfg(precision, 8, "flat"), log=lambda s: None).losses
        ck = f"moving-{precision}"
        run(cfg(precision, 3, "flat", ck), log=lambda s: None)
        moved = run(cfg(precision, 6, "deepspeed", ck), resume=True, log=lambda s: None)  # flat AdamW -> ZeRO-1
        back = run(cfg(precision, 8, "flat", ck), resume=True, log=lambda s: None)  # and back
        out[precision] = (whole, moved.start_step, moved.losses + back.losses, back.start_step)
    return out


def test_resume_moves_between_the_flat_adamw_and_zero_on_cuda(tmp_path):
    """Resharding on CUDA (AdamW's fused state on the device; in bf16 the fp32 masters apart from the weights): the
    moved run continues the whole run's curve, to 1e-5 in fp32 (the two optimizers' arithmetic differs in rounding
    only) and within bf16 noise in bf16."""
    from adapter.demo.build import make_tiny_llama, train_tokenizer

    tok = train_tokenizer(out_dir=tmp_path / "tok", vocab_size=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2)
    out = run_workers(_reshard_worker, 1, str(model), str(tmp_path), timeout=600)[0]
    for precision, tol in (("fp32", 1e-5), ("bf16", 5e-3)):
        whole, s1, moved, s2 = out[precision]
        assert (s1, s2) == (3, 6) and len(moved) == 5, (precision, s1, s2, moved)
        assert max(abs(a - b) / b for a, b in zip(moved, whole[3:])) < tol, (precision, moved, whole)


def _hf_compile_worker(rank, world, model_dir, root):
    from torch._dynamo.utils import counters

    from adapter import config
    from adapter.demo.build import ASSETS
    from adapter.train.engine import init_distributed
    from tests.helpers.runs import train as run

    init_distributed()
    out = {}
    variants = {False: {}, True: {"compile": True}, "fused CE": {"fused_linear_ce": True}}
    for compiled, model in variants.items():  # the transformers engine, inductor on CUDA, checkpointing inside;
        # and eager with nd-adapter's fused linear CE over the body's hidden states
        raw = {"model": {"path": model_dir, "engine": "transformers", **model},
               "seq_len": 256, "precision": "bf16", "recompute": "full",
               "batch": {"micro_batch_size": 2}, "optimizer": {"lr": 1e-3, "warmup_steps": 0, "max_steps": 6,
                                                              "schedule": "constant"},
               "data": {"datasets": [{"path": str(ASSETS / "chat_genesis.jsonl"), "type": "chat_template"}],
                        "chat_template": "chatml", "sample_packing": True, "prepared_path": f"{root}/prep"}}
        out[compiled] = run(config.build(raw, env={}, world_size=world), log=lambda s: None).losses
        if compiled is True:
            out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def test_compiled_layers_on_the_transformers_engine_on_cuda(tmp_path):
    """Compiled decoder layers of transformers' own model (inductor, bf16, packed documents, gradient
    checkpointing), and its loss by nd-adapter's fused linear CE (model.fused_linear_ce: true), follow the eager run
    inside the bf16 band of the other GPU parity tests."""
    from adapter.demo.build import make_tiny_llama, train_tokenizer

    tok = train_tokenizer(out_dir=tmp_path / "tok", vocab_size=512)
    model = make_tiny_llama(tmp_path / "m", tokenizer_dir=tok, hidden=128, layers=2, heads=4, kv_heads=2)
    got = run_workers(_hf_compile_worker, 1, str(model), str(tmp_path), timeout=600)[0]
    eager, compiled = got[False], got[True]
    assert got["graphs"] > 0 and len(compiled) == 6
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)) < 2e-2, (compiled, eager)
    assert max(abs(a - b) / abs(b) for a, b in zip(got["fused CE"], eager)) < 2e-2, (got["fused CE"], eager)
