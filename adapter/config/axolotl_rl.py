"""Axolotl's `rl:` keys mapped onto `objective:` and `dpo:` (adapter/config/schema_rl.py).

Built: `rl: dpo` with TRL's sigmoid loss, as Axolotl 067b021 hands it to TRL 1.8.0's DPOTrainer (its
core/builders/rl.py and core/trainers/dpo/__init__.py): beta from `trl.beta`, else `rl_beta` (the deprecated
`dpo_beta` fills an unset `rl_beta`), else TRL's 0.1. `rl: orpo` as Axolotl hands it to TRL's ORPOTrainer: the same
chain with `orpo_alpha` last (Axolotl: "trl does some odd mapping of alpha to beta"), the DPO options not passed.
`rl: ipo` (and `rl: dpo` with `dpo_loss_type: [ipo]`, which Axolotl passes to TRL as it is) is the DPOTrainer with
loss_type ["ipo"] and the same beta (Axolotl's DPOStrategy; it passes no label smoothing for ipo). `rl: simpo` is
TRL's CPOTrainer with loss_type "simpo" (Axolotl's AxolotlCPOTrainer, no reference, no peft_config reference):
beta as for DPO, `simpo_gamma` as given, `cpo_alpha` when given (else TRL's 1.0). An unset `simpo_gamma` is refused:
Axolotl's AxolotlCPOConfig declares it with default None and passes None, which TRL's loss cannot divide.
`rl: kto` is TRL's KTOTrainer (loss_type "kto", as Axolotl builds its KTOConfig): beta as for DPO (`orpo_alpha` is
refused: Axolotl would hand it to TRL as beta), `kto_desirable_weight` / `kto_undesirable_weight` as Axolotl passes
them (`value or 1.0`: unset or 0 is 1.0); the DPO / SimPO options do not reach that trainer and are noted.
Every other `rl:` value, and any DPO option that would change the loss, is refused in one line: a preference config
run as something else would finish and export a model that is not the one asked for.

`reward_model: true` (with `model_type: AutoModelForSequenceClassification`, `num_labels: 1`) is TRL's RewardTrainer
as Axolotl's AxolotlRewardTrainer runs it: `center_rewards_coefficient` passed when set, the pairs Axolotl's
`bradley_terry.chat_template` type renders (adapter/data/sft/preference_bt.py).
"""
from __future__ import annotations

from typing import Any

from adapter.config.axolotl_scope import is_on
from adapter.errors import bad

ONLINE = ("grpo", "gdpo", "ebft")  # they sample completions from the policy during training
BUILT = ("dpo", "ipo", "orpo", "simpo", "kto")
SIMPO_KEYS = ("simpo_gamma", "cpo_alpha")
# DPO options of Axolotl that change TRL's loss, refused when on: (why, fix)
LOSS_OPTIONS = {
    "dpo_label_smoothing": ("TRL 1.8.0 (Axolotl's pin) ignores label smoothing in the sigmoid loss, so the value would "
                            "do nothing there either; conservative DPO (the robust loss) is not built", "remove it"),
    "dpo_use_weighting": ("WPO weighting is not built", "remove it"),
    "dpo_loss_weights": ("weighted mixtures of DPO losses are not built", "remove it (one sigmoid loss)"),
    "rpo_alpha": ("RPO (an NLL term on the chosen answer) is not built", "remove it"),
    "dpo_norm_loss": ("the length-normalised DPO loss is not built", "remove it"),
    "simpo_gamma": ("SimPO's margin: Axolotl passes it to rl: simpo only", "remove it, or set rl: simpo"),
    "cpo_alpha": ("CPO's NLL weight: Axolotl passes it to rl: simpo only", "remove it, or set rl: simpo"),
    "orpo_alpha": ("ORPO's weight: Axolotl would hand it to this trainer as beta when rl_beta is unset",
                   "give rl_beta instead, or set rl: orpo"),
}
# read here; the speed / memory options are noted (nd-adapter's own forward runs the pairs)
NOTED = ("dpo_use_liger_kernel", "max_prompt_len")
KTO_KEYS = ("kto_desirable_weight", "kto_undesirable_weight")  # read by rl: kto only
DPO_FLAGS = {  # Axolotl's boolean for TRL's DPOConfig -> the dpo: key it sets, what it does
    "dpo_padding_free": ("padding_free", "each micro-batch's sequences as one stream of their real tokens, "
                                         "attention confined to each: TRL's padding_free"),
    "precompute_ref_log_probs": ("precompute_ref", "the reference's log-probabilities of every pair computed once "
                                                   "before step 1; no reference forward in a step")}
