"""The training objective's config: supervised fine-tuning (the default), DPO, IPO, ORPO or SimPO on preference
pairs, and the two fields a preference dataset entry adds. Mixed into schema.py's `RunConfig` and `DatasetEntry`
(kept here: schema.py is at its size budget).

DPO is TRL's `DPOTrainer` as Axolotl 067b021 runs it (TRL 1.8.0): the sigmoid loss -log σ(β·Δ), Δ the difference of
the chosen and rejected completions' log-ratios policy/reference, averaged over the step's pairs; the reference is
the base with the LoRA adapters disabled, or for a full fine-tune the starting weights' log-probabilities. What the
loop does with it: adapter/train/dpo.py.

ORPO is TRL's ORPOTrainer (trl.experimental.orpo) as Axolotl runs it: no reference; per pair −α·log σ(log-odds of
the chosen minus the rejected, from their mean per-token log-probabilities), plus the chosen sequences' mean
next-token loss over all of their tokens, prompt included. α is TRL's `beta` (Axolotl passes `orpo_alpha` there).

IPO is TRL 1.8.0's DPOTrainer with loss_type ["ipo"] (Axolotl's `rl: ipo`, or `rl: dpo` with `dpo_loss_type: [ipo]`):
the same reference and log-ratios as DPO, each divided by its completion's token count (TRL's length averaging, which
the IPO authors confirmed), per pair (Δ − 1/(2β))²; β is `dpo.beta` (IPO's τ). Why a separate objective and not a
`dpo.loss_type`: each built loss is proven against TRL on its own; a list of weighted losses is not built.

SimPO is TRL's CPOTrainer (trl.experimental.cpo) with loss_type "simpo", as Axolotl's `rl: simpo` runs it: no
reference; each answer's log-probability the mean over its completion tokens; per pair −log σ(β·(c − r) − γ); plus
`cpo_alpha` times the chosen completions' mean next-token loss (TRL's CPOConfig default 1.0, which Axolotl keeps when
`cpo_alpha` is unset: SimPO as its paper states it is cpo_alpha 0).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from adapter.config.values import Float
from adapter.errors import bad


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DPOSection(_Strict):
    beta: Float = Field(0.1, gt=0, description="TRL's beta (Axolotl's rl_beta / trl.beta; TRL's default 0.1): the "
                                               "strength of the pull towards the reference")


class ORPOSection(_Strict):
    alpha: Float = Field(0.1, gt=0, description="ORPO's weight of the odds-ratio term: TRL's ORPOConfig.beta "
                                                "(Axolotl: trl.beta, else rl_beta, else orpo_alpha; TRL's default 0.1)")


class SimPOSection(_Strict):
    beta: Float = Field(0.1, gt=0, description="TRL's CPOConfig.beta (Axolotl: trl.beta, else rl_beta; TRL's 0.1)")
    gamma: Float = Field(0.5, description="SimPO's target reward margin γ (Axolotl's simpo_gamma; TRL's default 0.5)")
    cpo_alpha: Float = Field(1.0, ge=0, description="weight of the chosen completions' NLL (Axolotl's cpo_alpha; "
                                                    "TRL's CPOConfig default 1.0; 0 is SimPO's paper)")


class PreferenceFields(_Strict):
    """A preference entry's columns (Axolotl's chat_template.default): the chosen and rejected answers."""
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"


class RLFields(_Strict):
    """`objective: dpo` / `ipo` / `orpo` / `simpo` with its section (ipo reads dpo.beta); refused where the loop does
    not build it (one line each)."""
    objective: Literal["sft", "dpo", "ipo", "orpo", "simpo"] = Field(
        "sft", description="sft (next-token loss), dpo, ipo, orpo or simpo (preference pairs)")
    dpo: DPOSection = DPOSection()
    orpo: ORPOSection = ORPOSection()
    simpo: SimPOSection = SimPOSection()

    @model_validator(mode="after")
    def _dpo_scope(self) -> RLFields:
        if self.objective == "sft":
            return self
        rl, kind = self.objective.upper(), "chat_template.argilla" if self.objective == "orpo" else (
            "chat_template.default with field_messages, field_chosen, field_rejected")
        d, ax = self.data, self.source == "axolotl"  # type: ignore[attr-defined]
        key = (lambda k: k) if ax else (lambda k: f"data.{k}")  # these data keys: Axolotl's top-level names
        if not d.datasets:
            raise bad(key("datasets"), [], f"{rl} trains on preference pairs", f"list a preference dataset (type: "
                      f"{kind})")
        if any("cross_entropy" in k for k in self.model.liger):  # type: ignore[attr-defined]
            raise bad("liger_cross_entropy" if ax else "model.liger", True, f"{rl} needs per-token "
                      "log-probabilities; Liger's cross-entropy returns their sum",
                      "remove liger_cross_entropy / liger_fused_linear_cross_entropy")
        if d.sample_packing:
            raise bad(key("sample_packing"), True, "preference pairs are not packed yet", "set sample_packing: false")
        if d.excess_length_strategy != "drop":
            raise bad(key("excess_length_strategy"), d.excess_length_strategy, "pairs longer than sequence_len are "
                      "dropped (Axolotl's default); truncate and raise are not built for preference pairs", "remove it")
        return self


__all__ = ["DPOSection", "ORPOSection", "SimPOSection", "PreferenceFields", "RLFields"]
