"""Axolotl's expert-parallel examples (examples/expert_parallel at 067b021: Qwen3-30B-A3B on 4 GPUs, full fine-tune,
full fine-tune with FSDP and dp_shard_size 2, LoRA on the attention), unchanged but for a local dataset path:
`plan` passes for 4 GPUs with the expert groups Megatron-Core builds, and `rehearse --nproc 4` trains, saves and
resumes at their layouts with a tiny Qwen3-MoE. They write `warmup_steps: 0.1`, a fraction of the run as
transformers reads it (Axolotl's own schema takes whole steps only)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.axolotl_home import (
    alpaca_rows,
    cli,
    cli_batch,
    localised_in_workdirs,
    make_home,
    offline_env,
    write_jsonl,
)

EXAMPLES = {  # file: (dp_shard, ep) on 4 GPUs
    "qwen3_30ba3b_ep_fft_4gpu.yaml": (4, 4),
    "qwen3_30ba3b_ep_fsdp_fft_4gpu.yaml": (4, 2),  # Axolotl's ep × dp_shard = 4 data-parallel ranks, ep 2 over them
    "qwen3_30ba3b_ep_lora_4gpu.yaml": (4, 4),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("axolotl-ep")
    home = make_home(root, models=("Qwen/Qwen3-30B-A3B-Instruct-2507",))
    alpaca = write_jsonl(root / "data/alpaca.jsonl", alpaca_rows())
    return localised_in_workdirs(root, {name: {0: alpaca} for name in EXAMPLES}), offline_env(home, root)


@pytest.fixture(scope="module")
def planned(setup):
    """Each example's `plan` for 4 GPUs, then the EP one's without a world size, in one process."""
    files, env = setup
    runs = [(files[n].parent, ["plan", str(files[n]), "--gpus-per-node", "4", "--gpu", "h200", "--format", "json"])
            for n in EXAMPLES]
    fft = files["qwen3_30ba3b_ep_fft_4gpu.yaml"]
    got = cli_batch([*runs, (fft.parent, ["plan", str(fft)])], env)
    return dict(zip([*EXAMPLES, "no world size"], got))


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_plan_passes_unchanged_with_the_expert_groups(planned, name):
    code, out, err = planned[name]
    assert code == 0, err
    doc = json.loads(out)
    m = doc["mesh"]
    dp_shard, ep = EXAMPLES[name]
    assert (m["dp_replicate"], m["dp_shard"], m["cp"], m["tp"]) == (1, dp_shard, 1, 1)
    groups = {g["name"]: g for g in doc["groups"]}
    assert groups["ep"]["size"] == ep and groups["expt_dp"]["size"] == dp_shard // ep
    notes = "\n".join(doc["notes"])
    assert f"expert_parallel_size: {ep} -> parallelism.ep_size: {ep}" in notes
    assert "AdamW8bit" in notes  # adamw_torch_8bit honoured


def test_without_a_world_size_expert_parallelism_asks_for_one(planned):
    code, out, err = planned["no world size"]
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("nd-adapter: error: expert_parallel_size=4: the world size is not known") and \
        "--gpus-per-node N" in err and "--nproc N" in err


@pytest.mark.parametrize("name", ["qwen3_30ba3b_ep_fft_4gpu.yaml", "qwen3_30ba3b_ep_lora_4gpu.yaml"])
def test_rehearse_passes_unchanged_on_4_processes(setup, name):
    files, env = setup
    cfg = files[name]
    code, out, err = cli(["rehearse", "--config", str(cfg), "--steps", "2", "--nproc", "4",
                          "--seq-len", "128"], env, cfg.parent)
    assert code == 0 and "rehearsal ok: 4 processes, layout 1x4x1x1 ep 4" in out, (out[-3000:], err[-3000:])
    assert ("adapter: LoRA r 32" in out) == ("lora" in name)
    assert "Traceback" not in out + err
