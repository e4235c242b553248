"""What a run's model is, torch-free (plan, preflight and the config checks read it without loading torch): the
architecture from an HF config.json (`arch.py`), one record per family with its weight table (`families.py`,
rules in `mapping.py`), its linears, parameter counts and FLOPs (`counts.py`), config × architecture checks
(`checks.py`), and where its HF files and first weights come from (`source.py`). The torch model built from these
facts is adapter/modeling/; the kernels it runs are adapter/kernels/."""
