"""ORPO's preference pairs, as Axolotl 067b021 renders them and TRL 1.8.0's ORPOTrainer tokenises them.

Axolotl's `rl: orpo` reads its dataset types from prompt_strategies/orpo, where `chat_template.argilla` is the one
type: a row holds `chosen` and `rejected` conversations (user and assistant turns alternating, the last assistant
turn the answer), an optional `system`, and an optional `prompt` that replaces every user turn. The prompt is the
conversation up to the last answer rendered with the generation prompt (the top-level chat template); each answer is
the whole conversation rendered with that answer, cut after the prompt's characters (nothing stripped).

TRL's ORPOTrainer (experimental/orpo, `tokenize_row`) tokenises without special tokens: the answer's ids are those
of prompt + answer after the prompt's (one fewer prompt token where the tokenizer merged across the seam), the
tokenizer's BOS is put first where it is not, its EOS last; where prompt + the longer answer exceeds max_length
(Axolotl: sequence_len) both answers are cut to max_length minus the longer answer's length (TRL's arithmetic).
A row still longer than sequence_len is cut there (TRL would keep it whole; Axolotl has already dropped pairs whose
text exceeds sequence_len, so only its added BOS and EOS can reach this).
"""
from __future__ import annotations

DUMMY = "[[unused]]"


def _messages(row: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of an argilla row: Axolotl's ORPODatasetParsingStrategy."""
    chosen_turns = row["chosen"]
    turns, odd = divmod(len(chosen_turns), 2)
    if odd or not turns:
        raise IndexError(f"the chosen conversation has {len(chosen_turns)} turns, not user/assistant pairs")
    prompt: list[dict] = []
    if row.get("system"):
        prompt.append({"role": "system", "content": row["system"], "label": False})
    for i in range(turns):
        user = row["prompt"] if "prompt" in row else chosen_turns[i * 2]["content"]
        prompt.append({"role": "user", "content": user, "label": False})
        if i < turns - 1:
            prompt.append({"role": "assistant", "content": chosen_turns[i * 2 + 1]["content"], "label": False})
    answer = [{"role": "assistant", "content": row[k][-1]["content"], "label": True} for k in ("chosen", "rejected")]
    return prompt, prompt + answer[:1], prompt + answer[1:]


def render_argilla(row: dict, tok, template: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) strings of one row, as Axolotl's orpo `chat_template.argilla` transform."""
    prompt, chosen, rejected = _messages(row)
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, chat_template=template, tokenize=False)
    answers = [tok.apply_chat_template(m, add_generation_prompt=False, chat_template=template,
                                       tokenize=False)[len(text):] for m in (chosen, rejected)]
    return text, answers[0], answers[1]


def _answer(tok, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """TRL's build_tokenized_answer: (prompt ids, answer ids) of prompt + answer tokenised together."""
    full = tok(prompt + answer, add_special_tokens=False)["input_ids"]
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    start = len(p) - (1 if p != full[:len(p)] else 0)
    return full[:start], full[start:]


def tokenize_orpo(tok, prompt: str, chosen: str, rejected: str, max_length: int
                  ) -> tuple[list[int], int, list[int], int]:
    """(chosen ids, its prompt length, rejected ids, its prompt length): TRL 1.8.0's ORPOTrainer.tokenize_row for a
    decoder-only model."""
    (cp, ca), (rp, ra) = _answer(tok, prompt, chosen), _answer(tok, prompt, rejected)
    if sum(a != b for a, b in zip(cp, rp)) > 1 or abs(len(cp) - len(rp)) > 1:
        raise ValueError("Chosen and rejected prompt_input_ids might only differ on the last token due to "
                         "tokenizer merge ops.")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is not None:
        cp = cp if cp and cp[0] == bos else [bos, *cp]
        rp = rp if rp and rp[0] == bos else [bos, *rp]
    ca = ca if ca and ca[-1] == eos else [*ca, eos]
    ra = ra if ra and ra[-1] == eos else [*ra, eos]
    longer = max(len(ca), len(ra))
    if len(cp) + longer > max_length:
        ca = ca[:max_length - longer]
    if len(rp) + longer > max_length:
        ra = ra[:max_length - longer]
    return cp + ca, len(cp), rp + ra, len(rp)


__all__ = ["render_argilla", "tokenize_orpo"]
