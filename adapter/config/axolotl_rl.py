"""Axolotl's `rl:` keys mapped onto `objective:` and `dpo:` (adapter/config/schema_rl.py).

Built: `rl: dpo` with TRL's sigmoid loss, as Axolotl 067b021 hands it to TRL 1.8.0's DPOTrainer (its
core/builders/rl.py and core/trainers/dpo/__init__.py): beta from `trl.beta`, else `rl_beta` (the deprecated
`dpo_beta` fills an unset `rl_beta`), else TRL's 0.1. Every other `rl:` value, and any DPO option that would change
the loss, is refused in one line: a preference config run as something else would finish and export a model that
is not the one asked for.
"""
from __future__ import annotations

from typing import Any

from adapter.config.axolotl_scope import is_on
from adapter.errors import bad

ONLINE = ("grpo", "gdpo", "ebft")  # they sample completions from the policy during training
NOT_BUILT = ("ipo", "orpo", "kto", "simpo")
# DPO options of Axolotl that change TRL's loss, refused when on: (why, fix)
LOSS_OPTIONS = {
    "dpo_label_smoothing": ("TRL 1.8.0 (Axolotl's pin) ignores label smoothing in the sigmoid loss, so the value would "
                            "do nothing there either; conservative DPO (the robust loss) is not built", "remove it"),
    "dpo_use_weighting": ("WPO weighting is not built", "remove it"),
    "dpo_loss_weights": ("weighted mixtures of DPO losses are not built", "remove it (one sigmoid loss)"),
    "rpo_alpha": ("RPO (an NLL term on the chosen answer) is not built", "remove it"),
    "dpo_norm_loss": ("the length-normalised DPO loss is not built", "remove it"),
    "simpo_gamma": ("SimPO's margin applies to rl: simpo, which is not built", "remove it"),
    "cpo_alpha": ("CPO's NLL weight applies to rl: simpo, which is not built", "remove it"),
    "orpo_alpha": ("ORPO's weight applies to rl: orpo, which is not built (and TRL reads it as beta)", "remove it"),
}
# read here; the speed / memory options are noted (nd-adapter's own forward runs the pairs)
NOTED = ("dpo_padding_free", "dpo_use_liger_kernel", "precompute_ref_log_probs", "max_prompt_len")
RL_KEYS = {"rl", "rl_beta", "dpo_beta", "beta", "trl", "dpo_loss_type", *LOSS_OPTIONS, *NOTED}


def map_rl(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`rl: dpo` -> objective: dpo with dpo.beta; other values and unbuilt loss options: one line, exit 2."""
    rl = raw.get("rl")
    if not is_on(rl):
        return
    if rl in ONLINE:
        raise bad("rl", rl, f"{rl.upper()} is an online method: it generates completions with the policy during "
                  "training (Axolotl runs vLLM beside the trainer), which nd-adapter does not do",
                  "run this config with Axolotl, or train DPO on fixed preference pairs (rl: dpo)")
    if rl != "dpo":
        raise bad("rl", rl, "only rl: dpo (TRL's sigmoid loss, LoRA, transformers engine) is built"
                  + (f"; {rl} is not yet" if rl in NOT_BUILT else ""), "use rl: dpo, or run this config with Axolotl")
    loss = raw.get("dpo_loss_type")
    if loss not in (None, "sigmoid", ["sigmoid"]):
        raise bad("dpo_loss_type", loss, "only TRL's sigmoid loss is built", "remove it (sigmoid is the default)")
    for key, (why, fix) in LOSS_OPTIONS.items():
        if is_on(raw.get(key)):
            raise bad(key, raw[key], why, fix)
    trl = raw.get("trl") or {}
    if not isinstance(trl, dict):
        raise bad("trl", trl, "must be a mapping", "write `trl:` with its keys indented below it (beta: 0.1)")
    if raw.get("beta") is not None and trl.get("beta") is not None and raw["beta"] != trl["beta"]:
        raise bad("beta", raw["beta"], "beta and trl.beta differ (Axolotl refuses this too)", "remove one")
    beta = next((v for v in (trl.get("beta"), raw.get("beta"), raw.get("rl_beta"), raw.get("dpo_beta"))
                 if v is not None), None)
    out["objective"] = "dpo"
    if beta is not None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
            raise bad("rl_beta", beta, "beta must be a number above 0", "give e.g. rl_beta: 0.1 (TRL's default)")
        out.setdefault("dpo", {})["beta"] = float(beta)
    ref = ("the base with the LoRA adapters disabled" if is_on(raw.get("adapter")) else
           "the starting weights' log-probabilities, computed once before step 1")
    notes.append(f"rl: dpo -> objective: dpo (TRL's sigmoid loss, beta {beta if beta is not None else 0.1}, "
                 f"reference = {ref})")
    said = [k for k in NOTED if raw.get(k) is not None]
    if said:
        notes.append(f"{', '.join(said)}: noted, no effect (speed or memory options of TRL's trainer; max_prompt_len "
                     "does not reach TRL 1.8.0's DPO in Axolotl either)")
    other = sorted(k for k in trl if k != "beta")
    if other:
        notes.append(f"ignored trl keys (not read by DPO): {', '.join(other)}")


__all__ = ["map_rl", "RL_KEYS", "ONLINE"]
