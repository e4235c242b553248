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

KTO is TRL 1.8.0's KTOTrainer (loss_type "kto") as Axolotl's `rl: kto` runs it, on unpaired rows (a prompt, a
completion, a desirable / undesirable label): per row, with r = β·(policy − reference log-probability of its
completion) and z the KL estimate, desirable rows 1 − σ(r − β·z) times `desirable_weight`, undesirable rows
1 − σ(β·z − r) times `undesirable_weight`; a micro-batch's loss is the mean over its rows. z: each micro-batch (TRL's
per-device batch) pairs row i's prompt with row i−1's completion (row 0 with the last row's), the policy's minus the
reference's log-probabilities of those mismatched rows averaged over the micro-batch, then over the data-parallel
ranks' micro-batches of the same accumulation step (TRL's gather across processes), clamped at 0, no gradient. The
reference is the base with the LoRA adapters disabled, or for a full fine-tune the starting weights' log-probabilities
of every row and of its KL row, computed once before step 1. The eval (val_set_size / test_datasets) is TRL's, in
rounds of the held-out rows in order. What the loop does: adapter/train/kto.py.

A reward model (Axolotl's `reward_model: true`) is TRL 1.8.0's RewardTrainer: transformers' sequence-classification
class of the checkpoint with one label scores each sequence at its last token that is not the pad token; per pair
−log σ(r_chosen − r_rejected), plus `reward.center_coefficient` (TRL's center_rewards_coefficient) times
(r_chosen + r_rejected)², averaged over the step's pairs. No reference. What the loop does: adapter/train/reward.py.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from adapter.config.values import Float, Int
from adapter.config.values import Strict as _Strict
from adapter.errors import bad


class DPOSection(_Strict):
    beta: Float = Field(0.1, gt=0, description="TRL's beta (Axolotl's rl_beta / trl.beta; TRL's default 0.1): the "
                                               "strength of the pull towards the reference")
    padding_free: bool = Field(False, description="TRL's padding_free (Axolotl's dpo_padding_free): each micro-batch's "
                               "chosen and rejected sequences run as one stream of their real tokens, attention "
                               "confined to each sequence, no padding computed (the same numbers; any pair objective)")
    precompute_ref: bool = Field(False, description="TRL's precompute_ref_log_probs (Axolotl's key of that name, "
                                 "rl: dpo / ipo): the reference's log-probabilities of every pair (and held-out "
                                 "pair) computed once before step 1, so no step runs a reference forward; a full "
                                 "fine-tune and LoRA from a saved adapter always do this; fresh LoRA's reference is "
                                 "the base either way, so the numbers are the same")
    share_prompt: Literal["auto"] | bool = Field(
        "auto", description="run each pair's prompt once for both answers (the same numbers; the policy's and the "
        "reference's forwards compute ~25% fewer tokens on a typical pair): auto = wherever it is built (cp 1, "
        "attention the varlen kernels compute, no recurrent layers, no trained load-balancing loss, eager layers), "
        "said in the first lines; true refuses a run where it is not built; false keeps one sequence per answer")


class ORPOSection(_Strict):
    alpha: Float = Field(0.1, gt=0, description="ORPO's weight of the odds-ratio term: TRL's ORPOConfig.beta "
                                                "(Axolotl: trl.beta, else rl_beta, else orpo_alpha; TRL's default 0.1)")


class SimPOSection(_Strict):
    beta: Float = Field(0.1, gt=0, description="TRL's CPOConfig.beta (Axolotl: trl.beta, else rl_beta; TRL's 0.1)")
    gamma: Float = Field(0.5, description="SimPO's target reward margin γ (Axolotl's simpo_gamma; TRL's default 0.5)")
    cpo_alpha: Float = Field(1.0, ge=0, description="weight of the chosen completions' NLL (Axolotl's cpo_alpha; "
                                                    "TRL's CPOConfig default 1.0; 0 is SimPO's paper)")


class KTOSection(_Strict):
    beta: Float = Field(0.1, gt=0, description="TRL's KTOConfig.beta (Axolotl: trl.beta, else rl_beta; TRL's 0.1)")
    desirable_weight: Float = Field(1.0, gt=0, description="weight of the desirable rows' losses (Axolotl's "
                                                           "kto_desirable_weight; an unset or 0 one is 1.0)")
    undesirable_weight: Float = Field(1.0, gt=0, description="weight of the undesirable rows' losses (Axolotl's "
                                                             "kto_undesirable_weight; an unset or 0 one is 1.0)")


class EAFTSection(_Strict):
    """Entropy-Aware Focal Training on a supervised run (Axolotl's use_eaft, eaft_alpha, eaft_k): each token's loss
    times (entropy of the softmax over its k largest logits)^alpha, without gradient (adapter/kernels/eaft.py)."""
    alpha: Float = Field(1.0, ge=0, description="the entropy's exponent (eaft_alpha; Axolotl's default 1.0)")
    k: Int = Field(20, ge=1, description="how many of the largest logits the entropy is taken over (eaft_k; 20)")


class RewardSection(_Strict):
    center_coefficient: Float | None = Field(None, ge=0, description="TRL's center_rewards_coefficient (Axolotl's key "
                                             "of that name): the weight of (r_chosen + r_rejected)² in each pair's "
                                             "loss, pulling rewards towards mean zero; unset = none")


class PreferenceFields(_Strict):
    """A preference entry's columns (Axolotl's chat_template.default): the chosen and rejected answers."""
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"


# What each preference objective runs per row of the config's micro-batch (adapter/train/dpo.py, kto.py): sequences
# with gradients (both answers of a pair; KTO: the row), and forward-only passes over that many sequences a step
# (the reference with fresh LoRA adapters disabled; KTO: its KL rows through the policy and both through the
# reference). A fixed reference (`fixed_reference`) is a table computed once instead: no pass a step.
PREFERENCE_PASSES = {"dpo": (2, 1), "ipo": (2, 1), "orpo": (2, 0), "simpo": (2, 0), "kto": (1, 3), "reward": (2, 0)}
PAIR_OBJECTIVES = tuple(k for k, (grad, _) in PREFERENCE_PASSES.items() if grad == 2)  # chosen and rejected


class RLFields(_Strict):
    """`objective: dpo` / `ipo` / `orpo` / `simpo` / `kto` / `reward` with its section (ipo reads dpo.beta); refused
    where the loop does not build it (one line each)."""
    objective: Literal["sft", "dpo", "ipo", "orpo", "simpo", "kto", "reward"] = Field(
        "sft", description="sft (next-token loss), dpo, ipo, orpo or simpo (preference pairs), kto (labelled rows), "
        "reward (a reward model scoring each answer of a pair: TRL's RewardTrainer)")
    dpo: DPOSection = DPOSection()
    orpo: ORPOSection = ORPOSection()
    simpo: SimPOSection = SimPOSection()
    kto: KTOSection = KTOSection()
    reward: RewardSection = RewardSection()
    eaft: EAFTSection | None = Field(None, description="Entropy-Aware Focal Training weights on the next-token loss "
                                     "(Axolotl's use_eaft); unset: plain cross-entropy")

    def preference_passes(self) -> tuple[int, int]:
        """(sequences with gradients, forward-only passes) per row of the micro-batch: PREFERENCE_PASSES, less the
        reference's pass where it is a table (`fixed_reference`)."""
        grad, forwards = PREFERENCE_PASSES[self.objective]
        if not self.fixed_reference():
            return grad, forwards
        return grad, 1 if self.objective == "kto" else 0  # KTO's KL rows still go through the policy

    def padding_free_pairs(self) -> bool:
        """Whether a micro-batch's preference sequences run as one stream without padding (dpo.padding_free)."""
        return self.dpo.padding_free and self.objective in PAIR_OBJECTIVES and self.objective != "reward"

    def fixed_reference(self) -> bool:
        """Whether the DPO/IPO/KTO reference is the starting model's log-probabilities, computed once before step 1
        (adapter/train/dpo.reference_table; KTO's with its KL rows: adapter/train/kto.reference_table): a full
        fine-tune's starting weights, and (DPO/IPO) LoRA started from a saved adapter (lora.init_from, Axolotl's
        lora_model_dir), whose reference TRL makes a frozen copy of that adapter (DPOTrainer's "ref" adapter), not
        the base. Fresh adapters (B = 0) start as the base, so disabling them each
        step gives their reference without a table."""
        lora = self.lora  # type: ignore[attr-defined]
        return (self.objective in ("dpo", "ipo") and (lora is None or bool(lora.init_from) or self.dpo.precompute_ref)
                or self.objective == "kto" and lora is None)  # KTO's LoRA: the base (adapters disabled), as TRL

    @model_validator(mode="after")
    def _dpo_scope(self) -> RLFields:
        if self.objective == "sft":
            return self
        rl, kind = self.objective.upper(), "chat_template.argilla" if self.objective == "orpo" else (
            "llama3.ultra or another of Axolotl's KTO types" if self.objective == "kto" else
            "bradley_terry.chat_template (system, input, chosen, rejected)" if self.objective == "reward" else
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
        if self.objective == "kto":
            self._kto_scope(ax)
        if self.objective == "reward":
            self._reward_scope(ax)
        return self

    @model_validator(mode="after")
    def _padding_free_scope(self) -> RLFields:
        if self.dpo.precompute_ref and self.objective not in ("dpo", "ipo"):
            raise bad("dpo.precompute_ref", True, f"objective {self.objective} has no reference model to precompute "
                      "here (ORPO and SimPO have none; KTO's is not built as a table for LoRA)", "remove it")
        if self.dpo.share_prompt is True and self.objective not in PAIR_OBJECTIVES:
            raise bad("dpo.share_prompt", True, f"it shares a pair's prompt between its answers; objective "
                      f"{self.objective} has no pairs", "remove it")
        if self.dpo.padding_free and not self.padding_free_pairs():
            raise bad("dpo.padding_free", True, f"it packs preference pairs; objective {self.objective} has none "
                      "(KTO's rows and their KL rows run padded)", "remove it")
        return self

    def _reward_scope(self, ax: bool) -> None:
        """What the reward model's loop does not build, one line each (adapter/train/reward.py)."""
        p = self.parallelism  # type: ignore[attr-defined]
        lora = self.lora  # type: ignore[attr-defined]
        if lora is not None and lora.quantize_base is not None:
            raise bad("adapter" if ax else "lora.quantize_base", "qlora" if ax else lora.quantize_base, "a 4/8-bit "
                      "base under a reward model's score head is not built", "train LoRA on the 16-bit base "
                      "(adapter: lora), or run this config with Axolotl")
        if p.cp_size > 1:
            raise bad("context_parallel_size" if ax else "parallelism.cp_size", p.cp_size, "a reward model's score "
                      "head reads each sequence's last token; splitting the sequence over ranks is not built for it",
                      "set it to 1 (dp_shard_size and tp shard a reward model)")

    def _kto_scope(self, ax: bool) -> None:
        """What KTO's loop does not build, one line each (the module docstring)."""
        mb = self.batch.micro_batch_size  # type: ignore[attr-defined]
        if mb < 2:
            raise bad("micro_batch_size" if ax else "batch.micro_batch_size", mb, "KTO's KL term pairs each row's "
                      "prompt with another row's completion inside a micro-batch (TRL's per-device batch), and TRL "
                      "refuses a batch of 1 (its KL estimate would be the row's own reward)", "set it to 2 or more")


__all__ = ["PREFERENCE_PASSES", "RewardSection", "DPOSection", "ORPOSection", "SimPOSection", "KTOSection",
           "PreferenceFields", "RLFields"]
