"""The CPU shims still match the installed megatron-core: fail loudly after an upgrade instead of mis-running."""
from __future__ import annotations

import types

import torch

from adapter.patches import mcore


def test_megatron_version_is_one_the_shims_were_verified_on():
    assert mcore.megatron_version() in mcore.TESTED_MEGATRON_VERSIONS, (
        "megatron-core changed: re-verify adapter/patches/mcore.py against it, then add the version")


def test_patched_symbols_still_exist():
    assert mcore.check() == []


def test_cp_rotary_shim_selects_megatrons_chunks():
    from adapter.kernels.attention import split_for_cp

    pos = torch.arange(16.0)[:, None, None, None]  # [s, 1, 1, d] like RotaryEmbedding's table
    for r in range(4):
        group = types.SimpleNamespace(size=lambda: 4, rank=lambda r=r: r)
        assert torch.equal(mcore._pos_emb_on_this_cp_rank(pos, 0, group), split_for_cp(pos, 4, r, 0))




def test_deepspeed_s_cpu_backend_builds_no_shared_memory_op(monkeypatch):
    """The op DeepSpeed's TorchBackend would JIT-compile (~45 s on a fresh machine) is skipped: the patch must land on
    deepspeed.comm.torch, which `import deepspeed.comm.torch as m` does not give (it gives torch: the first version of
    the patch set an attribute on torch and the op kept building)."""
    import importlib

    from adapter.patches.ds_comm import skip_cpu_shm_op

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setattr(ds_torch, "build_shm_op", lambda: (_ for _ in ()).throw(AssertionError("builds the op")))
    skip_cpu_shm_op()
    assert ds_torch.build_shm_op() is None


def test_bitsandbytes_int8_linear_takes_a_4d_input_as_its_rows():
    """GLM-4.7-Flash's kv_b_proj gets [batch, tokens, heads, rank]: bitsandbytes 0.50's int8 path failed on it (the
    sweep of Axolotl's examples found it); flattened rows give what the 3-D path gives, row for row."""
    import bitsandbytes as bnb

    from adapter.patches.bnb_int8 import int8_any_rank_input

    torch.manual_seed(0)
    lin = bnb.nn.Linear8bitLt(16, 8, bias=True, has_fp16_weights=False, threshold=6.0)
    lin.load_state_dict(torch.nn.Linear(16, 8).state_dict())
    lin = lin.to("cpu").eval()  # quantises the weight; eval: the path evaluations (and the reference) take
    x = torch.randn(2, 3, 4, 16)
    int8_any_rank_input()
    for train in (False, True):
        lin.train(train)
        got = lin(x)
        want = lin(x.reshape(2, 12, 16)).reshape(2, 3, 4, 8)
        assert got.shape == (2, 3, 4, 8) and torch.equal(got, want), train


def test_bitsandbytes_nf4_linear_computes_eval_forwards_as_training_ones():
    """On an AVX512-BF16 CPU bitsandbytes 0.50 repacks an NF4 weight for its bf16 inference kernel at the first
    eval-mode forward and keeps it so; after one_cpu_path the eval forward and every later training forward give the
    training path's numbers (on other CPUs the branch is never taken: the same assertions hold)."""
    import bitsandbytes as bnb

    from adapter.patches.bnb_cpu import one_cpu_path

    torch.manual_seed(0)
    lin = bnb.nn.Linear4bit(64, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(torch.randn(128, 64) * 0.02, requires_grad=False, quant_type="nf4")
    lin = lin.to("cpu")
    x = torch.randn(3, 64)
    want = lin.train()(x)
    one_cpu_path(torch.nn.Sequential(lin))
    assert torch.equal(lin.eval()(x), want) and torch.equal(lin.train()(x), want)
    assert not getattr(lin.weight.quant_state, "packing_format_for_cpu", False)


def test_the_shared_gpu_mode_puts_every_deepspeed_device_index_on_cuda_0(monkeypatch):
    """DeepSpeed takes LOCAL_RANK as the CUDA index (engine, zero.Init); one GPU has no cuda:1."""
    import torch
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from adapter.patches.ds_comm import one_cuda_device

    acc, chosen = CUDA_Accelerator(), []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert acc.device_name(1) == "cuda:1"  # DeepSpeed's own answer: no such device on one GPU
    one_cuda_device(acc)
    acc.set_device(1)
    assert (acc.device_name(1), acc.device_name(), acc.device(3), chosen) == ("cuda:0", "cuda", torch.device("cuda", 0),
                                                                              [0])
    assert CUDA_Accelerator().device_name(1) == "cuda:1"  # the instance, not the class
