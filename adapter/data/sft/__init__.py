"""Supervised fine-tuning data: Axolotl's `datasets:` entries -> tokens, trained-token masks and packed fixed-length
samples, cached once for every rank. sources.py (where rows come from), formats.py (dataset types), templates.py
(chat templates, trained spans), bins.py (examples packed into samples, the item API), prepare.py (cache, entry
point), report.py (`nd-adapter preprocess`)."""
from adapter.data.sft.bins import SFTDataset
from adapter.data.sft.prepare import SFTData, check, prepare

__all__ = ["SFTData", "SFTDataset", "check", "prepare"]
