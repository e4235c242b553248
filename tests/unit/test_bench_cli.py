"""CPU smoke test of the GPU comparison script: argument parsing, log parsing and the table (no timings asserted)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare", ROOT / "bench/compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)

LOG = """noise
step 1/4 | loss 12.1000 | lr 0.000e+00 | grad_norm 9.150 | 2,775 tok/s/GPU | MFU 2.5% | peak_mem 15.79 GiB
step 2/4 | loss 12.0000 | lr 5.000e-05 | grad_norm 9.150 | 17,925 tok/s/GPU | MFU 16.4% | peak_mem 20.18 GiB
step 3/4 | loss 11.9000 | lr 9.755e-05 | grad_norm 9.089 | 15,000 tok/s/GPU | MFU 13.0% | peak_mem 20.18 GiB
step 4/4 | loss 11.8000 | lr 9.045e-05 | grad_norm 9.150 | 17,000 tok/s/GPU | MFU 15.0% | peak_mem 20.18 GiB
"""


def test_parse_and_render(capsys):
    ours = compare.parse_steps(LOG)
    assert ours == {"tokens_per_s_per_gpu": 16000, "mfu": 0.14, "peak_gib": 20.18, "loss": 11.8}
    peer = compare.parse_result('x\nRESULT {"system": "accelerate-fsdp2", "tokens_per_s_per_gpu": 32000, '
                                '"mfu": 0.29, "peak_gib": 34.6, "loss": 12.0}\n')
    table = compare.render({"nd-adapter tp=2": ours, "accelerate-fsdp2": peer, "deepspeed-hf": None})
    assert "16,000" in table and "0.50" in table and "failed" in table and "14.0%" in table
    assert compare.main(["--dry-run", "--only", "fsdp2", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc-per-node=2 bench/peers.py accelerate-fsdp2" in out
    assert "deepspeed --num_gpus=2 launch/train.py --config bench/configs/llama-3.2-1b-tp2.yaml" in out
    assert compare.parse_steps("nothing") is None and compare.parse_result("") is None
    masked = "\n".join(f"step {i}/3 | loss 1.0 | lr 1e-4 | grad_norm 1.0 | 7,000 tok/s/GPU | 4,000 trained tok/s/GPU | "
                       f"MFU 1.5% | peak_mem 14.07 GiB" for i in (1, 2, 3))  # a run with masked rows
    assert compare.parse_steps(masked, skip=0) == {"tokens_per_s_per_gpu": 7000, "mfu": 0.015, "peak_gib": 14.07,
                                                    "loss": 1.0}


def test_trace_summary_on_a_synthetic_trace():
    spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "bench/trace_summary.py")
    ts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ts)
    k = lambda name, t, d, tid=7: {"ph": "X", "cat": "kernel", "name": name, "ts": t, "dur": d, "tid": tid}  # noqa
    events = [{"ph": "X", "cat": "user_annotation", "name": "nd.forward", "ts": 0, "dur": 400},
              {"ph": "X", "cat": "user_annotation", "name": "nd.backward", "ts": 400, "dur": 600},
              k("sm90_xmma_gemm_bf16", 100, 200), k("flash_fwd_kernel", 300, 50),
              k("ncclDevKernel_AllGather", 250, 300, tid=9), k("triton_poi_fused_silu", 700, 100),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 560, "dur": 400, "tid": 1},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 960, "dur": 900, "tid": 1},
              {"ph": "X", "cat": "python_function", "name": "deepspeed/zero.py(10): step", "ts": 500, "dur": 500,
               "tid": 1},
              {"ph": "X", "cat": "python_function", "name": "torch/_tensor.py(5): to", "ts": 550, "dur": 420,
               "tid": 1}]
    s = ts.summarize(events)
    assert s["window_ms"] == 1.0 and s["gpu_busy_ms"] == 0.55  # union: [100,550] and [700,800]
    assert s["families_ms"] == {"nccl": 0.3, "gemm": 0.2, "fused (triton)": 0.1, "attention": 0.05}
    assert s["phases_gpu_ms"] == {"nd.forward": 0.25, "nd.backward": 0.1}  # compute stream = tid 7
    assert s["nccl_exposed_ms"] == 0.2  # [350, 550]: the all-gather after the attention kernel ends
    assert s["idle_in_phase_ms"] == {"nd.forward": 0.0, "nd.backward": 0.15}  # gaps between kernels only
    assert s["host_waits"] == [(0.4, "cudaStreamSynchronize", "deepspeed/zero.py(10): step")]  # launches excluded
    text = ts.render(s)
    assert "GPU busy 0.6 ms (55%)" in text and "sm90_xmma_gemm_bf16" in text
    assert ts.summarize([]) == {"error": "no GPU kernels in this trace"}


def test_memory_peak_on_a_synthetic_snapshot():
    """The allocator's history replayed: the peak, what was alive from before the window (less what the window
    freed of it), and the window's live blocks grouped by the first frame outside torch."""
    spec = importlib.util.spec_from_file_location("memory_peak", ROOT / "bench/memory_peak.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    ours = [{"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},  # stacks="all": C++ frames first
            {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/work/main/adapter/modeling/gpt.py", "line": 42, "name": "forward"}]
    ce = [{"filename": "/work/main/adapter/kernels/linear_ce.py", "line": 7, "name": "chunk"}]
    a = lambda addr, size, frames: {"action": "alloc", "addr": addr, "size": size, "frames": frames}  # noqa
    f = lambda addr, size: {"action": "free_completed", "addr": addr, "size": size}  # noqa
    trace = [a(1, 100, ours), a(2, 50, ours), f(9, 30), a(3, 400, ce), f(3, 400), a(4, 10, ce), f(1, 100)]
    # at the end: 50 + 10 from the window, and 1000 - 30 from before it
    segments = [{"device": 0, "blocks": [{"size": 970, "state": "active_allocated"},
                                         {"size": 50, "state": "active_allocated"},
                                         {"size": 10, "state": "active_allocated"},
                                         {"size": 4000, "state": "inactive"}]}]
    r = mp.at_peak({"segments": segments, "device_traces": [trace]})
    assert r["peak"] == 1000 + 100 + 50 - 30 + 400 and r["before_window"] == 970
    assert r["by_site"] == {"adapter/modeling/gpt.py:42 forward": (2, 150), "adapter/kernels/linear_ce.py:7 chunk":
                            (1, 400)}


def test_packed_attention_bench_helpers():
    spec = importlib.util.spec_from_file_location("pab", ROOT / "bench/packed_attention_bench.py")
    pab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pab)
    lens = pab.doc_lengths(4096, 8, seed=0)
    assert sum(lens) == 4096 and len(lens) == 8 and min(lens) > 4096 / 8 / 2 - 8 and max(lens) < 4096 / 8 * 1.5 + 8
    assert pab.causal_flops([4, 4], 2, 8) == 3.5 * 2 * (4 * 16 / 2) * 2 * 8
    row = {"shape": "1x8 2docs", "variant": "varlen (ours)", "ms": 1.0, "tflops": 2.0, "peak_extra_gib": 0.1,
           "max_diff_vs_varlen": 0.0}
    table = pab.render([row, row | {"variant": "dense causal", "max_diff_vs_varlen": None}])
    assert "varlen (ours)" in table and "dense causal" in table and " -" in table


