"""`reward_model: true` as Axolotl configures it: its examples/qwen2/reward-model.yaml maps onto objective reward
(TRL's RewardTrainer) and plans unchanged (the model's shape, no weights); `center_rewards_coefficient` is TRL's; a
Bradley-Terry row renders Axolotl's conversation (an empty system turn where the row's system is empty); what is not
built is refused in one line naming the key and the fix. The training itself against TRL:
tests/distributed/test_reward.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from adapter import config
from adapter.errors import UserError
from tests.helpers.cli import run_cli

FIXTURES = Path(__file__).parents[1] / "fixtures" / "axolotl"


def _example(**over) -> dict:
    raw = yaml.safe_load((FIXTURES / "qwen2-reward-model.yaml").read_text())
    raw.update(over)
    return raw


def test_axolotl_reward_example_maps_and_plans(tmp_path):
    from tests.helpers.axolotl_home import with_local_model

    cfg = config.build(_example(), env={}, world_size=1)
    assert cfg.objective == "reward" and cfg.reward.center_coefficient is None and cfg.lora is None
    assert cfg.data.datasets[0].type == "bradley_terry.chat_template"
    assert any(n.startswith("reward_model: true -> objective: reward (TRL's RewardTrainer") for n in cfg.notes)
    centred = config.build(_example(center_rewards_coefficient=0.01), env={}, world_size=1)
    assert centred.reward.center_coefficient == 0.01
    assert any("+ 0.01·(r_chosen + r_rejected)²" in n for n in centred.notes)
    path = with_local_model(FIXTURES / "qwen2-reward-model.yaml", tmp_path, drop=())  # the base's shape, no weights
    code, out, err = run_cli("plan", str(path), "--gpus-per-node", "1")
    said = " ".join(out.split())
    assert code == 0 and "Qwen2ForSequenceClassification" in said and "objective reward" in said, (out[-3000:], err)


@pytest.mark.parametrize("over, needle", [
    ({"num_labels": 2}, "num_labels=2: a reward model has one label"),
    ({"rl": "dpo"}, "reward_model=True: a reward model and rl: dpo are two objectives"),
    ({"center_rewards_coefficient": -1}, "center_rewards_coefficient=-1: must be a number ≥ 0"),
    ({"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
     "adapter='qlora': a 4/8-bit base under a reward model's score head is not built"),
    ({"context_parallel_size": 2}, "context_parallel_size=2: a reward model's score head"),
    ({"datasets": [{"path": "x.jsonl", "type": "chat_template.default"}]},
     "reward_model: true trains on preference pairs of type bradley_terry.chat_template"),
    ({"reward_model": False}, "model_type='AutoModelForSequenceClassification': nd-adapter trains causal"),
    ({"reward_model": None, "model_type": None}, "bradley_terry.chat_template is a preference type (for "
                                                 "reward_model: true)"),
    ({"process_reward_model": True}, "process_reward_model=True: a process reward model and reward_model: True are "
                                     "two objectives"),
])
def test_unbuilt_reward_settings_refused_in_one_line(over, needle):
    from adapter.data.sft.prepare import check_choices

    raw = {k: v for k, v in _example(**over).items() if v is not None}
    world = 2 if any(k.endswith("parallel_size") for k in over) else 1
    with pytest.raises(UserError) as e:
        check_choices(config.build(raw, env={}, world_size=world))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_native_engine_refuses_a_reward_model():
    from adapter.models.arch import NotNative
    from adapter.models.lora import check_native

    with pytest.raises(NotNative, match="a reward model .* is built on the transformers engine only"):
        check_native(config.build(_example(), env={}, world_size=1), SimpleNamespace(moe=False))


def test_bradley_terry_conversation_is_axolotls():
    """Axolotl's strategy adds a system turn of the row's own (empty) system where the conversation starts with the
    user: the chat template then renders an empty system block."""
    from adapter.data.sft.preference_bt import conversation

    row = {"system": "", "input": "Hi?", "chosen": "Hello.", "rejected": "No."}
    assert conversation(row, row["chosen"]) == [{"role": "system", "content": ""},
                                                {"role": "user", "content": "Hi?"},
                                                {"role": "assistant", "content": "Hello."}]
    row["system"] = "Be brief."
    assert conversation(row, "No.")[0] == {"role": "system", "content": "Be brief."} and \
        len(conversation(row, "No.")) == 3


def test_a_template_without_a_system_role_is_one_line_and_drop_system_message_honoured(tmp_path):
    """Axolotl's Gemma 2 reward-model example: its gemma template raises on the system turn the Bradley-Terry
    strategy adds (the row's system column), which was an internal error with a traceback; it is one line naming the
    row and the dataset key that drops the system turn, which Axolotl hands this strategy too and which now works."""
    from tests.helpers.reward import reward_model, rows
    from tests.helpers.sft_data import write_jsonl

    model = reward_model(tmp_path)
    data = write_jsonl(tmp_path / "bt.jsonl", rows(6))
    raw = {"base_model": str(model), "reward_model": True, "chat_template": "gemma", "sequence_len": 64,
           "datasets": [{"path": str(data), "type": "bradley_terry.chat_template"}], "micro_batch_size": 1,
           "dataset_prepared_path": str(tmp_path / "prep"), "output_dir": str(tmp_path / "out"), "max_steps": 1,
           "learning_rate": 1e-5}
    conf = tmp_path / "rm.yaml"
    conf.write_text(yaml.safe_dump(raw))
    code, _, err = run_cli("preprocess", "--config", str(conf))
    line = err.strip().splitlines()[-1]  # (after datasets' own progress line)
    assert code == 2 and line.startswith("nd-adapter: error: datasets[0]='row 0': the chat template failed on it: "
                                         "TemplateError: System role not supported"), err
    assert "drop_system_message: true" in line
    raw["datasets"][0]["drop_system_message"] = True
    conf.write_text(yaml.safe_dump(raw))
    code, out, err = run_cli("preprocess", "--config", str(conf))
    assert code == 0, err
