"""Reward-model pairs (`reward_model: true`) as Axolotl 067b021's `bradley_terry.chat_template` type renders them
(prompt_strategies/bradley_terry/chat_template.py) for TRL 1.8.0's RewardTrainer.

A row holds `system`, `input`, `chosen` and `rejected` strings. Each answer becomes one conversation: a system turn
when `system` is set, the user's `input`, the assistant's answer. Axolotl's chat-template strategy then adds a system
turn of its own in front of a conversation that starts with another role, its content the row's `system` column (so
an empty `system` still renders an empty system turn, as Axolotl's does). Each conversation is tokenised through the
chat template as that strategy's legacy path does (no roles_to_train / train_on_eos): the prompt's ids (every turn
but the last, with the generation prompt), then the whole conversation's ids after as many tokens; cut to
`sequence_len` keeping the start (Axolotl's max_length for reward models), never dropped. TRL takes such rows as they
are (its max_length, which Axolotl sets to sequence_len, then drops none) and pads each micro-batch with the pad
token, else EOS. The whole sequence is the model's input: its score is read at its last token that is not the pad
token (transformers' sequence-classification pooling).
"""
from __future__ import annotations

from typing import Any


def conversation(row: dict[str, Any], answer: str, drop_system: bool = False) -> list[dict[str, Any]]:
    """The turns Axolotl's strategy renders for one answer of a row; `drop_system` (the entry's drop_system_message,
    which Axolotl hands this strategy's prompter): without the system turn."""
    messages = ([{"role": "system", "content": row["system"]}] if row["system"] else []) + [
        {"role": "user", "content": row["input"]}, {"role": "assistant", "content": answer}]
    if messages[0]["role"] != "system":  # ChatTemplateStrategy.get_conversation_thread: field_system is in the row
        messages = [{"role": "system", "content": row["system"]}, *messages]
    return messages[1:] if drop_system else messages


def tokenize_bt(row: dict[str, Any], tok, template: str, seq_len: int,
                drop_system: bool = False) -> tuple[list[int], list[int]]:
    """(chosen ids, rejected ids) of one row."""
    out = []
    for key in ("chosen", "rejected"):
        turns = conversation(row, row[key], drop_system)
        prompt = tok.apply_chat_template(turns[:-1], add_generation_prompt=True, chat_template=template,
                                         tokenize=True, return_dict=False)
        whole = tok.apply_chat_template(turns, add_generation_prompt=False, chat_template=template, tokenize=True,
                                        return_dict=False)
        out.append((list(prompt) + list(whole)[len(prompt):])[:seq_len])
    return out[0], out[1]


__all__ = ["conversation", "tokenize_bt"]