def test_packed_attention_bench_runs_on_cpu(capsys):
    """The GPU script end to end on CPU (fp32, tiny heads, no flex: it has no CPU backward): the varlen path and
    the dense document mask agree."""
    spec = importlib.util.spec_from_file_location("pab", ROOT / "bench/packed_attention_bench.py")
    pab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pab)
    assert pab.main(["--device", "cpu", "--shapes", "2x64x4", "--iters", "1", "--warmup", "0", "--heads", "4",
                     "--kv-heads", "2", "--head-dim", "16", "--variants", "dense causal", "dense doc mask",
                     "varlen (ours)", "varlen, max=seq"]) == 0
    result = compare.parse_result(capsys.readouterr().out)
    diffs = {r["variant"]: r["max_diff_vs_varlen"] for r in result["rows"]}
    assert diffs["dense causal"] is None and diffs["dense doc mask"] < 1e-5 and diffs["varlen, max=seq"] == 0.0


def test_kernel_benches_parse_their_arguments_and_adamw_bench_lists_the_models_parameters():
    """The GPU-only kernel benches start on CPU (imports, --help); adamw_bench's parameter list is the model's."""
    import json
    import math
    import subprocess
    import sys

    for name in ("adamw_bench", "fp8_mlp_bench", "rope_bench", "sdpa_backends"):
        out = subprocess.run([sys.executable, str(ROOT / f"bench/{name}.py"), "--help"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and "usage" in out.stdout, (name, out.stderr[-500:])
    spec = importlib.util.spec_from_file_location("adamw_bench", ROOT / "bench/adamw_bench.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    for shape, params in (("1b", 1_235_814_400), ("3b", 3_212_749_824)):  # num_params of the compare runs' logs
        cfg = json.loads((ROOT / f"configs/models/{ab.SHAPES[shape]}/config.json").read_text())
        assert sum(math.prod(s) for s in ab.param_shapes(cfg)) == params
