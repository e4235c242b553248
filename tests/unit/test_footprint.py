"""What a run writes (adapter/models/footprint.py): checkpoint sizes by ZeRO stage, optimizer and adapters, and the
one-line refusal when the retention cannot fit the disk (a run on the GPU host died at step 15 inside torch.save,
keeping four 15 GB checkpoints on a 64 GB disk)."""
from __future__ import annotations

from pathlib import Path

import pytest

from adapter import config
from adapter.errors import UserError
from adapter.models import footprint
from adapter.models.arch import load_arch
from adapter.models.counts import num_params
from tests.helpers.runs import planned

MODEL = Path(__file__).resolve().parents[2] / "configs/models/llama-3.2-1b"


def cfg(**over):
    raw = {"model": {"path": str(MODEL)}, "seq_len": 1024, "precision": "bf16", "data": {"synthetic": True},
           "optimizer": {"max_steps": 120}, "checkpoint": {"dir": "/tmp/nd-footprint-test", "keep_last": 4}}
    for k, v in over.items():
        config.set_dotted(raw, k, v)
    return config.build(raw, env={}, world_size=1)


def test_checkpoint_sizes():
    arch = load_arch(MODEL)
    n = num_params(arch)
    # that run's case: bf16 weights beside fp32 master weights and moments, 14 bytes a parameter (~17 GB at 1.24B)
    assert footprint.checkpoint_bytes(planned(cfg(), arch), stage=1) == 14 * n
    # ZeRO-3: the partitions are the optimizer's
    assert footprint.checkpoint_bytes(planned(cfg(), arch), stage=3) == 12 * n
    assert footprint.checkpoint_bytes(planned(cfg(**{"optimizer.name": "adamw_8bit"}), arch), stage=1) == int(
        (2 + 4 + 2 + 8 / 256) * n)
    lora = cfg(lora={"r": 16, "alpha": 32, "target_linear": True})
    trained = footprint.held_and_trained(planned(lora, arch), 1)[1]
    assert footprint.checkpoint_bytes(planned(lora, arch), stage=3) == 14 * trained < n  # adapters only


def test_disk_check_says_the_numbers_or_refuses_in_one_line():
    arch = load_arch(MODEL)
    size = footprint.checkpoint_bytes(planned(cfg(), arch), stage=1)
    said = footprint.check_disk(planned(cfg(), arch), stage=1, saves=40, free=10**13)
    assert said.startswith(f"checkpoints: {size / 1e9:.1f} GB each, up to 5 at once (checkpoint.keep_last=4")
    assert footprint.check_disk(planned(cfg(), arch), stage=1, saves=1, free=size) is not None  # one save: one size
    with pytest.raises(UserError, match=r"^checkpoint.keep_last=4: the run's checkpoints will not fit: .* GB free "
                       r"in /tmp/nd-footprint-test\. Fix: lower checkpoint.keep_last") as e:
        footprint.check_disk(planned(cfg(), arch), stage=1, saves=40, free=4 * size)
    assert "\n" not in str(e.value)
    assert "will NOT fit" in footprint.check_disk(planned(cfg(), arch), stage=1, saves=40, free=4 * size, refuse=False)
    # resuming beside 4 kept checkpoints needs room for one more, not five
    assert footprint.check_disk(planned(cfg(), arch), stage=1, saves=40, existing=4, free=size + 1)
    axolotl = config.build({"base_model": str(MODEL), "sequence_len": 1024, "max_steps": 120, "output_dir": "/tmp/o",
                            "learning_rate": 1e-5,
                            "save_total_limit": 2, "save_steps": 3}, env={}, world_size=1)
    with pytest.raises(UserError, match=r"^save_total_limit=2: .* Fix: lower save_total_limit, save less often "
                       r"\(save_steps / saves_per_epoch\), or point output_dir"):
        footprint.check_disk(planned(axolotl, arch), stage=1, saves=40, free=1)


def test_saving_a_large_checkpoint_often_is_said():
    arch = load_arch(MODEL)  # 1.24B: a 17 GB checkpoint at 14 bytes a parameter
    said = footprint.cadence_warning(planned(cfg(), arch), stage=1, every=3)
    assert said.startswith("a 17 GB checkpoint every 3 steps") and "checkpoint.save_every" in said
    assert footprint.cadence_warning(planned(cfg(), arch), stage=1, every=500) is None
    assert footprint.cadence_warning(planned(cfg(lora={"r": 8}), arch), stage=1, every=3) is None  # adapters: small


def test_one_checkpoint_too_large_names_the_directory_and_no_checkpoints_still_checks_the_export():
    """save_total_limit is not the cause when the run writes one checkpoint (it used to be named as the fix), and
    Axolotl's save_strategy: no writes none: the export alone is checked, under output_dir's name."""
    arch = load_arch(MODEL)
    base = {"base_model": str(MODEL), "sequence_len": 1024, "max_steps": 12, "output_dir": "/tmp/o",
            "learning_rate": 1e-5, "bf16": True}
    one = config.build(base, env={}, world_size=1)
    with pytest.raises(UserError, match=r"^output_dir='/tmp/o': the run's checkpoint will not fit: .* Fix: point "
                       r"output_dir at a larger disk"):
        footprint.check_disk(planned(one, arch), stage=1, saves=1, free=1)
    none = config.build({**base, "save_strategy": "no"}, env={}, world_size=1)
    assert none.checkpoint.dir is None and none.checkpoint.export_hf == "/tmp/o"
    assert footprint.check_disk(planned(none, arch), stage=1, saves=0, free=10**13).startswith(
        f"export: {2 * num_params(arch) / 1e9:.1f} GB at the end")
    with pytest.raises(UserError, match=r"^output_dir='/tmp/o': the trained model will not fit: .* Fix: point "
                       r"output_dir at a larger disk"):
        footprint.check_disk(planned(none, arch), stage=1, saves=0, free=1)
