"""The project's MFU formula against hand-computed numbers and the peer anchors in docs/internals.md."""
from __future__ import annotations

import sys

import pytest

from adapter.models.arch import arch_from_hf_dict
from adapter.models.counts import flops_per_token
from adapter.train import metrics as m

LLAMA_1B = arch_from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
                              "vocab_size": 128256})


def test_mfu_reproduces_peer_anchors():
    fpt = flops_per_token(LLAMA_1B, 4096)
    peak = m.peak_flops("NVIDIA H200")
    assert peak == 989e12 and m.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert m.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert round(m.mfu(39_700, fpt, peak), 3) == 0.362  # docs/internals.md: FSDP2 39.7k tok/s/GPU, 36% MFU
    assert round(m.mfu(36_700, fpt, peak), 3) == 0.335  # docs/internals.md: tp=2 with SDPA, 33.5%
    assert m.mfu(1e5, fpt, None) is None and m.peak_flops("Tesla T4") is None


def test_cpu_has_no_peak_and_reports_rss():
    assert m.peak_flops() is None  # CPU-only test machines
    assert m.peak_memory_bytes() > 10 * 2**20


def test_tokens_per_s_per_gpu():
    # 2 GPUs, micro-batch 2 × dp 2 × 4096 tokens per 0.5 s step -> 16384 tok/s/GPU
    assert m.tokens_per_s_per_gpu(2 * 2 * 4096, 0.5, 2) == 16384


def test_step_clock_times_periods_between_step_ends_and_skips_resets(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("time.perf_counter", lambda: now[0])
    clock = m.StepClock(cuda=False)
    clock.begin()
    now[0] += 2.0
    first = clock.end()
    now[0] += 0.5                 # host work between steps (logging, data) belongs to the next step's period
    clock.begin()                 # no-op after an end
    now[0] += 3.0
    second = clock.end()
    now[0] += 50.0                # a checkpoint save
    clock.reset()
    clock.begin()
    now[0] += 1.5
    third = clock.end()
    assert [m.StepClock.seconds(h) for h in (first, second, third)] == [2.0, 3.5, 1.5]


def test_format_step_leaves_out_unknowns():
    line = m.format_step(12, loss=3.14159, lr=3e-4, grad_norm=1.5, tokens_per_s_gpu=12345.6, mfu=0.352,
                         peak_mem=3 * 2**30, total_steps=100)
    assert line == ("step 12/100 | loss 3.1416 | lr 3.000e-04 | grad_norm 1.500 | 12,346 tok/s/GPU | MFU 35.2% | "
                    "peak_mem 3.00 GiB")
    assert m.format_step(1, loss=1.0, lr=0.1) == "step 1 | loss 1.0000 | lr 1.000e-01"


class _FakeWandb:
    """Records what the sink asks of W&B (the real package is heavy and needs an account or offline mode)."""

    def __init__(self):
        self.calls = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        return self

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


def test_sinks_are_noops_off_rank0_and_when_not_asked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb())
    assert not m.MetricsSink(1, tensorboard_dir=str(tmp_path), wandb_project="p").active
    assert not list(tmp_path.iterdir())
    sink = m.MetricsSink(0)
    assert not sink.active
    sink.log(1, {"loss": 1.0})
    sink.close()


def test_a_missing_sink_package_is_a_one_line_config_error(tmp_path, monkeypatch):
    from adapter.errors import UserError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    for kw, key in (({"tensorboard_dir": str(tmp_path)}, "logging.tensorboard"),
                    ({"wandb_project": "p"}, "logging.wandb_project")):
        for rank in (0, 1):  # every rank refuses, so none trains on alone
            with pytest.raises(UserError, match=key) as err:
                m.MetricsSink(rank, **kw)
            assert "pip install" in str(err.value) and "\n" not in str(err.value)


def test_wandb_sink_sends_project_config_and_steps(monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = m.MetricsSink(0, wandb_project="nd", run_name="r1", config={"seq_len": 64}, wandb_entity="team",
                         wandb_mode="offline")
    sink.log(3, {"loss": 2.5, "mfu": None})
    sink.close()
    assert fake.calls == [("init", {"project": "nd", "name": "r1", "config": {"seq_len": 64}, "entity": "team",
                                    "mode": "offline"}),
                          ("log", {"loss": 2.5}, 3), ("finish",)]


def test_tensorboard_sink_writes_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = m.MetricsSink(0, tensorboard_dir=str(tmp_path))
    sink.log(1, {"loss": 2.0, "grad_norm": None})
    sink.log(2, {"loss": 1.5})
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["scalars"] == ["loss"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0), (2, 1.5)]


def test_host_readback_snapshots_the_values_at_creation():
    import torch

    t = torch.tensor([1.5, 2.0, 0.0], dtype=torch.float64)
    r = m.HostReadback(t)
    t.add_(10)  # the next step reuses the tensor: the reading must not move
    assert r.values() == [1.5, 2.0, 0.0]


def test_a_rehearsal_does_not_ask_for_the_runs_logging_packages(monkeypatch):
    """A rehearsal logs to neither TensorBoard nor W&B (adapter/train/rehearse.py): Axolotl's phi3-ft-fsdp.yml
    (wandb_project set) was refused at `rehearse` on a machine without wandb (found by the examples sweep);
    the run itself still is."""
    from adapter import config
    from adapter.errors import UserError
    from adapter.models.resolved import resolve_run
    from adapter.train.preflight import preflight

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    run = resolve_run(config.build({"base_model": "configs/models/llama-3.2-1b", "learning_rate": 1e-5,
                                    "micro_batch_size": 1, "sequence_len": 128, "max_steps": 2,
                                    "wandb_project": "p"}, env={}, world_size=1))
    preflight(run, need_data=False, saves=False, sinks=False)
    with pytest.raises(UserError, match="wandb_project='p': the wandb package is not installed"):
        preflight(run, need_data=False, saves=False)
