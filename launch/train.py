#!/usr/bin/env python
"""The one training entry point, for any launcher:

    deepspeed --num_gpus 8 launch/train.py --config configs/llama-3.1-8b-hsdp-tp.yaml
    torchrun --nproc-per-node 8 launch/train.py --config configs/llama-3.1-8b-hsdp-tp.yaml
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from adapter.train.worker import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
