"""Axolotl's `rl:` keys mapped onto `objective:` and `dpo:` (adapter/config/schema_rl.py).

Built: `rl: dpo` with TRL's sigmoid loss, as Axolotl 067b021 hands it to TRL 1.8.0's DPOTrainer (its
core/builders/rl.py and core/trainers/dpo/__init__.py): beta from `trl.beta`, else `rl_beta` (the deprecated
`dpo_beta` fills an unset `rl_beta`), else TRL's 0.1. `rl: orpo` as Axolotl hands it to TRL's ORPOTrainer: the same
chain with `orpo_alpha` last (Axolotl: "trl does some odd mapping of alpha to beta"), the DPO options not passed.
Every other `rl:` value, and any DPO option that would change the loss, is refused in one line: a preference config
run as something else would finish and export a model that is not the one asked for.
"""
from __future__ import annotations

from typing import Any

from adapter.config.axolotl_scope import is_on
from adapter.errors import bad

ONLINE = ("grpo", "gdpo", "ebft")  # they sample completions from the policy during training
NOT_BUILT = ("ipo", "kto", "simpo")
BUILT = ("dpo", "orpo")
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
    "orpo_alpha": ("ORPO's weight: Axolotl would hand it to this trainer as beta when rl_beta is unset",
                   "give rl_beta instead, or set rl: orpo"),
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
    if rl not in BUILT:
        raise bad("rl", rl, "only rl: dpo (TRL's sigmoid loss) and rl: orpo are built"
                  + (f"; {rl} is not yet" if rl in NOT_BUILT else ""), "use rl: dpo, or run this config with Axolotl")
    loss = raw.get("dpo_loss_type")
    if rl == "dpo" and loss not in (None, "sigmoid", ["sigmoid"]):
        raise bad("dpo_loss_type", loss, "only TRL's sigmoid loss is built", "remove it (sigmoid is the default)")
    dpo_only = [k for k in (*LOSS_OPTIONS, "dpo_loss_type") if k not in ("orpo_alpha", "simpo_gamma", "cpo_alpha")]
    for key, (why, fix) in LOSS_OPTIONS.items():
        if is_on(raw.get(key)) and not (rl == "orpo" and key in (*dpo_only, "orpo_alpha")):
            raise bad(key, raw[key], why, fix)
    trl = raw.get("trl") or {}
    if not isinstance(trl, dict):
        raise bad("trl", trl, "must be a mapping", "write `trl:` with its keys indented below it (beta: 0.1)")
    if raw.get("beta") is not None and trl.get("beta") is not None and raw["beta"] != trl["beta"]:
        raise bad("beta", raw["beta"], "beta and trl.beta differ (Axolotl refuses this too)", "remove one")
    chain = (trl.get("beta"), raw.get("beta"), raw.get("rl_beta"), raw.get("dpo_beta"),
             raw.get("orpo_alpha") if rl == "orpo" else None)
    beta = next((v for v in chain if v is not None), None)
    out["objective"] = rl
    if beta is not None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
            key = "orpo_alpha" if rl == "orpo" and beta is chain[-1] else "rl_beta"
            raise bad(key, beta, "beta must be a number above 0", f"give e.g. {key}: 0.1 (TRL's default)")
        out.setdefault(rl, {})["alpha" if rl == "orpo" else "beta"] = float(beta)
    shown = beta if beta is not None else 0.1
    if rl == "orpo":
        notes.append(f"rl: orpo -> objective: orpo (TRL's ORPOTrainer, orpo.alpha {shown} as its beta, no reference)")
        ignored = [k for k in dpo_only if raw.get(k) is not None]
        if ignored:
            notes.append(f"{', '.join(ignored)}: not read by ORPO (Axolotl passes them to DPO only)")
    else:
        ref = ("the base with the LoRA adapters disabled" if is_on(raw.get("adapter")) else
               "the starting weights' log-probabilities, computed once before step 1")
        notes.append(f"rl: dpo -> objective: dpo (TRL's sigmoid loss, beta {shown}, reference = {ref})")
    said = [k for k in NOTED if raw.get(k) is not None]
    if said:
        notes.append(f"{', '.join(said)}: noted, no effect (speed or memory options of TRL's trainer; max_prompt_len "
                     "does not reach TRL 1.8.0's DPO in Axolotl either)")
    other = sorted(k for k in trl if k != "beta")
    if other:
        notes.append(f"ignored trl keys (not read by {rl.upper()}): {', '.join(other)}")


__all__ = ["map_rl", "RL_KEYS", "ONLINE", "BUILT"]
