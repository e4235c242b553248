"""Axolotl's own full fine-tune examples (tests/fixtures/axolotl: fft-8b.yaml with its paged 8-bit AdamW, the two
ALST files with adamw_torch_8bit, `sequence_len: 500_000`, `min_sample_len: 200_000`, cp 8 and a ZeRO-3 offload
JSON, and Llama-2's fft_optimized.yml with adamw_bnb_8bit), unchanged but for local dataset paths: `plan` and
`preprocess` pass; `rehearse` passes on fft-8b.yaml and on the DeepSpeed ALST file."""
from __future__ import annotations

import pytest

from tests.helpers.axolotl_home import (
    alpaca_rows,
    cli,
    cli_batch,
    localised_in_workdirs,
    long_rows,
    make_home,
    offline_env,
    write_jsonl,
)

EXAMPLES = {"fft-8b.yaml": 1, "llama3-8b-deepspeed-alst.yaml": 8, "llama3-8b-fsdp2-alst.yaml": 8,
            "fft_optimized.yml": 1}  # name -> GPUs of one node

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """HF_HOME with the examples' base models; local copies of their datasets; each example localised in its own
    working directory (beside it the DeepSpeed JSON the ALST file names, as Axolotl's checkout has it)."""
    root = tmp_path_factory.mktemp("axolotl")
    home = make_home(root, models=("NousResearch/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B",
                                   "NousResearch/Llama-2-7b-hf"))
    alpaca = write_jsonl(root / "data/alpaca.jsonl", alpaca_rows())
    # ALST keeps documents of 200k tokens or more: three of ~250k tokens each (a word is ~3 tokens here)
    long_text = write_jsonl(root / "data/rp_sub.jsonl", long_rows(2, 85_000, "text"))
    chapters = write_jsonl(root / "data/chapters.jsonl", long_rows(1, 85_000, "chapter"))
    data = {"fft-8b.yaml": {0: alpaca}, "fft_optimized.yml": {0: alpaca},
            "llama3-8b-deepspeed-alst.yaml": {0: long_text, 1: chapters},
            "llama3-8b-fsdp2-alst.yaml": {0: long_text, 1: chapters}}
    return localised_in_workdirs(root, {name: data[name] for name in EXAMPLES}), offline_env(home, root)


@pytest.fixture(scope="module")
def planned(setup):
    """Every example's `plan` and `preprocess`, in one process (each from its own working directory)."""
    files, env = setup
    runs = [(files[n].parent, argv) for n in EXAMPLES for argv in (
        ["plan", str(files[n]), "--gpus-per-node", str(EXAMPLES[n]), "--gpu", "h200"],
        ["preprocess", "--config", str(files[n])])]
    got = cli_batch(runs, env)
    return {n: (got[2 * i], got[2 * i + 1]) for i, n in enumerate(EXAMPLES)}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_plan_and_preprocess_pass_unchanged(planned, name):
    (code, out, err), prep = planned[name]
    assert code == 0, err
    assert "8-bit" in out or "AdamW8bit" in out, out  # the example's 8-bit optimizer is honoured, and said
    code, out, err = prep
    assert code == 0 and "prepared data:" in out, (out[-2000:], err[-2000:])
    if "alst" in name:
        assert " 3 kept " in out.replace("\n", " ") or "3 examples" in out, out  # every ~250k-token document


@pytest.mark.parametrize("name", ["fft-8b.yaml", "llama3-8b-deepspeed-alst.yaml"])
def test_rehearse_passes_unchanged(setup, name):
    files, env = setup
    cfg = files[name]
    code, out, err = cli(["rehearse", "--config", str(cfg), "--steps", "2", "--seq-len", "128"], env, cfg.parent)
    assert code == 0 and "rehearsal ok" in out, (out[-3000:], err[-3000:])
    assert "precision: fp32 (the rehearsal's, on CPU; the run itself: bf16)" in out
    resumed = next(ln for ln in out.splitlines() if ln.startswith("step 2/2"))
    assert "lr 0.000e+00" not in resumed, resumed  # the resumed step runs at its schedule's rate