REWARD_KEYS = ("reward_model", "center_rewards_coefficient", "num_labels", "process_reward_model")
EAFT_KEYS = ("use_eaft", "eaft_alpha", "eaft_k")
RL_KEYS = {*REWARD_KEYS, "rl", "rl_beta", "dpo_beta", "beta", "trl", "dpo_loss_type", *DPO_FLAGS, *LOSS_OPTIONS, *NOTED,
           *KTO_KEYS, *EAFT_KEYS}


def map_rl(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`rl: dpo` -> objective: dpo with dpo.beta; other values and unbuilt loss options: one line, exit 2."""
    rl = raw.get("rl")
    if not is_on(rl):
        return
    if rl in ONLINE:
        raise bad("rl", rl, f"{rl.upper()} is an online method: it generates completions with the policy during "
                  "training (rollouts Axolotl samples through vLLM or the trainer's own generate), which nd-adapter "
                  "does not do",
                  "run this config with Axolotl, or train DPO on fixed preference pairs (rl: dpo)")
    if rl not in BUILT:
        raise bad("rl", rl, f"only rl: {', '.join(BUILT)} are built", "use rl: dpo, or run this config with Axolotl")
    loss = raw.get("dpo_loss_type")
    if rl == "dpo" and loss in ("ipo", ["ipo"]):
        rl = "ipo"  # Axolotl passes dpo_loss_type to TRL's DPOConfig as it is
    elif rl == "dpo" and loss not in (None, "sigmoid", ["sigmoid"]):
        raise bad("dpo_loss_type", loss, "only TRL's sigmoid and ipo losses are built, one at a time",
                  "remove it (sigmoid is the default), or give [ipo]")
    ignores = {"orpo": (*LOSS_OPTIONS, "dpo_loss_type"),  # not passed to these trainers by Axolotl
               "simpo": tuple(k for k in (*LOSS_OPTIONS, "dpo_loss_type") if k not in (*SIMPO_KEYS, "orpo_alpha")),
               # rl: ipo gets neither; rl: dpo passes both to TRL, whose ipo loss reads no label smoothing
               "ipo": ("dpo_label_smoothing", "dpo_loss_type") + (("dpo_loss_weights",) if raw["rl"] == "ipo" else ()),
               "kto": tuple(k for k in (*LOSS_OPTIONS, "dpo_loss_type") if k != "orpo_alpha"),  # KTOConfig gets none
               }.get(rl, ())
    for key, (why, fix) in LOSS_OPTIONS.items():
        if is_on(raw.get(key)) and key not in ignores and not (rl == "simpo" and key in SIMPO_KEYS):
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
        section = {"orpo": "orpo", "simpo": "simpo", "kto": "kto"}.get(rl, "dpo")  # ipo reads dpo.beta
        out.setdefault(section, {})["alpha" if rl == "orpo" else "beta"] = float(beta)
    shown = beta if beta is not None else 0.1
    if rl == "simpo":
        _simpo(raw, out, notes, shown)
    elif rl == "kto":
        _kto(raw, out, notes, shown)
    elif rl == "orpo":
        notes.append(f"rl: orpo -> objective: orpo (TRL's ORPOTrainer, orpo.alpha {shown} as its beta, no reference)")
    else:
        ref = ("the base with the LoRA adapters disabled" if is_on(raw.get("adapter")) else
               "the starting weights' log-probabilities, computed once before step 1")
        how = "rl: ipo" if raw.get("rl") == "ipo" else "rl: dpo with dpo_loss_type ipo" if rl == "ipo" else "rl: dpo"
        notes.append(f"{how} -> objective: {rl} (TRL's {'ipo' if rl == 'ipo' else 'sigmoid'} loss, beta {shown}, "
                     f"reference = {ref})")
    for key, (native, what) in DPO_FLAGS.items():  # booleans as Axolotl's schema reads them (axolotl_values)
        value = raw.get(key)
        if value and rl in ("dpo", "ipo"):  # Axolotl hands them to TRL's DPOConfig only
            out.setdefault("dpo", {})[native] = True
            notes.append(f"{key}: true -> dpo.{native} ({what})")
        elif value is not None:
            notes.append(f"{key}: not read by {rl.upper()} (Axolotl hands it to TRL's DPO trainer only)")
    if rl != "kto" and any(raw.get(k) is not None for k in KTO_KEYS):
        notes.append(f"{', '.join(k for k in KTO_KEYS if raw.get(k) is not None)}: read by rl: kto only")
    ignored = [k for k in ignores if raw.get(k) is not None and not (rl == "ipo" and k == "dpo_loss_type")]
    if ignored:
        notes.append(f"{', '.join(ignored)}: not read by {rl.upper()} (Axolotl 067b021 with TRL 1.8.0 does not "
                     "apply them to it)")
    said = [k for k in NOTED if raw.get(k) is not None]
    if said:
        notes.append(f"{', '.join(said)}: noted, no effect (dpo_use_liger_kernel: TRL's fused loss, which "
                     "nd-adapter's own loss replaces; max_prompt_len does not reach TRL 1.8.0's DPO in Axolotl "
                     "either)")
    other = sorted(k for k in trl if k != "beta")
    if other:
        notes.append(f"ignored trl keys (not read by {rl.upper()}): {', '.join(other)}")


def map_process_reward(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`process_reward_model: true` -> model.num_labels (Axolotl's num_labels, its default 2): TRL's PRMTrainer, the
    checkpoint's token-classification class trained on the class of each step's last token (stepwise_supervised
    rows), with the model's dropout off (PRMConfig's disable_dropout) and the eval's accuracy over labelled tokens.
    Beside `rl:` or `reward_model` it is refused in one line."""
    if not is_on(raw.get("process_reward_model")):
        return
    for key in ("rl", "reward_model"):
        if is_on(raw.get(key)):
            raise bad("process_reward_model", True, f"a process reward model and {key}: {raw[key]} are two "
                      "objectives", "remove one of them")
    labels = raw.get("num_labels")
    labels = 2 if labels is None else labels
    if isinstance(labels, bool) or not isinstance(labels, int) or labels < 2:
        raise bad("num_labels", labels, "a process reward model classifies each step's last token into at least "
                  "two classes", "set num_labels: 2 (or more), or remove it")
    out.setdefault("model", {})["num_labels"] = labels
    notes.append(f"process_reward_model: true -> model.num_labels: {labels} (TRL's PRMTrainer: the checkpoint's "
                 "token-classification class, cross-entropy on each step's last token, dropout off, the eval's "
                 "accuracy over the labelled tokens)")


def map_reward(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`reward_model: true` -> objective: reward (reward.center_coefficient from center_rewards_coefficient);
    `num_labels` other than 1 and `rl:` beside it are refused in one line (TRL refuses the first too)."""
    if is_on(raw.get("process_reward_model")):
        return map_process_reward(raw, out, notes)
    if not is_on(raw.get("reward_model")):
        for key in ("center_rewards_coefficient", "num_labels"):
            if raw.get(key) is not None:
                notes.append(f"{key}: read by reward_model: true only")
        return
    if is_on(raw.get("rl")):
        raise bad("reward_model", True, f"a reward model and rl: {raw['rl']} are two objectives",
                  "remove one of them")
    labels = raw.get("num_labels")
    if labels is not None and labels != 1:
        raise bad("num_labels", labels, "a reward model has one label: its scalar reward (TRL's RewardTrainer "
                  "refuses another count)", "set num_labels: 1")
    c = raw.get("center_rewards_coefficient")
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0):
        raise bad("center_rewards_coefficient", c, "must be a number ≥ 0", "give e.g. 0.01, or remove it")
    out["objective"] = "reward"
    if c is not None:
        out.setdefault("reward", {})["center_coefficient"] = float(c)
    notes.append("reward_model: true -> objective: reward (TRL's RewardTrainer: the checkpoint's sequence-"
                 "classification class scoring each answer at its last token, loss −log σ(r_chosen − r_rejected)"
                 + (f" + {c}·(r_chosen + r_rejected)²" if c else "") + ", no reference)")


def map_eaft(raw: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    """`use_eaft: true` -> eaft: {alpha: eaft_alpha, k: eaft_k} (Axolotl's defaults 1.0 and 20 where unset or null);
    without it eaft_alpha / eaft_k do nothing in Axolotl (its trainer builder reads them only beside use_eaft)."""
    if not is_on(raw.get("use_eaft")):
        said = [k for k in EAFT_KEYS[1:] if raw.get(k) is not None]
        if said:
            notes.append(f"{', '.join(said)}: read beside use_eaft: true only, as in Axolotl")
        return
    alpha, k = raw.get("eaft_alpha"), raw.get("eaft_k")
    out["eaft"] = {"alpha": 1.0 if alpha is None else alpha, "k": 20 if k is None else k}
    notes.append(f"use_eaft: true -> eaft: each token's loss × (entropy of the softmax over its "
                 f"{out['eaft']['k']} largest logits)^{out['eaft']['alpha']}, without gradient (Axolotl's EAFT loss)")


def _kto(raw: dict[str, Any], out: dict[str, Any], notes: list[str], beta: float) -> None:
    """kto_desirable_weight / kto_undesirable_weight onto `kto:`, as Axolotl passes them (`value or 1.0`)."""
    weights = []
    for key, field in zip(KTO_KEYS, ("desirable_weight", "undesirable_weight")):
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise bad(key, v, "must be a number ≥ 0", f"give e.g. {key}: 1.0 (TRL's default)")
        w = float(v or 1.0)  # Axolotl: `self.cfg.kto_desirable_weight or 1.0`
        out.setdefault("kto", {})[field] = w
        weights.append(w)
    notes.append(f"rl: kto -> objective: kto (TRL's KTOTrainer, loss_type kto, beta {beta}, desirable_weight "
                 f"{weights[0]}, undesirable_weight {weights[1]}, KL term over each micro-batch's mismatched rows, "
                 "reference = the base with the LoRA adapters disabled)")


def _simpo(raw: dict[str, Any], out: dict[str, Any], notes: list[str], beta: float) -> None:
    """simpo_gamma (required: see the module docstring) and cpo_alpha onto `simpo:`."""
    gamma, alpha = raw.get("simpo_gamma"), raw.get("cpo_alpha")
    if gamma is None:
        raise bad("simpo_gamma", None, "Axolotl passes an unset simpo_gamma to TRL's CPOConfig as None (its "
                  "AxolotlCPOConfig's default), and TRL's SimPO loss fails on it at the first step",
                  "give simpo_gamma (TRL's documented default is 0.5)")
    for key, v, low in (("simpo_gamma", gamma, None), ("cpo_alpha", alpha, 0.0)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or (low is not None and v < low)):
            raise bad(key, v, "must be a number" + (" ≥ 0" if low is not None else ""), f"give e.g. {key}: 0.5")
    out.setdefault("simpo", {})["gamma"] = float(gamma)
    if alpha is not None:
        out["simpo"]["cpo_alpha"] = float(alpha)
    if raw.get("warmup_ratio"):
        raise bad("warmup_ratio", raw["warmup_ratio"], "Axolotl refuses warmup_ratio with the simpo trainer",
                  "use warmup_steps instead")
    a = alpha if alpha is not None else 1.0
    notes.append(f"rl: simpo -> objective: simpo (TRL's CPOTrainer, loss_type simpo, beta {beta}, simpo_gamma {gamma}, "
                 f"cpo_alpha {a}{' (TRL default: the chosen completions NLL is added)' if alpha is None else ''}, "
                 "no reference)")


__all__ = ["map_process_reward", "map_rl", "map_reward", "map_eaft", "RL_KEYS", "REWARD_KEYS", "ONLINE", "BUILT"]
